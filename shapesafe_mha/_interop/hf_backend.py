"""Whole Hugging Face models checked as they run: `attn_implementation="shapesafe"` on transformers' interfaces.

`register()` adds an attention function and its mask function to transformers' `AttentionInterface` and
`AttentionMaskInterface`. Every attention call of a model then runs through our typed stage
(`scaled_dot_product_attention`: GQA/MQA folded, K and V never repeated), checked in a session seeded
with the sizes the layer's config fixes, so a layer whose tensors disagree with its config is caught
even where the tensors alone would be a valid GQA call, and the message names the layer and the field.
What transformers passes that changes the result is computed: `scaling`, `dropout`, `softcap`, `s_aux`
sinks, and sliding windows through the mask transformers builds for a sliding layer (as its sdpa does);
a keyword argument that would change it and that we do not compute is a
`ConfigError` naming it, never dropped.
"""

import math
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor, nn

from .._compute.stages import scaled_dot_product_attention as _sdpa
from .._core.contract import Session, Verdicts, checks_enabled, signature_key, witness
from .._core.errors import ConfigError

NAME = "shapesafe"
# What transformers passes an attention function besides the tensors, that does not change the result
# here: the sdpa mask already encodes padding and packed sequences (cu_seq_lens/max_length are the flash
# kernels' form of the same), positions only feed RoPE before us, the rest are requests for outputs.
_INERT = frozenset({
    "position_ids", "cache_position", "output_attentions", "output_hidden_states", "output_router_logits",
    "num_items_in_batch", "use_cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "seq_idx", "past_key_values", "past_key_value", "cache", "layer_idx", "return_dict",
})  # fmt: skip
_SIZES = Shaped[Tensor, "num_heads num_kv_heads d_head"]
_verdicts = Verdicts()


def register() -> str:
    """Register `attn_implementation="shapesafe"` with transformers (idempotent); returns `"shapesafe"`.

    Then `AutoModelForCausalLM.from_config(config, attn_implementation="shapesafe")`, `from_pretrained(...,
    attn_implementation="shapesafe")` and `model.set_attn_implementation("shapesafe")` run every attention
    call of the model through our checked stages; masks are built as for `"sdpa"` (bool, True = attend).

    Example:
        >>> import shapesafe_mha.hf
        >>> shapesafe_mha.hf.register()
        'shapesafe'
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def _layer_name(module: nn.Module) -> str:
    index = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}(layer_idx={index})" if index is not None else type(module).__name__


_FIELDS = (("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"), ("d_head", "head_dim"))


def _declared(config: Any, field: str) -> int | None:
    """`config.field` where the config's class declares that field (a stray attribute, which a model that
    does not use it ignores, is not read), or which its attribute map aliases; None otherwise."""
    kind = type(config)
    declared = field in getattr(kind, "__dataclass_fields__", {}) or field in getattr(kind, "attribute_map", {})
    if not declared:
        return None
    try:
        value = getattr(config, field)
    except Exception:  # a per-layer field read globally (Gemma 4): not one size for every layer
        return None
    return value if type(value) is int else None


def _config_sizes(module: nn.Module) -> tuple[tuple[Any, ...], tuple[tuple[str, int, str], ...]]:
    """The sizes the layer's config fixes, as (dimension, size, "the config (field=size)"): only fields its
    config class declares, read as transformers standardises them, never a computed attribute."""
    config: Any = getattr(module, "config", None)
    found = []
    for dim, field in _FIELDS:
        value = None if config is None else _declared(config, field)
        if value is not None:
            found.append((dim, value, f"the config ({field}={value})"))
    return tuple(size for _, size, _ in found), tuple(found)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for `attn_implementation="shapesafe"`: our checked stage, K/V unrepeated.

    Returns `(output (batch, seq, num_heads, d_head), None)`, as transformers' own sdpa function does.
    """
    unknown = {k: v for k, v in kwargs.items() if k not in _INERT and v is not None and v is not False}
    if unknown:
        name, given = next(iter(unknown.items()))
        shown = f"a tensor {tuple(given.shape)}" if isinstance(given, Tensor) else repr(given)
        raise ConfigError(
            f"{_layer_name(module)}: transformers passed {name}={shown} to attention, which would change what it "
            f"computes, and attn_implementation='shapesafe' does not compute {name}; use 'eager' or 'sdpa' for this "
            "model, or open an issue."
        )
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    seq, kv_seq = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < seq != kv_seq:
        # No mask, more keys than queries (Dory's loops): transformers' sdpa hands torch is_causal, which aligns
        # top-left (ours aligns lower-right, as a KV cache needs); its mask, stated, so the result is sdpa's.
        attention_mask = torch.ones(seq, kv_seq, dtype=torch.bool, device=query.device).tril()
    # As transformers' sdpa: the mask it builds for a sliding layer holds the window (`sliding_window` is
    # what the flash kernels need instead), and a given mask holds the causality.
    if s_aux is not None:
        attention_mask, causal, key, value = _with_sinks(s_aux, query, key, value, attention_mask, causal)
    options: dict[str, Any] = {
        "attn_mask": attention_mask,
        "is_causal": causal and attention_mask is None,
        "scale": scaling,
        "dropout_p": float(dropout),
        "softcap": softcap,
    }
    if checks_enabled():
        sizes = _config_sizes(module)
        exact = (type(module), sizes[0], *signature_key((query, key, value), options))
        if not _verdicts.known(exact):
            out = _checked(module, sizes, query, key, value, options)
            _verdicts.remember(exact)
            return _transposed(out)
    return _transposed(_sdpa.fn(query, key, value, **options))


def _transposed(out: Tensor) -> tuple[Tensor, None]:
    return out.transpose(1, 2).contiguous(), None


def _checked(
    module: nn.Module, sizes: Any, query: Tensor, key: Tensor, value: Tensor, options: dict[str, Any]
) -> Tensor:
    """The stage, checked in a session seeded with the config's sizes, each named by its field."""
    with Session(_layer_name(module)) as session:
        for name, size, source in sizes[1]:
            if name == "num_kv_heads" and key.shape[1] == query.shape[1]:
                continue  # K and V repeated to every query head before the call (JetMoE, older ports): MHA-shaped
            session.seed(Shaped[Tensor, name], witness((size,)), source)
        return session.call(_sdpa, query, key, value, **options)


def _with_sinks(
    sinks: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool
) -> tuple[Tensor, bool, Tensor, Tensor]:
    """Attention sinks (gpt-oss `s_aux`: one learned logit per head in the softmax, dropped after it) as one more
    key: zeros in K and V at every KV head, its score set by an additive per-head mask, so the stage computes
    `softmax([scores, sink])[..., :-1] @ v` with K and V still at `num_kv_heads` heads."""
    heads, seq = query.shape[1], query.shape[2]
    kv_seq = key.shape[2]
    rows = torch.arange(seq, device=query.device)[:, None] + (kv_seq - seq)
    columns = torch.arange(kv_seq, device=query.device)[None]
    allowed = torch.ones(seq, kv_seq, dtype=torch.bool, device=query.device)
    if causal and mask is None:
        allowed = allowed & (columns <= rows)
    if mask is not None:
        allowed = allowed & mask if mask.dtype == torch.bool else allowed
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, -math.inf)
    if mask is not None and mask.dtype != torch.bool:
        additive = additive + mask
    additive = additive.expand(*(additive.shape[:-2] if additive.dim() == 4 else (1, 1)), seq, kv_seq)
    sink = sinks.to(query.dtype).reshape(1, heads, 1, 1).expand(additive.shape[0], heads, seq, 1)
    full = torch.cat([additive.expand(additive.shape[0], heads, seq, kv_seq), sink], dim=-1)
    zeros = key.new_zeros(key.shape[0], key.shape[1], 1, key.shape[3])
    return full, False, torch.cat([key, zeros], dim=2), torch.cat([value, zeros], dim=2)
