"""Serving shapes: packed variable-length batches (`cu_seqlens`) and paged KV caches, through the module's stages.

A packed batch holds sequences end to end, `(1, total, d_model)`, with `cu_seqlens` `(num_seqs + 1,)` their
offsets (FlashAttention's varlen layout, transformers' `cu_seq_lens_q`): no padding is allocated. Each
sequence attends only to itself, with its own positions (RoPE restarts at each sequence, or continues from
what a paged cache holds of it), its own causal mask and window: it is run through the module's own forward
on a view of its tokens (`query[:, start:end]`), so every stage, variant and check of the module applies
unchanged, and a sequence computes exactly what it computes alone. One new token of every sequence of a
paged cache (decoding) runs as one batch instead: the sequences' held keys gathered right-aligned, the
shorter ones padded on the left and masked (`DecodeView`).
"""

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._core.errors import ConfigError, ShapeError
from .paged import DecodeView, PagedKVCache, SequenceView

OWNER = "MultiHeadAttention.forward()"


def check_cu_seqlens(cu_seqlens: Any, total: int, num_seqs: int | None = None, owner: str = OWNER) -> list[int]:
    """The offsets `cu_seqlens` holds, as ints, after checking they describe a packed batch of `total` tokens.

    Example:
        >>> import torch
        >>> from shapesafe_mha._compute.packed import check_cu_seqlens
        >>> check_cu_seqlens(torch.tensor([0, 3, 5], dtype=torch.int32), total=5)
        [0, 3, 5]

    Raises:
        ShapeError: not a 1-D integer tensor, not starting at 0, decreasing somewhere, not ending at `total`,
            or (`num_seqs` given) describing another number of sequences; the message names `cu_seqlens`,
            the index and the sizes.
    """
    if not isinstance(cu_seqlens, Tensor):
        kind = type(cu_seqlens).__name__
        raise ShapeError(f"{owner}: cu_seqlens must be an int32 tensor (num_seqs + 1,), but got {kind}.")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() == 0:
        raise ShapeError(
            f"{owner}: cu_seqlens must be a 1-D int32 (or int64) tensor of num_seqs + 1 offsets, but got "
            f"{str(cu_seqlens.dtype).removeprefix('torch.')} of shape {tuple(cu_seqlens.shape)}."
        )
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0:
        raise ShapeError(
            f"{owner}: cu_seqlens[0] is {offsets[0]}, but a packed batch's first sequence starts at 0; cu_seqlens "
            f"holds each sequence's start and then the end, from 0 to total={total}."
        )
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ShapeError(
                f"{owner}: cu_seqlens[{i}]={offsets[i]} is less than cu_seqlens[{i - 1}]={offsets[i - 1]}, so "
                f"sequence {i - 1} would hold {offsets[i] - offsets[i - 1]} tokens; offsets must not decrease."
            )
    if offsets[-1] != total:
        raise ShapeError(
            f"{owner}: cu_seqlens[{len(offsets) - 1}] (the end) is {offsets[-1]}, but query holds total={total} "
            "tokens (its dimension 1); the last offset must be the packed length."
        )
    if num_seqs is not None and len(offsets) - 1 != num_seqs:
        raise ShapeError(
            f"{owner}: cu_seqlens has {len(offsets)} offsets, {len(offsets) - 1} sequences, but the PagedKVCache "
            f"serves {num_seqs} (kv_cache.sequences): one segment per live sequence, in their order (a segment may "
            "be empty)."
        )
    return offsets


def serving_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    attn_mask: Any,
    key_padding_mask: Any,
    is_causal: bool,
    need_weights: bool,
    kv_cache: Any,
    positions: Any,
    cu_seqlens: Any,
    view: Callable[[PagedKVCache, int, str], Any] = SequenceView,
    decode: Callable[[PagedKVCache, str], Any] | None = DecodeView,
) -> Tensor:
    """`MultiHeadAttention.forward` for a packed batch (`cu_seqlens`) and/or a `PagedKVCache` (see the module's
    `forward`); a failed call leaves the paged cache as it was. `view(paged, seq, owner)` is one sequence of the
    paged cache as the module's cache stage reads it, `decode(paged, owner)` one new token of every sequence
    (with its `positions` and `padding`) (`LatentAttention` passes its own); None decodes sequence by sequence."""
    owner = _owner(module)
    paged = kv_cache if isinstance(kv_cache, PagedKVCache) else None
    _refuse(module, query, key, value, attn_mask, key_padding_mask, need_weights, kv_cache, paged, owner)
    if cu_seqlens is None:  # a paged cache without offsets: one new token of each live sequence, (num_seqs, 1, d_model)
        if paged is None:
            raise ConfigError(f"{owner}: a packed or paged call needs cu_seqlens or a PagedKVCache.")
        if query.shape[1] != 1 or query.shape[0] != len(paged.sequences):
            raise ShapeError(
                f"{owner}: query is {tuple(query.shape)}, but a PagedKVCache call without cu_seqlens decodes one new "
                f"token of each of its {len(paged.sequences)} live sequences, (num_seqs, 1, d_model); for prompts "
                "or chunks pack them, (1, total, d_model), and pass cu_seqlens."
            )
        _check_positions(positions, (query.shape[0], 1), "one token of each sequence has", owner)
        if decode is not None and not _one_start(module):
            return _decoded(module, query, paged, is_causal, positions, decode, owner)
        where = None if positions is None else positions.reshape(1, -1)
        steps = list(range(query.shape[0] + 1))
        packed = query.reshape(1, -1, query.shape[2])
        return _paged(module, packed, steps, paged, is_causal, where, view, decode, owner)[0][:, None]
    if query.shape[0] != 1:
        raise ShapeError(
            f"{owner}: query has batch={query.shape[0]}, but with cu_seqlens it is a packed batch (1, total, "
            "d_model): the sequences end to end in dimension 1; pack them (torch.cat(..., dim=1))."
        )
    offsets = check_cu_seqlens(cu_seqlens, query.shape[1], None if paged is None else len(paged.sequences), owner)
    _check_positions(positions, (1, query.shape[1]), "a packed batch's positions are (1, total):", owner)
    if paged is not None:
        return _paged(module, query, offsets, paged, is_causal, positions, view, decode, owner)
    pieces = [
        module.forward(query[:, a:b], is_causal=is_causal, positions=None if positions is None else positions[:, a:b])
        for a, b in itertools.pairwise(offsets)
        if b > a
    ]
    return _joined(module, query, pieces)


_OWNERS: dict[type, str] = {}  # each module class's name in messages (looked up once: this runs every decoding step)


def _owner(module: Any) -> str:
    owner = _OWNERS.get(type(module))
    if owner is None:
        owner = f"{'LatentAttention' if hasattr(module, 'kv_lora_rank') else 'MultiHeadAttention'}.forward()"
        _OWNERS[type(module)] = owner
    return owner


def _check_positions(positions: Any, shape: tuple[int, int], what: str, owner: str) -> None:
    if positions is not None and (not isinstance(positions, Tensor) or tuple(positions.shape) != shape):
        shown = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
        raise ShapeError(f"{owner}: positions is {shown}, but {what} {shape}.")


def _refuse(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    key_padding_mask: Any,
    need_weights: bool,
    kv_cache: Any,
    paged: PagedKVCache | None,
    owner: str,
) -> None:
    """What a packed or paged call does not take, refused by name."""
    if not isinstance(query, Tensor) or query.dim() != 3:
        shown = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ShapeError(f"{owner}: query must be a tensor (1, total, d_model) with cu_seqlens, but got {shown}.")
    if (key is not None and key is not query) or (value is not None and value is not key):
        raise ConfigError(
            f"{owner}: cu_seqlens and a PagedKVCache serve self-attention; key and value must be the query (None)."
        )
    if attn_mask is not None or key_padding_mask is not None:
        raise ConfigError(
            f"{owner}: a packed or paged call takes no attn_mask or key_padding_mask: the sequences' boundaries "
            "(cu_seqlens) are its mask, and nothing is padded."
        )
    if need_weights:
        raise ConfigError(f"{owner}: need_weights is not served for packed or paged calls; call each sequence alone.")
    if kv_cache is not None and paged is None:
        raise ConfigError(
            f"{owner}: a packed batch (cu_seqlens) caches into a PagedKVCache (one block table per sequence), not a "
            f"{type(kv_cache).__name__}; make one with ssm.PagedKVCache.for_module(module, num_blocks, block_size)."
        )
    if paged is not None:
        needed, kept = getattr(module, "window", None), paged.window
        if kept is not None and (needed is None or kept < needed):
            raise ShapeError(
                f"{owner}: kv_cache keeps a window of {kept} positions, but the module attends over "
                + ("every position" if needed is None else f"a window of {needed}")
                + "; make it with PagedKVCache.for_module(module, ...)."
            )
        if not paged.sequences:
            raise ConfigError(f"{owner}: the PagedKVCache has no live sequence; add() one first.")


def _paged(
    module: Any,
    query: Tensor,
    offsets: list[int],
    paged: PagedKVCache,
    is_causal: bool,
    positions: Tensor | None,
    view: Callable[[PagedKVCache, int, str], Any],
    decode: Callable[[PagedKVCache, str], Any] | None,
    owner: str,
) -> Tensor:
    """Each live sequence's segment of `query` through the module, appending to its blocks; all or nothing."""
    seqs = paged.sequences
    sizes = [b - a for a, b in itertools.pairwise(offsets)]
    batched = not _one_start(module)  # (else one by one)
    if decode is not None and batched and all(size == 1 for size in sizes):  # decoding, packed: one batch
        where = None if positions is None else positions[0][:, None]
        return _decoded(module, query[0][:, None], paged, is_causal, where, decode, owner)[:, 0][None]
    state = paged.state()
    try:
        paged.reserve(dict(zip(seqs, sizes, strict=True)), owner)  # every block the call needs, or none, first
        pieces = []
        for seq, a, b in zip(seqs, offsets, offsets[1:], strict=False):
            if b == a:
                continue
            where = None if positions is None else positions[:, a:b]
            cache = view(paged, seq, owner)
            pieces.append(module.forward(query[:, a:b], is_causal=is_causal, kv_cache=cache, positions=where))
    except BaseException:
        paged.restore(state)
        raise
    return _joined(module, query, pieces)


def _one_start(module: Any) -> bool:
    """Whether `module`'s plan reads one cache index for a whole batch (Llama 4's temperature tuning), so sequences
    at different ones cannot decode as one batch (a `LatentAttention`: it has no such transform)."""
    return bool(getattr(getattr(module, "_plan", None), "one_start", False))


def _decoded(
    module: Any,
    query: Tensor,
    paged: PagedKVCache,
    is_causal: bool,
    positions: Tensor | None,
    view: Callable[[PagedKVCache, str], Any],
    owner: str,
) -> Tensor:
    """One new token of every live sequence, `query` `(num_seqs, 1, d_model)`, as one batch (`view`, a `DecodeView`
    or the module's own); all or nothing (without a window, the step's undo point is `_step_state`: the blocks it
    takes, not a copy of every table and the free list)."""
    light = paged.window is None
    state: Any = paged._step_state() if light else paged.state()
    try:
        decode = view(paged, owner)
        if module.rotary is None:
            where = None
        elif positions is not None:
            where = positions
        else:
            where = decode.positions.to(query.device)
        out = module.forward(
            query, is_causal=is_causal, kv_cache=decode, key_padding_mask=decode.padding, positions=where
        )
    except BaseException:
        if light:
            paged._undo_step(state)
        else:
            paged.restore(state)
        raise
    if light:
        paged._end_step()
    return out


def _joined(module: Any, query: Tensor, pieces: list[Tensor]) -> Tensor:
    if not pieces:  # every segment empty: nothing computed, nothing to return
        return query.new_zeros(1, 0, module.d_model)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
