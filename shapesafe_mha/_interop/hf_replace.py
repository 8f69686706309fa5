"""Drop-in layers for a whole Hugging Face model: `replace_attention(model)` swaps in our checked layer.

Each supported attention module becomes a `MultiHeadAttention` built with `from_hf` (verified on a probe
against the module it replaces), called with the model's own arguments (hidden states, attention mask,
position ids, the `Cache`), so projections, RoPE, the cache append and attention all run through our
typed stages. Keys and values are read from and written to transformers' own `Cache` layer, never to a
`KVCache` of ours: beam search reorders that cache (`Cache.reorder_cache`), and a cache of our own would
not be reordered with it (the beams would diverge silently). The model's parameters stay the model's:
the projections are the modules the model held, the QK-norm weights its tensors.
"""

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .._compute.cache import KVCache
from .._compute.fastpath import refuse_under_vmap
from .._compute.kernels import LAMBDAS
from .._compute.rotary import RotaryEmbedding
from .._core.contract import Verdicts
from .._core.dims import Tokens
from .._core.errors import ConfigError, ShapesafeError
from .._core.probe import probeable
from .._modules.multihead import MultiHeadAttention
from .hf import (
    SHARED_QK_NORM,
    block_fused,
    grouped_fused,
    per_head_fused,
    projection_names,
    qk_norm_names,
    stacked_fused,
)
from .hf_backend import layer_name, refuse_unknown
from .hf_paged import is_paged, loud_generate_batch, paged_forward

# What a decoder layer passes its attention module, which the replacement takes (besides `**kwargs`,
# checked by `refuse_unknown` as transformers' attention functions are).
_PASSED = frozenset({
    "self", "hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values", "position_ids",
    "cache_position",
})  # fmt: skip


@dataclass(frozen=True)
class Replacements:
    """What `replace_attention` did: the module paths it replaced (with the class each was), and those it
    left as they were (with why)."""

    replaced: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} attention module(s), left {len(self.left)}"]
        lines += [f"  replaced {path} ({kind})" for path, kind in self.replaced.items()]
        lines += [f"  left {path}: {why}" for path, why in self.left.items()]
        return "\n".join(lines)


def replace_attention(model: nn.Module, *, verify: bool = True) -> Replacements:
    """Swap every supported attention module of a transformers `model` for our checked layer, in place.

    Each module whose class name ends in `Attention` is converted with `MultiHeadAttention.from_hf`
    (verified on a probe unless `verify=False`, in float64: on a float64 copy of a layer in another dtype)
    and put in its place as an `HFAttention`: called as the
    model calls its attention (`hidden_states`, `attention_mask`, `position_ids`, the `Cache`), it runs
    the projections, RoPE, the cache append and attention through our typed stages, reading and writing
    transformers' own `Cache` (so beam search reorders it). The model keeps its parameters (the
    projection modules it held, its QK-norm weights), so an optimizer built before still holds them.

    A module is left as it was, and named with why, where `from_hf` refuses it (a variant it does not
    compute: the `ConfigError`'s message), where it or a submodule it does not hand on as it is (a QK-norm:
    the replacement computes it) has hooks (which a replacement would not run), where its
    projections are fused per head or in blocks (GPT-NeoX, CodeGen: the replacement would hold copies, not the
    model's), where its forward takes an argument the replacement would not pass on, or where the model's
    `DynamicCache` keeps it as a kind of layer the replacement does not read (linear attention).

    Continuous batching (`model.generate_batch`, transformers' paged cache, `attn_implementation="sdpa"`) is
    served through the same stages (see `shapesafe_mha._interop.hf_paged`); a check that fails there raises from
    `generate_batch` itself instead of leaving the requests failed and empty.

    Example:
        >>> import torch, shapesafe_mha.hf
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        ...                      intermediate_size=64, num_hidden_layers=2, vocab_size=50)
        >>> model = AutoModelForCausalLM.from_config(config)
        >>> done = shapesafe_mha.hf.replace_attention(model)
        >>> list(done.replaced)
        ['model.layers.0.self_attn', 'model.layers.1.self_attn']
        >>> model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, min_new_tokens=3, do_sample=False).shape
        torch.Size([1, 6])

    Arguments:
        model: a transformers model (a `PreTrainedModel`, or any module holding its attention modules).
        verify: run each conversion's probe against the module it replaces (`from_hf`'s `verify`).

    Returns:
        `Replacements`: `replaced` maps each module path to the class it was; `left` maps each module path
        left as it was to why.
    """
    replaced: dict[str, str] = {}
    left: dict[str, str] = {}
    shared: dict[Any, RotaryEmbedding] = {}  # one SharedRotary for each kind of rotation
    cache_layers = _cache_layers(model)
    for path, module in _attention_modules(model):
        why = _why_left(module) or _why_not_cached(module, cache_layers)
        if why is None:
            try:
                ours = _converted(module, verify)
            except ShapesafeError as error:
                why = str(error)
            except Exception as error:  # deciding never crashes: the layer is left, and why is said
                why = f"from_hf could not convert it ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
            else:
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent), name, _adopt(ours, module, path, shared))
                replaced[path] = type(module).__name__
                continue
        left[path] = why
    if replaced:
        loud_generate_batch(model)
    return Replacements(replaced, left)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of `model` by path (class names ending in `Attention`), outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not path or not type(module).__name__.endswith("Attention") or isinstance(module, MultiHeadAttention):
            continue
        if any(path.startswith(f"{outer}.") for outer, _ in found):
            continue  # a part of one already found (its inner kernel, say)
        found.append((path, module))
    return found


def _hooks(module: nn.Module) -> str:
    """The hooks a call of `module` runs, by kind and count (`2 forward hooks, 1 forward pre hook`); "" if none."""
    counts = {
        kind: len(getattr(module, f"_{kind}"))
        for kind in ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
        if getattr(module, f"_{kind}")
    }
    named = [f"{n} {kind.replace('_', ' ')[:-1]}" + ("s" if n > 1 else "") for kind, n in counts.items()]
    if hasattr(module, "_hf_hook"):  # accelerate's device hooks replace forward instead
        named.append("an accelerate hook")
    return ", ".join(named)


def _why_left(module: nn.Module) -> str | None:
    """Why `module` cannot be replaced as it is, or None."""
    hooks = _hooks(module)
    if hooks:
        return f"it has hooks ({hooks}), which the replacement would not run; remove them first, or keep the layer"
    # The replacement calls the projections it adopts (their hooks run) and computes the rest itself: a hook on
    # another submodule (a QK-norm, a rotary embedding) would silently stop running.
    adopted = set(projection_names(module).values())
    for name, child in module.named_modules():
        if name and name.split(".")[0] not in adopted:
            hooks = _hooks(child)
            if hooks:
                return (
                    f"its submodule {name} has hooks ({hooks}), which the replacement would not run (it computes "
                    f"{name} itself); remove them first, or keep the layer"
                )
    if per_head_fused(module) is not None:
        return (
            "its query_key_value fuses each head's query, key and value rows, which from_hf loads as copies: the "
            "replacement would not hold the model's own parameters"
        )
    if stacked_fused(module) is not None or grouped_fused(module) is not None:
        return (
            "its fused projection holds the query rows beside the keys' and values' (Phi-3's qkv_proj; multi-query: "
            "one key's and value's) or each KV head's group (Falcon-40B), which from_hf loads as copies: the "
            "replacement would not hold the model's own parameters"
        )
    if block_fused(module) is not None:
        return (
            "its qkv_proj fuses blocks of query, value and key rows (CodeGen's), which from_hf loads as copies: the "
            "replacement would not hold the model's own parameters"
        )
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return "its forward has no signature to read, so what the model passes it is not known"
    other = [
        name
        for name, p in parameters.items()
        if name not in _PASSED and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    if other:
        return f"its forward takes {', '.join(other)}, which the replacement would not pass on"
    return None


def _converted(module: nn.Module, verify: bool) -> MultiHeadAttention:
    """`from_hf(module)`, verified in float64: on a float64 copy where the model is in another dtype (the
    probe's float32 tolerance, 1e-3 of the largest output, would pass a layer that differs by less; float64's
    is 1e-5). The copy's parameters are not kept: `_adopt` gives the layer the model's own."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float64)
    if verify and dtype != torch.float64 and probeable(module):
        return MultiHeadAttention.from_hf(copy.deepcopy(module).to(torch.float64), verify=True)
    return MultiHeadAttention.from_hf(module, verify=verify)


def _cache_layers(model: nn.Module) -> list[Any] | None:
    """The layers of the cache `generate()` makes for `model` (a `DynamicCache` of its config), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        from transformers import DynamicCache

        return list(DynamicCache(config=config).layers)
    except Exception:  # a config DynamicCache cannot read: the layers are checked when called
        return None


def _why_not_cached(module: nn.Module, cache_layers: list[Any] | None) -> str | None:
    index = getattr(module, "layer_idx", None)
    if cache_layers is None or not isinstance(index, int) or not 0 <= index < len(cache_layers):
        return None
    kind = type(cache_layers[index])
    if kind in _dynamic_layers():
        return None
    return (
        f"its model's DynamicCache keeps layer {index} as a {kind.__name__}, which a replaced layer does not "
        "read or write (it reads and writes keys and values of DynamicLayer and DynamicSlidingWindowLayer)"
    )


def _adopt(ours: MultiHeadAttention, theirs: nn.Module, path: str, shared: dict[Any, RotaryEmbedding]) -> "HFAttention":
    """`ours` holding the model's own parameters (the projection modules, the norms' weights), as an HFAttention;
    its rotary embedding the one `shared` holds for its frequencies (made from its own, the first time)."""
    for name, their_name in projection_names(theirs).items():
        setattr(ours, name, getattr(theirs, their_name))
    weightless = isinstance(getattr(theirs, SHARED_QK_NORM, None), nn.Module)  # Llama 4's: ours keep their ones
    if "q_norm" in ours._modules and not weightless:
        for name, their_name in zip(("q_norm", "k_norm"), qk_norm_names(theirs)[0], strict=True):
            ours._modules[name].weight = getattr(theirs, their_name).weight  # pyright: ignore[reportOptionalMemberAccess]
    if ours.sinks is not None:  # gpt-oss's attention sinks: the model's own parameter, trained in its place
        ours.sinks = theirs.sinks  # pyright: ignore[reportAttributeAccessIssue]  (a Parameter, as declared)
    for name in (name for name in LAMBDAS if name in ours._parameters):  # DiffLlama's, trained in place
        setattr(ours, name, getattr(theirs, name))
    rotary = ours.rotary
    if rotary is not None:
        inv_freq: Any = rotary.inv_freq
        kind = (rotary.d_head, rotary.theta, repr(rotary.scaling), rotary.interleaved, inv_freq.dtype, inv_freq.device)
        kind = (*kind, () if inv_freq.device.type == "meta" else tuple(inv_freq.tolist()))  # meta holds no values
        if kind not in shared:
            rotary.__class__ = SharedRotary
            shared[kind] = rotary
        ours.rotary = shared[kind]
    # Llama 4's chunked layers: the mask transformers builds is chunked already, for the keys its sliding cache
    # returns (whose indices are not positions once it slides), so ours adds none
    ours.chunk_size = None
    ours.__class__ = HFAttention  # as torch's parametrize does: the same module, another forward
    layer: Any = ours
    layer.hf_path, layer.replaced = path, type(theirs).__name__
    layer.layer_idx = getattr(theirs, "layer_idx", None)
    layer.config = getattr(theirs, "config", None)
    # a sliding layer's window (Mistral's: every layer's) is the config's, which transformers' masks and caches
    # read at each call: the layer reads it then too (`HFAttention.forward`)
    layer.window_from_config = getattr(theirs, "sliding_window", True) is not None
    layer.is_causal = True
    return layer


class HFAttention(MultiHeadAttention):
    """A `MultiHeadAttention` in a transformers model's place, called with the model's own arguments.

    Made by `replace_attention`. Its keys and values go to the model's `Cache` (layer `layer_idx`);
    RoPE is computed from `position_ids` (as the model's rotary class computes it, verified when it was
    converted); a 4-D mask from transformers (bool or additive, as `"sdpa"` and `"eager"` build it) is
    applied as given, and without one the layer is causal. A failure names the module path.
    transformers records `output_attentions` from its own attention classes only: none from this layer.
    """

    hf_path: str
    replaced: str
    layer_idx: int | None
    config: Any = None  # its model's config, as transformers' layers hold it (`_described()`: ours)
    window_from_config: bool
    is_causal: bool

    def forward(  # pyright: ignore[reportIncompatibleMethodOverride]  (transformers' calling convention)
        self,
        hidden_states: Tokens,
        position_embeddings: Any = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        position_ids: Tensor | None = None,
        cache_position: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tokens, None]:
        """`(output (batch, seq, d_model), None)`, as transformers' attention modules return it.

        `position_embeddings` (the model's cos/sin) are not read: our stages compute RoPE from the positions.
        """
        cache = past_key_values if cache is None else cache
        serving = cache is not None and is_paged(cache)  # continuous batching (generate_batch): hf_paged
        if kwargs and not serving:
            refuse_unknown(self, kwargs)
        if self.window_from_config:
            window = getattr(self.config, "sliding_window", None)
            if window != self.window:  # changed on the model's config since the replacement: followed, re-derived
                try:
                    self.window = window
                except ConfigError as error:
                    raise ConfigError(f"{layer_name(self)}: config.sliding_window={window!r}: {error}") from None
        if serving:
            return paged_forward(self, hidden_states, attention_mask, cache, position_ids, kwargs), None
        if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4):
            kind = type(attention_mask).__name__ if not isinstance(attention_mask, Tensor) else "a 2-D padding mask"
            raise ConfigError(
                f"{layer_name(self)}: the model passed {kind} as attention_mask, but a replaced layer applies the "
                "4-D masks transformers builds for 'sdpa' and 'eager'; call model.set_attn_implementation('sdpa')."
            )
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]
        positions = position_ids if position_ids is not None else cache_position
        if positions is None:
            start = 0 if cache is None else cache.get_seq_length(self.layer_idx or 0)
            positions = torch.arange(start, start + seq, device=hidden_states.device)
        if positions.dim() == 1:
            positions = positions[None]
        if positions.shape[0] == 1 and batch != 1:
            positions = positions.expand(batch, positions.shape[1])
        kv_cache = None if cache is None else LayerCache(cache, self.layer_idx or 0, batch, self)
        try:
            out = MultiHeadAttention.forward(
                self,
                hidden_states,
                attn_mask=attention_mask,
                is_causal=attention_mask is None,
                kv_cache=kv_cache,
                positions=positions if self.rotary is not None else None,  # a NoPE layer (Llama 4, SmolLM3) has none
            )
        except ShapesafeError as error:
            raise type(error)(f"{layer_name(self)}: {error}") from None
        return out, None  # pyright: ignore[reportReturnType]  (need_weights is never asked: one tensor)


class LayerCache(KVCache):
    """One layer of a transformers `Cache`, as our forward's cache stage reads and writes a `KVCache`.

    It holds what the layer holds now (`keys_buffer`: its keys, `(batch, num_kv_heads, kept, d_head)`), and
    an append is the layer's own `update`: a sliding-window layer keeps its window and returns the keys the
    mask transformers built covers, so no window is applied to the cache here. A failed call restores the
    layer as it was.
    """

    def __init__(self, cache: Any, layer_idx: int, batch: int, module: MultiHeadAttention) -> None:
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ConfigError(
                f"{layer_name(module)}: the model passed a {type(cache).__name__} as its cache, which has no layers; "
                "a replaced layer reads and writes a transformers Cache (DynamicCache)."
            )
        self.cache, self.layer_idx = cache, layer_idx
        self.layer = layers[layer_idx] if layer_idx < len(layers) else None
        kind = type(self.layer) if self.layer is not None else getattr(cache, "layer_class_to_replicate", None)
        if kind not in _dynamic_layers():
            raise ConfigError(
                f"{layer_name(module)}: the cache's layer {layer_idx} is a "
                f"{getattr(kind, '__name__', kind)}; a replaced layer reads and writes DynamicCache layers "
                "(DynamicLayer, DynamicSlidingWindowLayer, and the attention part of hybrid ones): generate with "
                "cache_implementation='dynamic'."
            )
        keys = None if self.layer is None or not self.layer.is_initialized else self.layer.keys
        if keys is None or keys.dim() != 4:
            weight = module.k_proj.weight
            keys = weight.new_empty(batch, module.num_kv_heads, 0, module.d_head)
        self.keys_buffer = self.values_buffer = keys
        self.window = None  # the layer keeps its window; the keys it returns are those the mask covers
        self._start, self._length = 0, keys.shape[2]
        self._verdicts = Verdicts()

    def write(self, k: Tensor, v: Tensor, owner: str | None = None) -> tuple[Tensor, Tensor]:
        refuse_under_vmap(k, owner)
        return self.cache.update(k, v, self.layer_idx)

    def state(self) -> Any:
        """The layer's every attribute (a dynamic layer's `update` rebinds its tensors, never writes into them; its
        first one adds some: `device`), or how many layers the cache had where the call would make this one."""
        layer = self.layer
        if layer is None:
            return len(self.cache.layers)
        return layer, dict(vars(layer))

    def restore(self, state: Any) -> None:
        if isinstance(state, int):  # the layer was made by the failed call: drop it
            del self.cache.layers[state:]
            return
        layer, attributes = state
        vars(layer).clear()  # (an attribute the failed call added goes too)
        vars(layer).update(attributes)


class SharedRotary(RotaryEmbedding):
    """One `RotaryEmbedding` for the replaced layers of a model that rotate alike: the layers of one forward
    rotate by the same positions, so their tables are computed once (as the model's own rotary class does,
    once a forward), and again whenever the positions (another tensor, or changed in place), the dtype or
    the frequencies differ. It holds the last tables until the next call."""

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return super().forward(positions, dtype)
        inv_freq: Any = self.inv_freq
        versions = (positions._version, inv_freq._version, dtype, torch.is_inference_mode_enabled())
        last = self.__dict__.get("_last")
        if last is not None and last[0] is positions and last[1] is inv_freq and last[2] == versions:
            return last[3]
        tables = super().forward(positions, dtype)
        self.__dict__["_last"] = (positions, inv_freq, versions, tables)
        return tables


_DYNAMIC: tuple[type, ...] = ()


def _dynamic_layers() -> tuple[type, ...]:
    global _DYNAMIC
    if not _DYNAMIC:
        from transformers import cache_utils

        # a hybrid layer's attention part is one of the two (its linear-attention state is not touched)
        names = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionAndFullAttentionLayer",
                 "LinearAttentionAndSlidingWindowAttentionLayer")  # fmt: skip
        _DYNAMIC = tuple(getattr(cache_utils, name) for name in names if hasattr(cache_utils, name))
    return _DYNAMIC
