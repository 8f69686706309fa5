"""What a transformers attention class computes, read from its config class and its structure, before any check.

`read_recipe` builds the class once at tiny sizes and reads the variants it computes from
transformers' standardised config (`rope_parameters`, `layer_types`, `sliding_window`, the softcap
and scale fields) and from the layer's structure (its projections, its norms, the parameters it
holds, its constructor and forward signatures). What the per-head reference computes becomes a
`Recipe`; anything else is a `ConfigError` whose first line names the class and the variant or
layout. Nothing is decided from a computed attribute such as `scaling`: a wrong one is a bug for the
check to catch, not a variant to refuse. What no field says is shown on a probe of a part, not of the
attention's forward: a norm submodule on its own (RMSNorm, `1 + weight`, LayerNorm), the modeling
module's `apply_rotary_pos_emb` (pairs or halves), the theta of GPT-J's and CodeGen's own `(sin, cos)`
tables (`config.rotary_dim` features, no `rope_parameters`); only layer types that rotate where others
do not (NoPE layers) are told by calling the layer. A bug inside a norm submodule is therefore refused
(a norm we do not know), not reported. CodeGen's `mp_num` (the blocks of its `qkv_proj`) is read from
the layer, where its forward reads it: a forward that splits the rows otherwise fails the heads property,
reported, not refused. Llama 4 is read the same way: its complex rotary table (adjacent pairs), its
weightless `qk_norm` on a probe (on the layers that hold one), its chunked_attention layers from
`layer_types` (the check draws chunks the sequences cross and builds their mask with
`create_chunked_causal_mask`; the reference computes them as a `mask_mod`), and `attn_temperature_tuning`
from the config, on the layers shown to be NoPE layers.
Any error while deciding is a refusal naming the class, never a traceback from inside the check.
"""

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .._compute.reference import NormKind, NormOver, RopeStyle, _layer_norm
from .._core.errors import ConfigError
from .._core.weights import AttentionWeights
from .._interop.adapters import NAMES, load_weights
from .._interop.hf import BLOCK_ORDER, block_fused, own_variant, rope_interleaved, sincos_rope

OWNER = "check_hf_attention()"
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
# The keyword arguments the check passes (as the model's decoder layer does); any other required one is refused.
_PASSED = {"hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values", "past_key_value",
           "position_ids", "cache_position", "kwargs", "self", "layer_past"}  # fmt: skip
# Config fields of variants the reference does not compute, each neutral at the values listed.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "clip_qkv": ((None,), "queries, keys and values clipped (OLMo's clip_qkv)"),
    "use_qk_norm": ((None, False), "a QK-norm switched on by use_qk_norm (Cohere's LayerNorm, Llama 4's L2 norm)"),
    "rope_interleave": ((None, False), "interleaved RoPE read from a field"),
    "scale_attn_weights": ((None, True), "unscaled scores"),
    "scale_attn_by_inverse_layer_idx": ((None, False), "scores scaled by 1/layer_idx"),
    "attn_temperature_tuning": ((None, False, 0), "attention temperature tuning (Llama 4)"),
    "use_sink": ((None, False), "attention sinks"),
    "alibi": ((None, False), "ALiBi position biases"),
    "new_decoder_architecture": ((None, False), "Falcon's grouped fused query-key-value layout"),
    "attention_chunk_size": ((None,), "chunked attention (Llama 4)"),
    "use_qkv_bias": ((None, False), "a query-key-value bias switch of its own"),
    "logits_soft_cap": ((None,), "logit softcapping under another name"),
    "attn_output_multiplier": ((None,), "an output multiplier"),
}
_SCALES = ("query_pre_attn_scalar", "attention_multiplier")
_CACHE_WORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


@dataclass(frozen=True)
class QKNorm:
    """An RMSNorm of queries and keys: `weight * x / rms(x)`, `(offset + weight)` where Gemma 3's is; Persimmon's
    LayerNorm (`kind="layer"`), Cohere's LayerNorm without bias of each head with weights of its own
    (`kind="centred"`, `over="per_head"`).

    Where it sits is read from the submodules' names, transformers' convention: `q_norm`/`k_norm` before
    RoPE (Qwen3, Gemma 3, OLMo-2), `query_layernorm`/`key_layernorm` after it (HunYuan).
    """

    offset: float
    eps: float
    over: NormOver
    names: tuple[str, str] = ("q_norm", "k_norm")
    after_rope: bool = False
    kind: NormKind = "rms"
    weighted: bool = True  # False: one norm without a weight for both (Llama 4's `qk_norm`, an L2 norm): weight 1


# submodule names of a QK-norm, and whether it normalises after RoPE
QK_NORMS = {("q_norm", "k_norm"): False, ("query_layernorm", "key_layernorm"): True,
            ("q_layernorm", "k_layernorm"): False}  # fmt: skip
# Llama 4: one `qk_norm` without a weight, for queries and keys, after RoPE (where it sits does not show: a
# weightless RMS norm of a head commutes with RoPE, which keeps each pair's length)
SHARED_QK_NORM = "qk_norm"
OUT_NORMS = ("attn_sub_norm",)  # BitNet: the merged heads normalised before the output projection


@dataclass(frozen=True)
class Recipe:
    """What the class computes, in the reference's terms, and how the check builds and calls it."""

    name: str
    config_cls: type
    has_kv_heads: bool
    has_head_dim: bool
    has_bias_switch: bool
    width_free: bool
    fused: str | None  # "stacked": one [q; k; v] projection; "per_head": [q_h; k_h; v_h] for each head; "blocks"
    rotary_cls: type[nn.Module] | None
    rope_style: RopeStyle = "half"
    rotary_factor: float = 1.0
    qk_norm: QKNorm | None = None
    logit_softcap: float | None = None
    scale: Callable[[Any], float] | None = None  # from the config (query_pre_attn_scalar, attention_multiplier)
    layers: tuple[tuple[int, str | None], ...] = ((0, None),)  # (layer_idx, layer type) the check draws from
    windowed: bool = False  # the config has a sliding_window the check draws
    takes_position_embeddings: bool = True
    tied_width: bool = False  # the output projection takes hidden_size features (Helium): heads * head_dim drawn equal
    multi_query: bool = False  # one KV head from a multi_query switch, not num_key_value_heads (GPTBigCode)
    out_norm_eps: float | None = None  # BitNet's attn_sub_norm: an RMSNorm of the merged heads
    sinks: bool = False  # a `sinks` parameter of one logit per head (gpt-oss)
    output_gate: bool = False  # q_proj gives each head its queries, then its gate (Qwen3-Next)
    nope: frozenset[int] = frozenset()  # layers (by index) that apply no RoPE where others do (Cohere 2, SmolLM3)
    cache_keyword: str = "past_key_values"
    # RoPE on config.rotary_dim features with the rotary class's own (sin, cos) tables (GPT-J, CodeGen): the check
    # draws rotary_dim and reads theta from the tables, which no field holds
    in_layer_rope: bool = False
    blocks: int = 1  # CodeGen's qkv_proj: the layer's mp_num blocks, each [q_b; v_b; k_b]
    qk_norm_layers: frozenset[int] | None = None  # the layers (by index) holding the QK-norm; None: every one
    # Llama 4's attn_temperature_tuning on NoPE layers: queries scaled by log1p(floor((i + 1) / floor_scale)) *
    # attn_scale + 1 at cache index i, which the check draws (floor_scale, attn_scale) and the reference computes
    temperature: bool = False
    chunk: int | None = None  # Llama 4's attention_chunk_size of its chunked_attention layers
    # ALiBi biases its model passes in (Bloom's `alibi`, MPT's `position_bias`: the forward's keyword), built by the
    # modeling module's own function; the reference computes them from its own slopes (`alibi_slopes`)
    alibi: str | None = None

    def rotary_dim(self, d_head: int) -> int | None:
        return None if self.rotary_factor == 1.0 else int(d_head * self.rotary_factor)


def refuse(name: str, what: str) -> ConfigError:
    return ConfigError(
        f"{OWNER}: {name}: {what} is not computed by the per-head reference; it cannot be checked against it."
    )


@contextmanager
def deciding(name: str, step: str) -> Iterator[None]:
    """Any error while reading what the class computes is a refusal naming the class, never a traceback of ours."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise ConfigError(
            f"{OWNER}: {name}: {step} raised {type(error).__name__}: {first}; it cannot be checked here."
        ) from error


def settable(config_cls: type, name: str) -> bool:
    """Whether `name` is a field the config class takes (Falcon's `head_dim` is a property without a setter)."""
    return not isinstance(inspect.getattr_static(config_cls, name, None), property)


def tiny_config(config_cls: type, **sizes: Any) -> Any:
    return config_cls(**{k: v for k, v in sizes.items() if settable(config_cls, k)})


def rotary_class(attention_cls: type[nn.Module], config_cls: type) -> type[nn.Module] | None:
    """The model's own rotary class, from the attention class's module (`LlamaRotaryEmbedding` beside it)."""
    modeling = importlib.import_module(attention_cls.__module__)
    prefix = config_cls.__name__.removesuffix("Config")
    found = getattr(modeling, f"{prefix}RotaryEmbedding", None)
    if found is None:
        named = [getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding") and "Vision" not in n]
        found = named[0] if len(named) == 1 else None
    return found


def tables(rotary: nn.Module, x: Tensor, positions: Tensor, layer_type: str | None) -> tuple[Tensor, Tensor]:
    """The model's rotary class called as its model calls it (with the layer type where it takes one), as
    `(cos, sin)`; a complex table (Llama 4's `freqs_cis`, `torch.polar`) is read as its real and imaginary parts."""
    found = embeddings(rotary, x, positions, layer_type)
    if isinstance(found, Tensor) and found.is_complex():
        return found.real, found.imag
    cos, sin = found
    return cos, sin


def embeddings(rotary: nn.Module, x: Tensor, positions: Tensor, layer_type: str | None) -> Any:
    """What the model passes its layers as `position_embeddings`: the rotary class's output, as it returns it."""
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    return rotary(x, positions, *([layer_type] if takes_type else []))


def cast_embeddings(found: Any, dtype: torch.dtype) -> Any:
    """`(cos, sin)` in the layer's dtype, as the model casts them; a complex table as the rotary class made it
    (Llama 4's model passes `freqs_cis` uncast)."""
    if isinstance(found, Tensor) and found.is_complex():
        return found
    return tuple(t.to(dtype) for t in found)


def drawn_rope(config: Any, theta: float) -> dict[str, Any]:
    """`rope_parameters` of default RoPE at `theta`, the rotated share kept: scaling types (llama3, YaRN) are the
    rotary class's business, which makes the tables; the attention class only applies them."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if any(t in parameters for t in ATTENTION_LAYERS):  # one set per layer type (Mellum); None: that type has none
        return {
            t: None if p is None else _default_rope(p, theta) for t, p in parameters.items() if t in ATTENTION_LAYERS
        }
    return _default_rope(parameters, theta)


def _default_rope(parameters: dict[str, Any], theta: float) -> dict[str, Any]:
    kept = {k: v for k, v in parameters.items() if k == "partial_rotary_factor"}
    return {**kept, "rope_type": "default", "rope_theta": theta}


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's `rope_parameters`; of `layer_type` where they are kept per layer type (Gemma 3)."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(parameters.get(layer_type), dict):
        return dict(parameters[layer_type])
    if parameters and all(isinstance(v, dict) for v in parameters.values()):
        return dict(next(iter(parameters.values())))
    return parameters


def _rotary_factor(config: Any, name: str, layer_type: str | None) -> float:
    """The rotated share of each head: `rope_parameters['partial_rotary_factor']` (transformers 5), else the config."""
    parameters = rope_parameters(config, layer_type)
    factor = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if getattr(config, "rotary_pct", None) not in (None, 1.0):
        factor = config.rotary_pct
    return 1.0 if factor is None else float(factor)


def _rope_style(
    attention_cls: type[nn.Module], rotary: nn.Module, width: int, name: str, layer_type: str | None
) -> RopeStyle:
    """How the model pairs features: halves (rotate_half) or adjacent pairs (interleaved), read as `from_hf`
    reads it (`rope_interleaved`: its rotary table, else its own `apply_rotary_pos_emb` on a probe, not its
    attention's forward, which is what is checked); a function that matches neither (a wrong sign, say) is
    taken as halves, so the check reports it."""
    positions = torch.arange(4)[None]
    found = embeddings(rotary, torch.zeros(1, 4, 8), positions, layer_type)
    if isinstance(found, Tensor) and found.is_complex():
        return _complex_style(found, width, name)
    cos, sin = found
    if cos.shape[-1] not in (width, width // 2):  # gpt-oss keeps one angle per pair: a table half as wide
        raise refuse(name, f"a rotary table {cos.shape[-1]} wide where the config rotates {width} features")
    if cos.ndim != 3:
        raise refuse(name, f"a rotary table of shape {tuple(cos.shape)}, not (batch, seq, features)")
    modeling = importlib.import_module(attention_cls.__module__)
    return "interleaved" if rope_interleaved(modeling, cos, sin, width) else "half"


def _complex_style(table: Tensor, width: int, name: str) -> RopeStyle:
    """Llama 4's pairing, read from its table's format: one complex angle per pair (`freqs_cis`, `torch.polar`), which
    its model multiplies into `view_as_complex` of each head, adjacent pairs `(2i, 2i+1)` by that view's definition.
    Read from the table, not from the modeling module's `apply_rotary_emb`, so a function that pairs otherwise is
    reported by the check, not taken as a variant."""
    if table.ndim != 3 or table.shape[-1] != width // 2:
        raise refuse(name, f"a complex rotary table of shape {tuple(table.shape)}, not one angle per pair")
    return "interleaved"


def _norm_of(
    norm: nn.Module, width: int, name: str, label: str, heads: int | None = None
) -> tuple[NormKind, float, float]:
    """`(kind, offset, eps)` of a norm, shown on a probe: "rms" computes `(offset + weight) * x / sqrt(mean(x**2) +
    eps)`; "layer" (a bias beside the weight: Persimmon's LayerNorm) `weight * (x - mean) / sqrt(var + eps) + bias`;
    "centred" (no bias: Cohere's) `weight * (x - mean) / sqrt(var + eps)`. With `heads`, its weights are
    `(heads, width)`, each head's own (Cohere's), and it is probed on `(positions, heads, width)`."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    shape = (width,) if heads is None else (heads, width)
    if not isinstance(weight, Tensor) or weight.shape != shape or not isinstance(eps, float):
        features = width if heads is None else shape
        raise refuse(name, f"{label}={type(norm).__name__} (not a norm of {features} features with an epsilon)")
    if heads is not None and isinstance(bias, Tensor):
        raise refuse(name, f"{label}={type(norm).__name__}, a norm of each head with a bias")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, *shape, generator=generator, dtype=torch.float64)
    drawn = torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5
    shift = torch.randn(width, generator=generator, dtype=torch.float64)
    probe = norm.double()
    saved = [t.detach().clone() for t in (weight, bias) if isinstance(t, Tensor)]
    try:
        if isinstance(bias, Tensor):
            with torch.no_grad():
                weight.copy_(drawn)
                bias.copy_(shift)
                got = probe(x)
            if torch.allclose(got, _layer_norm(x, drawn, shift, eps), rtol=1e-5, atol=1e-6):
                return "layer", 0.0, eps
            raise refuse(name, f"{label}={type(norm).__name__}, a norm with a bias other than LayerNorm")
        rms = torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        for offset in (0.0, 1.0):
            with torch.no_grad():
                weight.copy_(drawn - offset)
                got = probe(x)
            if torch.allclose(got, x / rms * drawn, rtol=1e-5, atol=1e-6):
                return "rms", offset, eps
        with torch.no_grad():
            weight.copy_(drawn)
            got = probe(x)
        if torch.allclose(got, _layer_norm(x, drawn, torch.zeros_like(drawn), eps), rtol=1e-5, atol=1e-6):
            return "centred", 0.0, eps
    finally:
        with torch.no_grad():
            for held, value in zip((t for t in (weight, bias) if isinstance(t, Tensor)), saved, strict=True):
                held.copy_(value)
    raise refuse(name, f"{label}={type(norm).__name__}, a norm other than weight * x / rms(x) or a LayerNorm")


def _not_built_from_config(attention_cls: type[nn.Module]) -> str:
    taken = ", ".join(p for p in inspect.signature(attention_cls.__init__).parameters if p != "self")
    return f"a layer built as {attention_cls.__name__}({taken}), not from (config, layer_idx)"


def read_recipe(attention_cls: type[nn.Module], config_cls: type, implementation: str) -> Recipe:
    name = attention_cls.__name__
    with deciding(name, f"reading {name}'s constructor and forward"):
        init = inspect.signature(attention_cls.__init__).parameters
        required = [p for p, v in init.items() if p not in ("self", "config", "layer_idx") and v.default is v.empty
                    and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]  # fmt: skip
        # A constructor wrapped by a decorator without functools.wraps (transformers 5.25's use_kernelized_func)
        # shows only (*args, **kwargs): it says nothing, and building the layer below decides.
        opaque = all(v.kind in (v.VAR_KEYWORD, v.VAR_POSITIONAL) for p, v in init.items() if p != "self")
        if not opaque and ("config" not in init or "layer_idx" not in init or required):
            raise refuse(name, _not_built_from_config(attention_cls))
        forward = inspect.signature(attention_cls.forward).parameters
        passed = _PASSED | ({"alibi"} if getattr(config_cls(), "alibi", None) is False else set())  # Falcon: None
        alibi = _alibi_keyword(attention_cls, config_cls, forward)
        if alibi is not None:  # Bloom's alibi and residual, MPT's position_bias: built as their models build them
            passed |= {alibi, "residual"}
        extra = [p for p, v in forward.items() if p not in passed and v.default is v.empty
                 and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]  # fmt: skip
        if extra:
            raise refuse(name, f"a forward that needs {', '.join(extra)}")
    with deciding(name, f"reading {config_cls.__name__}()"):
        default = config_cls()
        fields = {
            "has_kv_heads": hasattr(default, "num_key_value_heads") and settable(config_cls, "num_key_value_heads"),
            "has_head_dim": hasattr(default, "head_dim") and settable(config_cls, "head_dim"),
            "has_bias_switch": hasattr(default, "attention_bias"),
        }
        for field_name, (neutral, what) in _NEUTRAL.items():
            value = getattr(default, field_name, None)
            if value not in neutral and not _read_elsewhere(default, field_name):
                raise refuse(name, f"config.{field_name}={value!r}: {what}")
        parameters = rope_parameters(default)
        has_rope = bool(parameters) or getattr(default, "rope_theta", None) is not None
        in_layer = getattr(default, "rotary_dim", None) is not None
        if in_layer and has_rope:  # a rotary_dim beside rope_parameters: which one the layer reads is not known
            what = f"RoPE on config.rotary_dim={default.rotary_dim} features beside rope_parameters (which it follows)"
            raise refuse(name, what)
        for key, what in (("llama_4_scaling_beta", "queries scaled by position (Llama 4 scaling)"),):
            if parameters.get(key) is not None:
                raise refuse(name, f"rope_parameters[{key!r}]={parameters[key]!r}: {what}")
        softcap = getattr(default, "attn_logit_softcapping", None)
        if softcap is not None and implementation == "sdpa":
            raise refuse(name, f"config.attn_logit_softcapping={softcap!r} under sdpa (transformers' sdpa refuses it)")
    rotary_cls = None
    style: RopeStyle = "half"
    factor = 1.0
    types = tuple(getattr(default, "layer_types", None) or ())
    layers = tuple((types.index(t), t) for t in ATTENTION_LAYERS if t in types) if types else ((0, None),)
    switches = list(getattr(default, "no_rope_layers", None) or ())  # SmolLM3: 1 where a layer rotates, 0 where not
    if switches and not types:
        layers = tuple((switches.index(v), None) for v in sorted(set(switches), reverse=True))
    if not layers:
        raise refuse(name, f"layer_types {sorted(set(types))} (no full or sliding attention layer)")
    with deciding(name, f"building {name} tiny"):
        sizes: dict[str, Any] = {"hidden_size": 32, "num_attention_heads": 2, "attn_implementation": implementation}
        if fields["has_kv_heads"]:
            sizes["num_key_value_heads"] = 1
        if fields["has_head_dim"]:
            sizes["head_dim"] = 16
            if _accepts(config_cls, **{**sizes, "hidden_size": 24}):  # num_heads * head_dim apart from hidden_size
                sizes["hidden_size"] = 24
        if in_layer:
            sizes["rotary_dim"] = 8  # of the tiny head's 16 features
        config = tiny_config(config_cls, **sizes)
        try:
            module = attention_cls(config, layer_idx=layers[0][0])
        except TypeError:  # what a model passes its layers is not what this one takes
            raise refuse(name, _not_built_from_config(attention_cls)) from None
        except ValueError:
            if sizes.get("num_key_value_heads") != 1:
                raise
            # a class that takes no single KV head (DiffLlama splits its values in two along them): built as MHA
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
            config = tiny_config(config_cls, **sizes)
            module = attention_cls(config, layer_idx=layers[0][0])
        if not forward.get("position_embeddings") and (has_rope or in_layer):
            raise refuse(name, "RoPE applied inside the layer from position_ids (no position_embeddings argument)")
        if in_layer:
            rotary_cls = rotary_class(attention_cls, config_cls)
            if rotary_cls is None:
                raise refuse(name, "RoPE on config.rotary_dim features without a rotary class beside the layer")
            modeling = importlib.import_module(attention_cls.__module__)
            style = "interleaved" if sincos_rope(modeling, rotary_cls(config), 8, f"{OWNER}: {name}")[1] else "half"
        elif has_rope:
            config = tiny_config(config_cls, **sizes, rope_parameters=drawn_rope(default, 10000.0))
            factor = _rotary_factor(config, name, layers[0][1])
            rotary_cls = rotary_class(attention_cls, config_cls)
            if rotary_cls is None:
                raise refuse(name, "RoPE without a rotary class beside the layer")
            d_head = _head_dim(config)
            width = int(d_head * factor)
            if width % 2 or width < 2:
                raise refuse(name, f"a rotary part of {width} features")
            style = _rope_style(attention_cls, rotary_cls(config), width, name, layers[0][1])
        fused = _layout(module, name, config)
        tied = _widths(module, name, config, fused)
        modules = {i: module if i == layers[0][0] else attention_cls(config, layer_idx=i) for i, _ in layers}
        holding = [i for i, m in modules.items() if _holds_qk_norm(m)]
        norm = _qk_norm(modules[holding[0]], name, config) if holding else None
        if norm is None and getattr(default, "use_qk_norm", None) not in (None, False):
            raise refuse(name, f"config.use_qk_norm={default.use_qk_norm!r}: {_NEUTRAL['use_qk_norm'][1]}")
        out_norm = _out_norm(module, name, config)
        for held_module in modules.values():
            _refuse_unloaded(held_module, name, fused)
        nope = _nope_layers(attention_cls, config_cls, rotary_cls, sizes, layers) if rotary_cls else frozenset()
        try:  # the forward that runs (inherited by a subclass, unwrapped where a decorator says what it wraps)
            source = inspect.getsource(inspect.unwrap(attention_cls.forward))
        except (OSError, TypeError):  # no source to read: taken as computing attention itself
            source = ""
    if implementation != "eager" and "ALL_ATTENTION_FUNCTIONS" not in source:
        raise refuse(
            name,
            f"attention computed by the layer itself under {implementation} (its model passes it "
            "a mask of its own, not transformers' attention interface)",
        )
    if isinstance(getattr(module, "sinks", None), nn.Parameter) and implementation != "eager":
        raise refuse(
            name,
            f"attention sinks under {implementation} (transformers' {implementation} does not apply them; eager does)",
        )
    if not getattr(module, "is_causal", True):
        raise refuse(name, "a non-causal layer (is_causal=False)")
    scales = [s for s in _SCALES if getattr(default, s, None) is not None]
    if len(scales) > 1:
        raise refuse(name, f"two score scales ({', '.join(scales)})")
    scale = None
    if scales == ["query_pre_attn_scalar"]:
        scale = _pre_attn_scale
    elif scales == ["attention_multiplier"]:
        scale = _multiplier
    chunk = getattr(default, "attention_chunk_size", None) if "chunked_attention" in types else None
    return Recipe(
        name=name,
        qk_norm_layers=None if len(holding) == len(modules) else frozenset(holding),
        temperature=bool(getattr(default, "attn_temperature_tuning", False)) and bool(nope),
        chunk=chunk,
        alibi=alibi,
        config_cls=config_cls,
        width_free=fields["has_head_dim"]
        and not tied
        and _accepts(config_cls, hidden_size=6, num_attention_heads=4, head_dim=2),
        tied_width=tied,
        nope=nope,
        fused=fused,
        rotary_cls=rotary_cls,
        rope_style=style,
        rotary_factor=factor,
        in_layer_rope=in_layer,
        blocks=next((found[1] for found in [block_fused(module)] if found is not None), 1),
        qk_norm=norm,
        out_norm_eps=out_norm,
        logit_softcap=None if softcap is None else float(softcap),
        scale=scale,
        layers=layers,
        windowed=getattr(default, "sliding_window", None) is not None or "sliding_attention" in types,
        takes_position_embeddings="position_embeddings" in forward,
        cache_keyword=next((k for k in _CACHE_WORDS if k in forward), "past_key_values"),
        sinks=isinstance(getattr(module, "sinks", None), nn.Parameter),
        output_gate=fused is None and _gated(module, config),
        multi_query=bool(getattr(default, "multi_query", False)),
        has_kv_heads=fields["has_kv_heads"],
        has_head_dim=fields["has_head_dim"],
        has_bias_switch=fields["has_bias_switch"],
    )


def _alibi_keyword(attention_cls: type[nn.Module], config_cls: type, forward: Any) -> str | None:
    """The forward's keyword for ALiBi biases its model builds with the modeling module's own function: Bloom's
    `alibi` (`build_alibi_tensor`; Falcon's too where `config.alibi` is set, refused by that field), MPT's
    `position_bias` (`build_mpt_alibi_tensor`); None for a layer that takes none."""
    modeling = importlib.import_module(attention_cls.__module__)
    if "position_bias" in forward and hasattr(modeling, "build_mpt_alibi_tensor"):
        return "position_bias"
    if "alibi" in forward and getattr(config_cls(), "alibi", True) and hasattr(modeling, "build_alibi_tensor"):
        return "alibi"
    return None


def _pre_attn_scale(config: Any) -> float:
    return float(config.query_pre_attn_scalar) ** -0.5


def _multiplier(config: Any) -> float:
    return float(config.attention_multiplier)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _accepts(config_cls: type, **sizes: int) -> bool:
    try:
        tiny_config(config_cls, **sizes)
    except Exception:
        return False
    return True


_PER_HEAD = ("query_key_value",)  # GPT-NeoX, Persimmon: each head's [q; k; v] rows together


def _layout(module: nn.Module, name: str, config: Any) -> str | None:
    """None: four projections; "stacked": one `[q; k; v]`; "per_head": `[q_h; k_h; v_h]` for each head; "blocks":
    CodeGen's `qkv_proj`, its `mp_num` blocks each `[q_b; v_b; k_b]`."""
    if block_fused(module) is not None:
        return "blocks"
    if isinstance(getattr(module, "query_key_value", None), nn.Linear):
        if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
            return "stacked"  # Falcon's multi-query layout: every head's queries, then the one key and value
        if getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads):
            raise refuse(name, "a per-head fused query_key_value with grouped KV heads")
        return "per_head"
    found = {role: next((n for n in NAMES[role] if isinstance(getattr(module, n, None), nn.Module)), None)
             for role in ("q", "k", "v", "o", "qkv")}  # fmt: skip
    if found["o"] is None:
        raise refuse(name, "a layer without an output projection")
    if all(found[r] for r in "qkv"):
        return None
    if found["qkv"] is not None:
        return "stacked"
    children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
    raise refuse(name, f"a projection layout other than q/k/v/o or a fused [q; k; v] (children: {children})")


def _gated(module: nn.Module, config: Any) -> bool:
    """A q_proj twice as wide as the queries (Qwen3-Next's: each head's queries, then its output gate). Which rows
    are which, and that the gate is a sigmoid of the merged heads, is what the check's comparisons verify."""
    q = next((getattr(module, n) for n in NAMES["q"] if isinstance(getattr(module, n, None), nn.Linear)), None)
    return q is not None and q.weight.shape[0] == 2 * config.num_attention_heads * _head_dim(config)


def _widths(module: nn.Module, name: str, config: Any, fused: str | None) -> bool:
    """Refuse projections of other widths than the sizes make them (a gated q_proj apart); True where the output
    projection takes `hidden_size` features instead of `num_heads * head_dim` (Helium)."""
    d, heads = _head_dim(config), config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = config.hidden_size
    o: Any = next(getattr(module, n) for n in NAMES["o"] if isinstance(getattr(module, n, None), nn.Module))
    o_in = o.weight.shape[0] if type(o).__name__ == "Conv1D" else o.weight.shape[1]
    if fused is None:
        shapes = {r: getattr(module, next(n for n in NAMES[r] if isinstance(getattr(module, n, None), nn.Module)))
                  for r in "qkv"}  # fmt: skip
        outs = {
            r: (p.weight.shape[1] if type(p).__name__ == "Conv1D" else p.weight.shape[0]) for r, p in shapes.items()
        }
        wanted = {"q": heads * d * (2 if _gated(module, config) else 1), "k": kv_heads * d, "v": kv_heads * d}
        for role, width in outs.items():
            if width != wanted[role]:
                raise refuse(name, f"a projection of {width} features where the sizes make {wanted[role]} ({role})")
    if o_in == heads * d:
        return False
    if o_in == hidden:
        return True
    raise refuse(name, f"an output projection of {o_in} input features where the sizes make {heads * d}")


def _nope_layers(
    attention_cls: type[nn.Module],
    config_cls: type,
    rotary_cls: type[nn.Module],
    sizes: dict[str, Any],
    layers: tuple[tuple[int, str | None], ...],
) -> frozenset[int]:
    """The layers whose the rotary tables where other types' layers use them (NoPE layers).

    Shown on a probe (the same input, the tables of its positions and of position 0): the config does not
    say it (Cohere 2 and EXAONE 4 rotate only on sliding layers). A model whose layers all ignore the
    tables is not told apart: that is a missing RoPE for the check to report.
    """
    if len(layers) < 2:
        return frozenset()
    ignoring = set()
    config = tiny_config(config_cls, **{**sizes, "attn_implementation": "eager"})
    x = torch.randn(1, 4, config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.arange(4)[None]
    rotary = rotary_cls(config).double()
    for index, layer_type in layers:
        layer = attention_cls(config, layer_idx=index).double().eval()
        with torch.no_grad():
            outs = [layer(x, position_embeddings=cast_embeddings(embeddings(rotary, x, at, layer_type), torch.float64),
                          attention_mask=None, position_ids=at)[0] for at in (positions, positions * 0)]  # fmt: skip
        if torch.equal(outs[0], outs[1]):
            ignoring.add(index)
    return frozenset() if len(ignoring) == len(layers) else frozenset(ignoring)


def _read_elsewhere(default: Any, field_name: str) -> bool:
    """Whether a field of `_NEUTRAL` is read from the layer or the config's layer layout instead of refused:
    Llama 4's `use_qk_norm` (its `qk_norm`, shown on a probe; refused if the layer holds none the check knows),
    `attention_chunk_size` where `layer_types` has chunked_attention layers (the mask of transformers'
    `create_chunked_causal_mask`), and `attn_temperature_tuning` beside the `floor_scale` and `attn_scale` it reads
    and the `no_rope_layers` it applies to."""
    if field_name == "use_qk_norm":
        return True
    if field_name == "attention_chunk_size":
        return "chunked_attention" in (getattr(default, "layer_types", None) or ())
    if field_name == "attn_temperature_tuning":
        return all(getattr(default, f, None) is not None for f in ("floor_scale", "attn_scale", "no_rope_layers"))
    return False


def _holds_qk_norm(module: nn.Module) -> bool:
    names = (SHARED_QK_NORM, *(n for pair in QK_NORMS for n in pair))
    return any(isinstance(getattr(module, n, None), nn.Module) for n in names)


def _shared_qk_norm(norm: nn.Module, width: int, name: str) -> QKNorm:
    """Llama 4's `qk_norm`: one norm without parameters for queries and keys, `x / sqrt(mean(x**2) + eps)` over each
    head, shown on a probe with the epsilon it holds."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if any(True for _ in norm.parameters()) or not isinstance(eps, float):
        raise refuse(name, f"{SHARED_QK_NORM}={type(norm).__name__} (not a norm without weight with an epsilon)")
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = norm(x)
    if not torch.allclose(got.double(), x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps), rtol=1e-5, atol=1e-6):
        raise refuse(name, f"{SHARED_QK_NORM}={type(norm).__name__}, a norm other than x / rms(x)")
    return QKNorm(0.0, eps, "head", (SHARED_QK_NORM, SHARED_QK_NORM), after_rope=True, weighted=False)


def _qk_norm(module: nn.Module, name: str, config: Any) -> QKNorm | None:
    shared = getattr(module, SHARED_QK_NORM, None)
    if isinstance(shared, nn.Module):
        if any(hasattr(module, n) for pair in QK_NORMS for n in pair):
            raise refuse(name, "two QK-norms")
        return _shared_qk_norm(shared, _head_dim(config), name)
    held = [(names, after) for names, after in QK_NORMS.items() if any(hasattr(module, n) for n in names)]
    if not held:
        return None
    if len(held) > 1:
        raise refuse(name, "two QK-norms")
    labels, after_rope = held[0]
    norms: list[Any] = [getattr(module, n, None) for n in labels]
    if all(n is None for n in norms):
        return None
    if any(n is None or isinstance(n, nn.Identity) for n in norms):
        raise refuse(name, "a norm of queries or of keys alone")
    d = _head_dim(config)
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    q_weight = getattr(norms[0], "weight", torch.zeros(0))
    q_width = q_weight.shape[-1]
    over: NormOver = "head" if q_width == d else "all"
    if q_weight.dim() == 2 and q_width == d:  # Cohere: weights (heads, head_dim), each head's own
        over = "per_head"
    widths = (d, d) if over != "all" else (heads * d, kv_heads * d)
    each = (heads, kv_heads) if over == "per_head" else (None, None)
    (q_kind, q_offset, q_eps), k_norm = (
        _norm_of(n, w, name, label, h) for n, w, label, h in zip(norms, widths, labels, each, strict=True)
    )
    if (q_kind, q_offset, q_eps) != k_norm:
        raise refuse(name, "a query norm and a key norm that differ in kind")
    if (after_rope or q_kind != "rms") and over == "all":
        raise refuse(name, f"a QK-norm over every head ({q_kind}{', after RoPE' if after_rope else ''})")
    if after_rope and (q_kind != "rms" or over == "per_head"):
        raise refuse(name, f"a QK-norm after RoPE other than an RMSNorm of one weight for every head ({q_kind})")
    return QKNorm(q_offset, q_eps, over, labels, after_rope, q_kind)


def _out_norm(module: nn.Module, name: str, config: Any) -> float | None:
    """The epsilon of an RMSNorm of the merged heads before the output projection (BitNet), if the layer has one."""
    norm = next((getattr(module, n) for n in OUT_NORMS if isinstance(getattr(module, n, None), nn.Module)), None)
    if norm is None:
        return None
    kind, offset, eps = _norm_of(norm, config.num_attention_heads * _head_dim(config), name, "attn_sub_norm")
    if offset or kind != "rms":
        raise refuse(name, f"an output norm other than an RMSNorm of weight ({type(norm).__name__})")
    return eps


def _refuse_unloaded(module: nn.Module, name: str, fused: str | None) -> None:
    """Parameters the check would not draw (sinks, other norms, gates, experts) are refused by name, and norms
    without parameters too (Gemma 3n's v_norm)."""
    variant = own_variant(n for n, _ in module.named_parameters(recurse=False))
    if variant is not None:
        raise refuse(name, variant)
    known = {n for names in QK_NORMS for n in names} | set(OUT_NORMS) | {SHARED_QK_NORM}
    norms = [n for n, _ in module.named_children() if "norm" in n.lower() and n not in known]
    if norms:
        raise refuse(name, f"a norm of its own ({', '.join(norms)})")
    loaded = set(known)
    sinks = getattr(module, "sinks", None)
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if isinstance(sinks, nn.Parameter) and sinks.shape == (heads,):  # drawn by the check: one logit per head
        loaded.add("sinks")
    for role in ("q", "k", "v", "o") if fused is None else ("o", "qkv"):
        names = (*NAMES[role], *_PER_HEAD) if role == "qkv" else NAMES[role]
        loaded.add(next(n for n in names if isinstance(getattr(module, n, None), nn.Module)))
    others = sorted({n.split(".")[0] for n, _ in module.named_parameters() if n.split(".")[0] not in loaded})
    if others:
        held = ", ".join(f"{n} ({type(getattr(module, n)).__name__})" if isinstance(getattr(module, n), nn.Module)
                         else n for n in others)  # fmt: skip
        raise refuse(name, f"parameters of its own ({held})")


def load_layer_weights(
    module: nn.Module,
    weights: AttentionWeights,
    recipe: Recipe,
    heads: int,
    gate: tuple[Tensor, Tensor | None] | None = None,
) -> AttentionWeights:
    """`load_weights`, and the per-head fused layout (`query_key_value` rows `[q_h; k_h; v_h]` for each head),
    CodeGen's (`qkv_proj` rows in `recipe.blocks` blocks, each `[q_b; v_b; k_b]`) and a gated q_proj (`gate`'s
    rows after each head's queries, Qwen3-Next's)."""
    if gate is not None:
        return _load_gated(module, weights, heads, gate)
    if recipe.fused not in ("per_head", "blocks"):
        named = recipe.fused == "stacked" and isinstance(getattr(module, "query_key_value", None), nn.Module)
        return load_weights(module, weights, names={"qkv": "query_key_value"} if named else None)
    fused: Any = module.query_key_value if recipe.fused == "per_head" else module.qkv_proj
    d = weights.w_q.shape[0] // heads

    def per_head(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if recipe.fused == "blocks":
            rows = {"q_proj": q, "k_proj": k, "v_proj": v}
            return torch.stack([rows[n].unflatten(0, (recipe.blocks, -1)) for n in BLOCK_ORDER], 1).flatten(0, 2)
        return torch.cat([torch.cat((q[h * d : (h + 1) * d], k[h * d : (h + 1) * d], v[h * d : (h + 1) * d]))
                          for h in range(heads)])  # fmt: skip

    qkv = (weights.w_q, weights.w_k, weights.w_v)
    biases = [torch.zeros_like(w[:, 0]) if b is None else b
              for w, b in zip(qkv, (weights.b_q, weights.b_k, weights.b_v), strict=True)]  # fmt: skip
    o = next(getattr(module, n) for n in NAMES["o"] if isinstance(getattr(module, n, None), nn.Module))
    with torch.no_grad():
        fused.weight.copy_(per_head(*qkv))
        if fused.bias is not None:
            fused.bias.copy_(per_head(*biases))
        o.weight.copy_(weights.w_o)
        if o.bias is not None:
            o.bias.copy_(torch.zeros_like(o.bias) if weights.b_o is None else weights.b_o)
    b_q, b_k, b_v = biases if fused.bias is not None else (None, None, None)
    return replace(weights, b_q=b_q, b_k=b_k, b_v=b_v, b_o=None if o.bias is None else weights.b_o)


def scale_of(recipe: Recipe, config: Any) -> float | None:
    return None if recipe.scale is None else recipe.scale(config)


def _load_gated(
    module: nn.Module, weights: AttentionWeights, heads: int, gate: tuple[Tensor, Tensor | None]
) -> AttentionWeights:
    """`weights` into a layer whose q_proj holds each head's queries, then its gate: the query and gate rows laid
    head by head; returned are the weights it computes with, the queries' rows as drawn."""

    def per_head(q: Tensor, g: Tensor) -> Tensor:
        return torch.stack((q.unflatten(0, (heads, -1)), g.unflatten(0, (heads, -1))), 1).flatten(0, 2)

    w_g, b_g = gate
    b_q = torch.zeros_like(weights.w_q[:, 0]) if weights.b_q is None else weights.b_q
    b_gate = torch.zeros_like(w_g[:, 0]) if b_g is None else b_g
    gated = replace(weights, w_q=per_head(weights.w_q, w_g), b_q=per_head(b_q, b_gate))
    held = load_weights(module, gated, names={"q": "q_proj"})
    return replace(held, w_q=weights.w_q, b_q=None if held.b_q is None else b_q)
