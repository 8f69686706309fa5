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

import inspect
import math
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor, nn

from .._compute.stages import scaled_dot_product_attention as _sdpa
from .._core.contract import CallKey, Session, Verdicts, checks_enabled, signature_key, witness
from .._core.errors import ConfigError, ShapesafeError

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


def _short_name(module: nn.Module) -> str:
    index = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}(layer_idx={index})" if index is not None else type(module).__name__


def layer_name(module: nn.Module) -> str:
    """The layer as a failure names it: its path in the model, its class and index
    (`model.layers.1.self_attn (LlamaAttention, layer_idx=1)`); the class and index alone where no path is known.

    transformers hands an attention function the module, not the model: the path is found, when a failure
    is reported, from the modules whose forward is on the call stack (the outermost that holds the layer).
    A replaced layer (`replace_attention`) knows its own.
    """
    path = getattr(module, "hf_path", None) or _path_from_callers(module)
    if path is None:
        return _short_name(module)
    index = getattr(module, "layer_idx", None)
    return f"{path} ({type(module).__name__}" + (f", layer_idx={index})" if index is not None else ")")


def _path_from_callers(module: nn.Module) -> str | None:
    path, seen = None, set()
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner is not module and id(owner) not in seen:
            seen.add(id(owner))
            found = next((name for name, sub in owner.named_modules() if sub is module), None)
            path = found if found else path  # the outermost holder wins
        frame = frame.f_back
    return path


def refuse_unknown(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """A `ConfigError` naming the first keyword argument that would change the result and that is not computed."""
    if _INERT.issuperset(kwargs):  # the common case, in one set operation: every call runs this
        return
    unknown = {k: v for k, v in kwargs.items() if k not in _INERT and v is not None and v is not False}
    if unknown:
        name, given = next(iter(unknown.items()))
        shown = f"a tensor {tuple(given.shape)}" if isinstance(given, Tensor) else repr(given)
        raise ConfigError(
            f"{layer_name(module)}: transformers passed {name}={shown} to attention, which would change what it "
            f"computes, and attn_implementation='shapesafe' does not compute {name}; use 'eager' or 'sdpa' for this "
            "model, or open an issue."
        )


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


# Per config class: (dimension, field, where the config's __dict__ holds it): the fields its class declares.
_PLANS: dict[type, tuple[tuple[str, str, str], ...]] = {}
Sizes = tuple[tuple[str, int, str], ...]  # (dimension, size, config field)


def _plan(kind: type) -> tuple[tuple[str, str, str], ...]:
    plan = _PLANS.get(kind)
    if plan is None:
        fields, aliases = getattr(kind, "__dataclass_fields__", {}), getattr(kind, "attribute_map", {})
        plan = tuple((dim, f, aliases.get(f, f)) for dim, f in _FIELDS if f in fields or f in aliases)
        _PLANS[kind] = plan
    return plan


def _config_sizes(module: nn.Module) -> Sizes:
    """The sizes the layer's config fixes, as (dimension, size, field): only fields its config class declares,
    read as transformers standardises them (its attribute map), never a computed attribute. Read on every
    call (a config may change), from the config's own dict where it holds them plainly."""
    config: Any = getattr(module, "config", None)
    if config is None:
        return ()
    try:
        stored = object.__getattribute__(config, "__dict__")  # not through PreTrainedConfig.__getattribute__ (slow)
    except AttributeError:  # a config without a dict of its own: read through it
        stored = {}
    heterogeneous = "_heterogeneity_spec" in stored  # per-layer fields: read through the config, which refuses
    found = []
    for dim, field, name in _plan(type(config)):
        value = stored.get(name) if not heterogeneous and name in stored else _declared(config, field)
        if type(value) is int:
            found.append((dim, value, field))
    return tuple(found)


def _call_key(module: nn.Module, sizes: Sizes, query: Tensor, key: Tensor, value: Tensor, options: Any) -> Any:
    """What a verdict on this call depends on (a `CallKey`, as the modules'): its structure (the layer's class and
    config sizes, dtypes, devices, flags, the tensors' types) and its shapes. Built by hand: this runs on every call.
    Not tensors: keyed as any call is (`signature_key`), or not at all, and checked in full."""
    mask, scale, softcap = options["attn_mask"], options["scale"], options["softcap"]
    try:
        q, k = query.shape, key.shape
        structure = (
            type(module), sizes, query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
            None if mask is None else (mask.dtype, mask.device), options["is_causal"], options["dropout_p"],
            type(scale), scale, type(softcap), softcap,
            (type(query), type(key), type(value), type(mask)),  # a subclass can change what torch returns
            len(q) == len(k) == 4 and q[2] > k[2],  # some rows have nothing to attend to
        )  # fmt: skip
        shapes = (q, k, value.shape, None if mask is None else mask.shape)
    except AttributeError:
        return (type(module), sizes, *signature_key((query, key, value), options))
    return tuple.__new__(CallKey, (structure, shapes, None))


def _relations(exact: Any) -> Any:
    """The key with batch and sequence sizes replaced by how they relate (`CallKey.relations`), so decoding step
    after step is one verdict. Heads and `d_head` stay exact, as the config's sizes: the stage also checks that KV
    heads divide the query heads, which no equality shows. None where the call is not of 4-D tensors."""
    if type(exact) is not CallKey:  # the fallback key: exact only
        return None
    q, k, v, _ = exact.shapes
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        return None
    constants = frozenset((q[1], q[3], k[1], k[3], v[1], v[3])) | {size for _, size, _ in exact.structure[1]}
    return exact.relations(constants)


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
    if kwargs:
        refuse_unknown(module, kwargs)
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
        exact = _call_key(module, sizes, query, key, value, options)
        if not _verdicts.known(exact, lambda: _relations(exact)):
            out = _checked(module, sizes, query, key, value, options)
            _verdicts.remember(exact, _relations(exact))
            return _transposed(out)
    return _transposed(_sdpa.fn(query, key, value, **options))


def _transposed(out: Tensor) -> tuple[Tensor, None]:
    return out.transpose(1, 2).contiguous(), None


def _checked(
    module: nn.Module, sizes: Sizes, query: Tensor, key: Tensor, value: Tensor, options: dict[str, Any]
) -> Tensor:
    """The stage, checked in a session seeded with the config's sizes, each named by its field."""
    short = _short_name(module)
    try:
        with Session(short) as session:
            for name, size, field in sizes:
                if name == "num_kv_heads" and key.shape[1] == query.shape[1]:
                    continue  # K and V repeated to every query head before the call (JetMoE, older ports): MHA-shaped
                session.seed(Shaped[Tensor, name], witness((size,)), f"the config ({field}={size})")
            return session.call(_sdpa, query, key, value, **options)
    except ShapesafeError as error:  # named now, with the model's frames still on the stack
        message = str(error)
        raise type(error)(
            layer_name(module) + message[len(short) :] if message.startswith(short) else message
        ) from None


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
