"""transformers' continuous batching (`model.generate_batch`) served by a replaced layer, checked.

transformers 5 serves `generate_batch` through its `PagedAttentionCache` with `attn_implementation="sdpa"`
(or "paged|eager"): each step is one packed batch `(1, total, d_model)` of every scheduled request's new tokens
(prompts, chunks, one token when decoding), `cu_seq_lens_q` their offsets, `position_ids` their positions, and
a 4-D block-diagonal mask over the keys the cache returns for the whole batch (each request's cached keys,
then its new ones; for a sliding layer, only those its window still sees). A replaced layer runs that step
through our stages with the mask transformers built (which holds the requests' boundaries, causality and
windows: the layer adds no window of its own here), after checking what it is given: `cu_seq_lens_q` is a
packed batch of the hidden states' length, the mask covers the keys returned, and each request's newest keys,
read back from the pages, are the keys this call wrote (a block table or read/write index that is off
anywhere shows there), so a paging bug is a `ShapeError` naming the layer and the request, never wrong tokens.

The block-table form (flash kernels reading the pages themselves, `block_table` given) is refused by name:
the layer reads keys through transformers' `update`, which that form skips.
"""

import copy
from typing import Any

import torch
from torch import Tensor

from .._compute.cache import KVCache
from .._compute.packed import check_cu_seqlens
from .._core.contract import Verdicts
from .._core.errors import ConfigError, ShapeError, ShapesafeError
from .._modules.multihead import MultiHeadAttention
from .hf_backend import layer_name, refuse_unknown

# What continuous batching passes an attention module besides the tensors: its packed layout (checked here),
# the paged cache's indices (read by its `update`), and what the model reads after attention.
_SERVING = frozenset({
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "logits_indices", "logits_processor_args",
    "read_index", "write_index", "block_table", "use_cache", "is_causal", "position_ids", "cache_position",
})  # fmt: skip


def is_paged(cache: Any) -> bool:
    """Whether `cache` is transformers' continuous-batching `PagedAttentionCache`."""
    return any(kind.__name__ == "PagedAttentionCache" for kind in type(cache).__mro__)


def paged_forward(
    layer: Any, hidden_states: Tensor, attention_mask: Any, cache: Any, positions: Any, kwargs: dict[str, Any]
) -> Tensor:
    """One continuous-batching step of a replaced layer (`HFAttention`), checked; see the module's docstring."""
    name = layer_name(layer)
    refuse_unknown(layer, {k: v for k, v in kwargs.items() if k not in _SERVING})
    if kwargs.get("block_table") is not None:
        raise ConfigError(
            f"{name}: continuous batching passed a block_table (the flash kernels' paged form), which a replaced "
            "layer does not read; load the model with attn_implementation='sdpa' (or 'paged|eager')."
        )
    for why, refused in (("alibi", layer.alibi_slopes is not None), ("temperature_tuning", layer.temperature_tuning)):
        if refused:
            raise ConfigError(
                f"{name}: its {why} counts positions across the packed batch, which continuous batching does not "
                "give per request; generate() serves this layer, generate_batch() does not."
            )
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        raise ConfigError(
            f"{name}: continuous batching passed {type(attention_mask).__name__} as attention_mask, but a replaced "
            "layer serves it with the 4-D mask it builds for 'sdpa' and 'paged|eager'; load the model with "
            "attn_implementation='sdpa'."
        )
    total = hidden_states.shape[1]
    offsets = check_cu_seqlens(kwargs.get("cu_seq_lens_q"), total, owner=f"{name}: cu_seq_lens_q")
    if hidden_states.shape[0] != 1:
        raise ShapeError(
            f"{name}: continuous batching packs the batch as (1, total, d_model), but got {hidden_states.shape}."
        )
    held = attention_mask.shape[-1]
    kv_cache = PagedLayer(cache, layer, kwargs, held - total, offsets, name)
    if positions is not None and positions.dim() == 1:
        positions = positions[None]
    try:
        return MultiHeadAttention.forward(  # pyright: ignore[reportReturnType]  (need_weights is never asked: one tensor)
            _windowless(layer),
            hidden_states,
            attn_mask=attention_mask,
            kv_cache=kv_cache,
            positions=positions if layer.rotary is not None else None,
        )
    except ShapesafeError as error:
        failure = error if str(error).startswith(name) else type(error)(f"{name}: {error}")
        _FAILURES[id(cache)] = failure  # continuous batching turns it into failed requests: raised again after
        raise failure from None


_FAILURES: dict[int, ShapesafeError] = {}


def loud_generate_batch(model: Any) -> None:
    """Make `model.generate_batch` raise the check that failed in a replaced layer: transformers' continuous
    batching catches an error in its generation loop, logs it and returns the requests failed, without tokens."""
    method = getattr(type(model), "generate_batch", None)
    if method is None or "generate_batch" in model.__dict__:
        return

    def generate_batch(*args: Any, **kwargs: Any) -> Any:
        _FAILURES.clear()
        outputs = method(model, *args, **kwargs)
        if _FAILURES:
            failure = next(iter(_FAILURES.values()))
            _FAILURES.clear()
            raise failure
        return outputs

    generate_batch.__doc__ = method.__doc__
    model.__dict__["generate_batch"] = generate_batch


def _windowless(layer: Any) -> MultiHeadAttention:
    """`layer` without its window (the mask transformers built holds it, per request: the layer's own, aligned to
    the packed batch's end, would cut other requests' keys); the same submodules and parameters. Made once for
    each state of the layer (it is remade when the layer's remembered state is)."""
    if layer.window is None:
        return layer
    made = layer.__dict__.get("_windowless")
    if made is not None and made[0] is layer._verdicts:
        return made[1]
    twin = copy.copy(layer)  # the same dicts of submodules, parameters and buffers
    twin.__class__ = MultiHeadAttention
    twin.window = None  # (derives again, with verdicts of its own)
    layer.__dict__["_windowless"] = (layer._verdicts, twin)
    return twin


class PagedLayer(KVCache):
    """One layer of a `PagedAttentionCache` in one continuous-batching step, as our cache stage reads a `KVCache`:
    `write` is transformers' `update` (which writes the new keys to their pages and reads back every request's keys,
    laid out as the mask covers them), then a check that each request's newest keys read back are those written."""

    def __init__(self, cache: Any, layer: Any, kwargs: dict[str, Any], held: int, offsets: list[int], name: str):
        self.cache, self.layer_idx, self.kwargs, self.offsets, self.name = cache, layer.layer_idx, kwargs, offsets, name
        weight = layer.k_proj.weight
        self.keys_buffer = self.values_buffer = weight.new_zeros(()).expand(1, layer.num_kv_heads, held, layer.d_head)
        self.window = None  # the paged cache keeps each window; the mask covers the keys it returns
        self._start, self._length = 0, held
        self._verdicts = Verdicts()

    def write(self, k: Tensor, v: Tensor, owner: str | None = None) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.update(k, v, self.layer_idx, kwargs=self.kwargs)
        if keys.shape[2] != self._length + k.shape[2]:
            raise ShapeError(
                f"{self.name}: the paged cache returned {keys.shape[2]} keys, but the attention mask covers "
                f"{self._length + k.shape[2]}; its read indices and the mask disagree."
            )
        self._check_newest(keys, values, k, v)
        return keys, values

    def _check_newest(self, keys: Tensor, values: Tensor, k: Tensor, v: Tensor) -> None:
        """Each request's last keys read back are the ones this call wrote (its pages, read where they were written)."""
        ends = self.kwargs.get("cu_seq_lens_k")
        if not isinstance(ends, Tensor) or ends.numel() != len(self.offsets):
            return  # (transformers selects this layer's offsets in update; without them there is nothing to align)
        bounds = [int(x) for x in ends.tolist()]
        for i, (a, b) in enumerate(zip(self.offsets, self.offsets[1:], strict=False)):
            new = b - a
            if new == 0:
                continue
            end = bounds[i + 1]
            read = keys[:, :, end - new : end], values[:, :, end - new : end]
            written = k[:, :, a:b].to(keys.dtype), v[:, :, a:b].to(values.dtype)
            same = torch.equal(read[0], written[0]), torch.equal(read[1], written[1])
            if not all(same):
                which = " and ".join(what for what, ok in zip(("keys", "values"), same, strict=True) if not ok)
                raise ShapeError(
                    f"{self.name}: request {i} of the packed batch read back other {which} than it wrote at its "
                    f"{new} newest position(s) (positions {end - new}..{end - 1} of {keys.shape[2]}): the paged "
                    "cache's block table or read/write indices point at other slots."
                )

    def state(self) -> Any:
        return None  # transformers' cache is written by the step; a failed step fails its requests

    def restore(self, state: Any) -> None:
        return None
