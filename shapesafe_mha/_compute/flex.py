"""FlexAttention as a typed stage: torch's `flex_attention` with the library's dimensions, BlockMask lengths included.

torch checks a BlockMask's lengths deep inside the call, with a `ValueError` that names neither the
argument nor the dimension; here they are dimensions of the call, checked before it runs. GQA never
copies K or V: compiled, torch's kernel reads each KV head for its whole group (`enable_gqa=True`);
eager, where torch's own path repeats K and V to `num_heads` heads, the query heads of a group are
folded into the query axis instead (as `scaled_dot_product_attention` does) and the mods are given
the indices they would have seen.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import flex_attention as _flex_attention

from .._core.contract import stage
from .._core.dims import Heads, KVHeads
from .._core.messages import mismatch
from .reference import ScoreMod
from .stages import _explain_attention, _validate_attention, same_device_and_dtype

# torch's function, called with one result (no lse); its overloads and option types vary from torch 2.5 on.
_torch_flex: Callable[..., Tensor] = _flex_attention


def _precheck_flex(arguments: dict[str, Any]) -> None:
    same_device_and_dtype(arguments, ("q", "k", "v"))
    score_mod, block_mask, q = arguments["score_mod"], arguments["block_mask"], arguments["q"]
    if score_mod is not None and not callable(score_mod):
        raise mismatch(
            f"score_mod must be a function score_mod(score, b, h, q_idx, kv_idx), but got {type(score_mod).__name__}.",
            arg="score_mod",
        )
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise mismatch(
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, but got {type(block_mask).__name__}; "
            "make one with create_block_mask(mask_mod, B, H, seq, kv_seq, device=q.device).",
            arg="block_mask",
        )
    where = block_mask.kv_num_blocks.device
    if isinstance(q, Tensor) and where != q.device:
        raise mismatch(
            f"block_mask is on {where}, but q is on {q.device}; create it there "
            f"(create_block_mask(..., device=q.device), whose default is cuda) or move it (block_mask.to(q.device)).",
            arg="block_mask",
        )


def _validate_flex(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    _validate_attention(arguments, dims)
    if dims["kv_seq"] == 0 and dims["seq"]:  # torch's kernel reduces over the keys, and raises an IndexError on none
        raise mismatch(
            "k has kv_seq=0 (axis 2), but FlexAttention needs at least one key position to attend to; "
            "skip the call for an empty context, or use scaled_dot_product_attention, whose rows without a key "
            "are zeros.",
            arg="k",
            dim="kv_seq",
            size=0,
        )
    block_mask = arguments["block_mask"]
    if block_mask is None:
        return
    shape = tuple(block_mask.shape)
    for axis, name in ((0, "batch"), (1, "num_heads")):
        if shape[axis] not in (1, dims[name]):
            raise mismatch(
                f"block_mask has {name}={shape[axis]} (axis {axis}), but q set {name}={dims[name]} "
                f"(or 1, to broadcast); build it with create_block_mask(mask_mod, B, H, ...) at "
                f"B={dims['batch']} or None, H={dims['num_heads']} (query heads) or None.",
                arg="block_mask",
                dim=name,
                size=shape[axis],
            )
    lengths = getattr(block_mask, "seq_lengths", None)  # torch >= 2.6; torch 2.5 checks its padded lengths itself
    if lengths is None:
        return
    for built, name, tensor, what in ((lengths[0], "seq", "q", "query"), (lengths[1], "kv_seq", "k", "key")):
        if built != dims[name]:
            raise mismatch(
                f"block_mask was built for {name}={built} {what} positions, but {tensor} has {name}={dims[name]} "
                f"(axis 2); build it at the lengths it is used at: create_block_mask(mask_mod, B, H, "
                f"{dims['seq']}, {dims['kv_seq']}, device=q.device).",
                arg="block_mask",
                dim=name,
                size=built,
            )


def _folded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    scale: float | None,
    kernel_options: dict[str, Any] | None,
) -> Tensor:
    """Eager GQA without K/V copies: a group's query heads end to end on the query axis of its KV head.

    The mods see what they would unfolded: query head `h * group + i // seq` and position `i % seq`.
    torch's eager path applies a BlockMask through its `mask_mod` alone, so the mask moves into the
    score_mod, and the call is the same computation.
    """
    batch, num_heads, seq, d_head = q.shape
    group = num_heads // k.shape[1]
    mask_mod = None if block_mask is None else block_mask.mask_mod

    def unfolded(score: Tensor, b: Tensor, h: Tensor, i: Tensor, kv_idx: Tensor) -> Tensor:
        head, q_idx = h * group + i // seq, i % seq
        out = score if score_mod is None else score_mod(score, b, head, q_idx, kv_idx)
        return out if mask_mod is None else torch.where(mask_mod(b, head, q_idx, kv_idx), out, -math.inf)

    folded = q.reshape(batch, k.shape[1], group * seq, d_head)
    out = _torch_flex(folded, k, v, score_mod=unfolded, scale=scale, kernel_options=kernel_options)
    return out.reshape(batch, num_heads, seq, v.shape[-1])


@stage(precheck=_precheck_flex, validate=_validate_flex, explain=_explain_attention)
def flex_attention(
    q: Heads,
    k: KVHeads,
    v: KVHeads,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    *,
    scale: float | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> Heads:
    """FlexAttention with checked shapes: `softmax(score_mod(q @ k.T * scale) + block_mask) @ v`, GQA without copies.

    torch's `torch.nn.attention.flex_attention.flex_attention` with the library's dimensions: `q`
    `(batch, num_heads, seq, d_head)`, `k` and `v` `(batch, num_kv_heads, kv_seq, d_head)`, where
    `num_kv_heads` divides `num_heads` and query head `h` reads KV head `h // group` (torch's
    `enable_gqa=True`). The `block_mask`'s sizes are dimensions of the call: its lengths must be
    `seq` and `kv_seq` (a BlockMask built for 32 positions used at 64 is a `ShapeError` naming both,
    where torch raises a `ValueError` deep in the call), its batch and heads `batch` and `num_heads`
    or 1. K and V are never copied to `num_heads` heads: compiled, torch's kernel shares each KV head
    across its group; eager (where torch repeats them), a group's query heads are folded into the
    query axis and the mods receive the indices they would have, so the result is the same.
    `score_mod(score, b, h, q_idx, kv_idx)` receives the query head as `h`. Eager on CPU, torch
    warns once that it is not compiled (it computes the full scores); `torch.compile` it for speed.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> q, k = torch.randn(2, 8, 16, 4), torch.randn(2, 2, 16, 4)
        >>> causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 16, 16, device="cpu")
        >>> ssm.flex_attention(q, k, k, lambda score, b, h, q_idx, kv_idx: score * (1 + h), causal).shape
        torch.Size([2, 8, 16, 4])

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        k, v: `(batch, num_kv_heads, kv_seq, d_head)`; `num_kv_heads` must divide `num_heads`.
        score_mod: `score_mod(score, b, h, q_idx, kv_idx)`, applied to each scaled score; `h` is the
            query head.
        block_mask: a `BlockMask` (`create_block_mask(mask_mod, B, H, seq, kv_seq, device=q.device)`),
            True = may attend; `B` is `batch` or None (1), `H` is `num_heads` or None (1).
        scale: score scale; default `1 / sqrt(d_head)`.
        kernel_options: passed on to torch's kernel.

    Returns:
        `(batch, num_heads, seq, d_head)`.

    Raises:
        ShapeError: shapes, dtypes or devices disagree, `num_kv_heads` does not divide `num_heads`, or
            `block_mask` was built for other lengths, batch or heads, or on another device.
    """
    if not q.shape[2] and not torch.compiler.is_compiling():  # no query: the empty result torch gives without mods
        return q.new_zeros((q.shape[0], q.shape[1], 0, v.shape[-1]))  # (its eager path cannot run a mod over none)
    if q.shape[1] == k.shape[1] or torch.compiler.is_compiling():
        return _torch_flex(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options,
        )  # fmt: skip
    return _folded(q, k, v, score_mod, block_mask, scale, kernel_options)
