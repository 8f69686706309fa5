"""Hugging Face interop: load a transformers attention layer (Llama, Mistral, Qwen2/3, Gemma 2 layout), and back.

transformers is an optional dependency (`pip install "shapesafe_mha[hf]"`); it is imported only
when `to_hf` needs it. Sliding windows, QK-norm, logit softcapping, `query_pre_attn_scalar`,
Granite's `attention_multiplier` (loaded as `query_pre_attn_scalar = multiplier**-2`), partial rotary
(`partial_rotary_factor`, in `rope_parameters` since transformers 5) and interleaved RoPE (shown on the
model's own rotary tables and `apply_rotary_pos_emb`, which no config field names; GPT-J's and CodeGen's RoPE of
`rotary_dim` features, with a theta read from their own tables) become the module's options; a variant it does
not compute (RoPE scaling other than llama3, YaRN, dynamic and LongRoPE; a QK-norm other than an RMSNorm, Gemma 3's
`1 + weight` or Cohere's LayerNorm of each head) is a `ConfigError` naming the config field, never a silently
different layer.
"""

import contextlib
import copy
import dataclasses
import importlib
import inspect
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.cache import KVCache
from .._compute.rotary import SUPPORTED_SCALING
from .._core import probe
from .._core.errors import ConfigError

_OWNER = "MultiHeadAttention.from_hf()"


def _refuse(field: str, value: Any, why: str, owner: str = _OWNER) -> ConfigError:
    return ConfigError(f"{owner}: {field}={value!r}: {why}; this layer would compute something else, so it is refused.")


def _rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The config's `rope_parameters` (`rope_scaling` before transformers 5); those of `layer_type` where a set is
    kept per layer type (Gemma 3, OLMo 3), or the one set they all share."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sets = {kind: value for kind, value in parameters.items() if isinstance(value, dict)}
    if not sets or len(sets) != len(parameters):
        return dict(parameters)
    if layer_type in sets:
        return dict(sets[layer_type])
    first = next(iter(sets.values()))
    if all(value == first for value in sets.values()):
        return dict(first)
    raise _refuse("rope_parameters", sorted(sets), "RoPE parameters differ by layer type, and the layer's is not known")


def rope_of(config: Any, layer_type: str | None = None) -> tuple[float | None, dict[str, Any] | None]:
    """`(rope_theta, scaling)` of a transformers config (`rope_parameters` in transformers 5, else `rope_theta`);
    a layer of `layer_type` where the config keeps them per layer type."""
    parameters = _rope_parameters(config, layer_type)
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in SUPPORTED_SCALING:
        raise _refuse("rope_parameters['rope_type']", kind, f"only {', '.join(SUPPORTED_SCALING)} RoPE is supported")
    scaling = {k: v for k, v in parameters.items() if k != "partial_rotary_factor"}
    if kind == "yarn":
        scaling.update(_yarn_as_computed(config, scaling))
    if kind == "dynamic":  # the length past which it scales is the config's, not the parameters'
        scaling.pop("original_max_position_embeddings", None)
        scaling["max_position_embeddings"] = config.max_position_embeddings
    if kind == "longrope" and scaling.get("factor") is None and scaling.get("attention_factor") is None:
        # as `_compute_longrope_parameters` takes it (Phi-3 gives no factor)
        original = scaling.get("original_max_position_embeddings")
        if original:
            scaling["factor"] = config.max_position_embeddings / original
    return theta, (scaling if kind != "default" else None)


def _yarn_as_computed(config: Any, scaling: dict[str, Any]) -> dict[str, Any]:
    """The YaRN fields transformers' `_compute_yarn_parameters` reads from elsewhere than the layer's set: a
    missing `factor` is `max_position_embeddings / original_max_position_embeddings` (DeepSeek-V3), and
    `truncate` is read from the top level of `rope_parameters` (with sets per layer type: always True)."""
    found: dict[str, Any] = {}
    if scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        found["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    top = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if top.get("truncate", True) != scaling.get("truncate", True):
        found["truncate"] = top.get("truncate", True)
    return found


def rope_dim_of(config: Any, head_dim: int, layer_type: str | None = None) -> int | None:
    """The rotated features of each head, `int(head_dim * partial_rotary_factor)` as transformers' rotary classes
    compute it (the factor in `rope_parameters` in transformers 5, on the config before); None: every feature."""
    parameters = _rope_parameters(config, layer_type)
    found = [
        (field, value)
        for field, value in (
            ("rope_parameters['partial_rotary_factor']", parameters.get("partial_rotary_factor")),
            ("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)),
            ("rotary_pct", getattr(config, "rotary_pct", None)),
        )
        if value is not None
    ]
    if not found:
        return None
    field, factor = found[0]
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise _refuse(field, factor, "the rotated share of a head must be a number in (0, 1]")
    width = int(head_dim * factor)
    if width == head_dim:
        return None
    if width < 2 or width % 2:
        raise _refuse(field, factor, f"it rotates {width} of head_dim={head_dim} features, not an even number")
    return width


def rope_interleaved(modeling: Any, cos: Tensor, sin: Tensor, width: int | None = None) -> bool:
    """Whether a model's RoPE turns adjacent pairs `(2i, 2i+1)` rather than halves, shown on its own parts.

    `cos`, `sin` are its rotary class's tables `(batch, seq, features)` for positions `0, 1, ...`, for `width`
    rotated features (default: the tables' width; gpt-oss keeps one angle per pair, a table half as wide). A
    table with each angle twice in a row (Cohere's) says pairs. A table in halves may still be applied to pairs
    (GLM and ERNIE interleave it inside `apply_rotary_pos_emb`): the modeling module's own function on a probe
    tells. A function that matches neither is taken as halves, and the probe of a conversion (or the check of
    a class) then names the difference.
    """
    width = cos.shape[-1] if width is None else width
    row = cos[0, -1]
    if cos.shape[-1] == width and width > 2 and torch.equal(row[0::2], row[1::2]):
        return True
    apply = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply is None or width <= 2:  # two features: halves and pairs are one rotation
        return False
    cos, sin = cos.detach().double(), sin.detach().double()
    q = torch.randn(1, 1, cos.shape[1], width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = q.to(cos.device)
    try:
        turned = apply(q, q, cos, sin)[0]
    except Exception:  # another signature: the probe of the conversion decides
        return False
    angles = width // 2 if cos.shape[-1] == width else cos.shape[-1]  # one angle per pair, first in the table
    cos, sin = cos[..., :angles].repeat_interleave(2, -1), sin[..., :angles].repeat_interleave(2, -1)
    paired = K.rotate(q, cos, sin, True)
    return turned.shape == q.shape and bool(torch.allclose(turned.double(), paired, atol=1e-5))


def rope_layout_of(layer: nn.Module, config: Any, head_dim: int) -> tuple[int | None, bool]:
    """`(rope_dim, interleaved)` of a transformers attention layer with RoPE: the rotated part, and its pairing."""
    rope_dim = rope_dim_of(config, head_dim, _layer_type(layer, config))
    rotary = _rotary_for(layer, config)
    interleaved = bool(getattr(config, "rope_interleave", False))
    if rotary is not None and not interleaved:
        positions = torch.arange(4)[None]
        dummy = torch.zeros(1, 4, 8)
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        with torch.no_grad():
            found = rotary(dummy, positions, *([_layer_type(layer, config)] if takes_type else []))
        if isinstance(found, Tensor) and found.is_complex():
            return rope_dim, True  # Llama 4's freqs_cis: one complex angle per adjacent pair (view_as_complex)
        cos, sin = found
        interleaved = rope_interleaved(_modeling(layer), cos, sin)
    return rope_dim, interleaved


def sincos_rope(modeling: Any, rotary: nn.Module, width: int, owner: str = _OWNER) -> tuple[float, bool]:
    """`(theta, interleaved)` of GPT-J's and CodeGen's RoPE, shown on their own parts, which no config field describes.

    Their rotary class returns `(sin, cos)` (told apart at position 0, where sin is 0), one angle per pair of the
    `width` rotated features; theta is read from the last angle at position 1, `theta ** -((width - 2) / width)`,
    taken as the nearest integer where that gives every angle to a float32 table's rounding (with one pair, the
    angle is the position whatever theta is: 1.0). The pairing is the modeling module's own
    `apply_rotary_pos_emb(tensor, sin, cos)` on a probe, against adjacent pairs (GPT-J's `rotate_every_two`) and
    halves; one that matches neither is taken as halves, and the conversion's probe (or the check) names the
    difference. A table of another shape, or without a sin and a cos, raises `ConfigError` naming it.
    """
    device = next((b.device for b in rotary.buffers()), torch.device("cpu"))  # where its table is
    positions = torch.arange(4, device=device)[None]
    with torch.no_grad():
        found = rotary(torch.zeros(1, 4, width, dtype=torch.float64, device=device), positions)

    def refused(what: str) -> ConfigError:
        return ConfigError(f"{owner}: {type(rotary).__name__} returns {what}; RoPE inside the layer is refused.")

    if not isinstance(found, tuple) or len(found) != 2 or not all(isinstance(t, Tensor) for t in found):
        raise refused("no pair of tables")
    first, second = (t.detach().double().cpu() for t in found)
    if first.shape != (1, 4, width // 2) or second.shape != first.shape:
        raise refused(f"tables {tuple(first.shape)}, not one angle per pair of rotary_dim={width} features")
    if torch.all(first[0, 0] == 0) and torch.all(second[0, 0] == 1):
        sin, cos = first, second
    elif torch.all(first[0, 0] == 1) and torch.all(second[0, 0] == 0):
        cos, sin = first, second
    else:
        raise refused("tables that are neither a sin nor a cos (0 and 1 at position 0)")
    angles = torch.atan2(sin[0, 1], cos[0, 1])
    theta = 1.0
    if width > 2:
        estimate = float(torch.exp(-angles[-1].log() * width / (width - 2)))
        spaced = torch.arange(0, width, 2, dtype=torch.float64) / width
        rounded = float(round(estimate))
        exact = rounded > 1 and torch.allclose(rounded**-spaced, angles, rtol=1e-5, atol=0)
        theta = rounded if exact else estimate
    return theta, _pairs_in(modeling, sin, cos, width)


def _pairs_in(modeling: Any, sin: Tensor, cos: Tensor, width: int) -> bool:
    """Whether the modeling module's `apply_rotary_pos_emb(tensor, sin, cos)` (GPT-J's) turns adjacent pairs."""
    apply = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply is None or width <= 2:  # two features: halves and pairs are one rotation
        return False
    q = torch.randn(1, sin.shape[1], 1, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    try:
        turned = apply(q, sin=sin, cos=cos)  # (batch, seq, heads, features), as GPT-J's layer calls it
    except Exception:  # another signature: the probe of the conversion decides
        return False
    cos2, sin2 = (t[:, :, None].repeat_interleave(2, -1) for t in (cos, sin))
    paired = K.rotate(q, cos2, sin2, True)
    return isinstance(turned, Tensor) and turned.shape == q.shape and bool(torch.allclose(turned.double(), paired))


def in_layer_rope(layer: nn.Module, config: Any, head_dim: int) -> tuple[float, int | None, bool]:
    """`(theta, rope_dim, interleaved)` of a layer that rotates `config.rotary_dim` features of each head with its
    own tables (GPT-J, CodeGen: no `rope_parameters`); rope_dim None: every feature."""
    width = getattr(config, "rotary_dim", None)
    if isinstance(width, bool) or not isinstance(width, int) or not 2 <= width <= head_dim or width % 2:
        why = f"the rotated part must be an even number of features in [2, head_dim={head_dim}]"
        raise _refuse("rotary_dim", width, why)
    rotary = _rotary_for(layer, config)
    if rotary is None:
        where = f"no rotary class in {_modeling(layer).__name__} makes {type(layer).__name__}'s tables"
        raise _refuse("rotary_dim", width, where)
    theta, interleaved = sincos_rope(_modeling(layer), rotary, width)
    return theta, (None if width == head_dim else width), interleaved


def variant_options(attention: nn.Module, config: Any) -> dict[str, Any]:
    """The `MultiHeadAttention` options of the variants `attention` uses; refuse the others, naming the field."""
    options: dict[str, Any] = {}
    window = getattr(attention, "sliding_window", None)
    if window is None and not hasattr(attention, "sliding_window"):  # Mistral: the config's window applies
        window = getattr(config, "sliding_window", None)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            field = "sliding_window"
            raise _refuse(field, window, "a sliding window must be a positive number of keys (None: no window)")
        options["window"] = window
    names, after_rope = qk_norm_names(attention)
    norms = [getattr(attention, norm, None) for norm in names]
    shared = getattr(attention, SHARED_QK_NORM, None)
    if isinstance(shared, nn.Module):  # Llama 4: one norm without weight after RoPE, ours of weight 1
        options.update(qk_norm=True, norm_eps=_norm_eps(shared), qk_norm_over="head", qk_norm_offset=0.0,
                       qk_norm_after_rope=True)
    elif any(norm is not None for norm in norms):
        options["qk_norm"] = True
        options["norm_eps"] = _norm_eps(norms[0])
        options["qk_norm_over"] = _norm_over(norms[0], config)
        options["qk_norm_offset"] = _norm_offset(norms[0])
        if _norm_centred(norms[0]):  # Cohere's LayerNorm without bias (what load_norms' probe verifies)
            options["qk_norm_centred"] = True
        if after_rope:
            options["qk_norm_after_rope"] = True
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        options["logit_softcap"] = float(softcap)
    head_dim = _head_dim(config)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    expected = head_dim**-0.5
    if scalar is not None:
        options["query_pre_attn_scalar"] = float(scalar)
        expected = float(scalar) ** -0.5
    if getattr(config, "scale_attn_weights", True) is False and scalar is None:  # GPTBigCode: unscaled scores
        options["query_pre_attn_scalar"] = 1.0
        expected = 1.0
    multiplier = getattr(config, "attention_multiplier", None)
    if multiplier is not None:  # Granite: the scores scaled by the multiplier itself, 1/sqrt(multiplier**-2)
        if scalar is not None or isinstance(multiplier, bool) or not multiplier > 0:
            raise _refuse("attention_multiplier", multiplier, "only a positive multiplier, alone, is supported")
        options["query_pre_attn_scalar"] = float(multiplier) ** -2
        expected = float(multiplier)
    softmax_scale = getattr(attention, "softmax_scale", None)  # MPT: attn_config.softmax_scale, else 1/sqrt(head_dim)
    if isinstance(softmax_scale, float) and scalar is None and multiplier is None:
        if abs(softmax_scale - expected) > 1e-12:
            options["query_pre_attn_scalar"] = softmax_scale**-2
        expected = softmax_scale
    scaling = getattr(attention, "scaling", expected)
    if abs(scaling - expected) > 1e-12:
        raise _refuse("scaling", scaling, f"only 1/sqrt(query_pre_attn_scalar or head_dim) = {expected:g} is supported")
    if not getattr(attention, "is_causal", True):
        raise _refuse("is_causal", False, "only causal (decoder) attention layers are supported")
    clip = getattr(config, "clip_qkv", None)
    if not hasattr(config, "clip_qkv"):  # MPT: attn_config.clip_qkv, read by the layer (`if self.clip_qkv:`)
        clip = getattr(attention, "clip_qkv", None) or None
    if clip is not None:  # OLMo, OLMoE: the projections clamped before the head split
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0:
            raise _refuse("config.clip_qkv", clip, "a clip bound must be a positive number (None: no clipping)")
        options["clip_qkv"] = float(clip)
    q_proj = getattr(attention, "q_proj", None)
    if isinstance(q_proj, nn.Linear) and q_proj.out_features == 2 * config.num_attention_heads * head_dim:
        options["output_gate"] = True  # Qwen3-Next: each head's queries, then its gate (what the probe verifies)
    if isinstance(getattr(attention, "sinks", None), nn.Parameter):  # gpt-oss: one logit per head, its s_aux
        options["attention_sinks"] = True
    if _layer_type(attention, config) == "chunked_attention":  # Llama 4: each query sees its chunk's keys
        chunk = getattr(config, "attention_chunk_size", None)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not chunk > 0:
            raise _refuse("config.attention_chunk_size", chunk, "a chunked layer needs a positive int chunk size")
        options["chunk_size"] = chunk
    index = getattr(attention, "layer_idx", 0) or 0
    if getattr(config, "attn_temperature_tuning", False) and not _rotates(config, index):  # Llama 4's NoPE layers
        floor_scale, attn_scale = getattr(config, "floor_scale", None), getattr(config, "attn_scale", None)
        if isinstance(floor_scale, bool) or not isinstance(floor_scale, int) or not floor_scale > 0:
            raise _refuse("config.floor_scale", floor_scale, "temperature tuning needs a positive int floor_scale")
        if isinstance(attn_scale, bool) or not isinstance(attn_scale, int | float) or not math.isfinite(attn_scale):
            raise _refuse("config.attn_scale", attn_scale, "temperature tuning needs a finite attn_scale")
        options["temperature_tuning"] = (floor_scale, float(attn_scale))
    if alibi_slopes_of(attention, config) is not None:  # Bloom, MPT: biases its model passes in
        options["alibi"] = True
    if isinstance(getattr(attention, K.LAMBDAS[0], None), nn.Parameter):  # DiffLlama: differential attention
        options.update(_differential_options(attention, options.get("norm_eps")))
    return options


def _differential_options(attention: nn.Module, norm_eps: float | None) -> dict[str, Any]:
    """DiffLlama's `lambda_init` (the layer's own, computed from its index) and its `groupnorm`'s epsilon, refused
    by name where the norm is not an RMSNorm without weight whose epsilon we can hold."""
    lambda_init = getattr(attention, "lambda_init", None)
    if isinstance(lambda_init, bool) or not isinstance(lambda_init, int | float) or not math.isfinite(lambda_init):
        raise _refuse("lambda_init", lambda_init, "differential attention needs a finite lambda_init")
    norm = getattr(attention, "groupnorm", None)
    eps = getattr(norm, "eps", None)
    if not isinstance(norm, nn.RMSNorm) or norm.elementwise_affine or not isinstance(eps, float):
        why = "differential attention's norm of each head pair is an nn.RMSNorm without weight, of a given eps, here"
        raise _refuse("groupnorm", type(norm).__name__ if norm is not None else None, why)
    if norm_eps is not None and norm_eps != eps:
        raise _refuse("groupnorm.eps", eps, f"the QK-norm's eps is {norm_eps}, and one norm_eps serves both")
    return {"differential_lambda_init": float(lambda_init), "norm_eps": eps}


def alibi_slopes_of(layer: nn.Module, config: Any) -> Tensor | None:
    """The ALiBi slopes `layer`'s model passes it, one per head (float64), or None for a layer that takes none.

    Read from the model's own function, called as the model calls it: Bloom's `build_alibi_tensor` (its forward
    takes `alibi`; Falcon's too, where `config.alibi` is set: refused before, by field) and MPT's
    `build_mpt_alibi_tensor` (its forward takes `position_bias`; MptModel passes no `alibi_bias_max`, so 8
    whatever `attn_config` says), over two positions: a head's slope is its bias of key 1 less that of key 0.
    """
    built = model_biases(layer, config, 2, torch.ones(1, 2, dtype=torch.long), torch.float64)
    return None if built is None else (built[:, 0, 1] - built[:, 0, 0]).double()


def model_biases(
    layer: nn.Module, config: Any, kv_len: int, attention_mask: Tensor, dtype: torch.dtype
) -> Tensor | None:
    """The ALiBi biases `layer`'s model builds for `kv_len` keys, as it passes them (Bloom: `(batch * heads, 1,
    kv_len)` from `attention_mask`, the 2-D padding mask; MPT: `(heads, 1, max_seq_len)`, of which the layer takes
    the last `kv_len`), or None for a layer that takes none."""
    parameters = inspect.signature(layer.forward).parameters
    modeling = _modeling(layer)
    heads = config.num_attention_heads
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    if "position_bias" in parameters and hasattr(modeling, "build_mpt_alibi_tensor"):
        length = max(getattr(config, "max_seq_len", kv_len), kv_len)
        return modeling.build_mpt_alibi_tensor(heads, length, device=device)
    if "alibi" in parameters and getattr(config, "alibi", True) and hasattr(modeling, "build_alibi_tensor"):
        return modeling.build_alibi_tensor(attention_mask.to(device), heads, dtype)
    return None


# Llama 4's one QK-norm without weight, for queries and keys, after RoPE
SHARED_QK_NORM = "qk_norm"
# A layer's QK-norms by their names: Llama-style q_norm/k_norm before RoPE, HunYuan's after it.
_QK_NORM_NAMES = {("q_norm", "k_norm"): False, ("query_layernorm", "key_layernorm"): True}


def qk_norm_names(layer: nn.Module) -> tuple[tuple[str, str], bool]:
    """The names of `layer`'s query and key norms, and whether they come after RoPE (HunYuan's do); where the
    layer has none, Llama's names. What they compute, and where, is verified by the conversions' probe."""
    for names, after_rope in _QK_NORM_NAMES.items():
        if any(isinstance(getattr(layer, name, None), nn.Module) for name in names):
            return names, after_rope
    return ("q_norm", "k_norm"), False


def _norm_over(norm: Any, config: Any) -> str:
    """"head" for a QK-norm of each head's d_head features, "all" for one of every head's together (OLMo-2),
    "per_head" for one of each head's features with weights of its own, `(heads, head_dim)` (Cohere)."""
    weight = getattr(norm, "weight", None)
    head_dim = _head_dim(config)
    if isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[-1] == head_dim:
        return "per_head"
    width = weight.shape[-1] if isinstance(weight, Tensor) and weight.dim() == 1 else None
    return "all" if width not in (None, head_dim) and width == config.num_attention_heads * head_dim else "head"


@contextlib.contextmanager
def _probed_norm(norm: nn.Module) -> Iterator[Any]:
    """`norm` ready for a probe of what it computes: itself in eval mode, or an eval float32 copy where it is
    half precision (as the layer's probe); on `meta`, which holds no values, a float32 copy on the CPU with
    weights drawn in [0.5, 1.5] (what a norm computes is its class's code, whatever its weights)."""
    if probe.probeable(norm):
        with probe.probing(norm) as probed:
            yield probed
        return
    copied = copy.deepcopy(norm).to_empty(device="cpu").to(torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    yield copied


def _norm_offset(norm: Any) -> float:
    """0.0 for an RMSNorm scaling by `weight`, 1.0 for one scaling by `1 + weight` (Gemma 3), shown on a probe of
    the norm with its own weights; any other norm is 0.0 here, and refused by `load_norms`'s probe."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1:
        return 0.0
    eps = _norm_eps(norm)
    with torch.no_grad(), _probed_norm(norm) as probed:
        weight = probed.weight
        x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
        got = probed(x)
        normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        for offset in (0.0, 1.0):
            if got.shape == x.shape and torch.allclose(got, normed * (offset + weight), rtol=1e-3, atol=1e-5):
                return offset
    return 0.0


def _norm_centred(norm: Any) -> bool:
    """Whether a QK-norm subtracts each row's mean first (Cohere's LayerNorm without bias), shown on a probe of
    the norm with its own weights over its weights' shape; any other norm is False here, and refused by
    `load_norms`'s probe."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() not in (1, 2):
        return False
    with torch.no_grad(), _probed_norm(norm) as probed:
        weight = probed.weight
        x = torch.randn(3, *weight.shape, generator=torch.Generator().manual_seed(0)).to(weight)
        got = probed(x)
        centred = x - x.mean(-1, keepdim=True)
        expected = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + _norm_eps(norm)) * weight
        return got.shape == x.shape and bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-5))


def _norm_eps(norm: Any, owner: str = _OWNER) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        raise _refuse("q_norm", type(norm).__name__, "a QK-norm without an epsilon is not an RMSNorm we know", owner)
    return eps


def load_norms(module: Any, attention: nn.Module) -> None:
    """Copy QK-norm weights, after checking on a probe that their norm is an RMSNorm over `d_head` as ours is
    (Llama 4's `qk_norm` holds none: ours are ones, and the probe shows it computes `x / rms(x)`)."""
    shared = getattr(attention, SHARED_QK_NORM, None)
    their_names = (SHARED_QK_NORM,) * 2 if isinstance(shared, nn.Module) else qk_norm_names(attention)[0]
    for name, their_name in zip(("q_norm", "k_norm"), their_names, strict=True):
        theirs, ours = getattr(attention, their_name), module._modules[name]
        with torch.no_grad():
            held = getattr(theirs, "weight", None)
            ours.weight.copy_(torch.ones_like(ours.weight) if their_name == SHARED_QK_NORM else held)
        # theirs as `_probed_norm` gives it (float32 for half precision, a CPU copy for meta), ours a copy of the
        # same weights, in its dtype and on its device
        with torch.no_grad(), _probed_norm(theirs) as probed:
            dtype, device = probe.dtype_of(probed), next((p.device for p in probed.parameters()), None)
            mine = copy.deepcopy(ours)
            mine = mine.to_empty(device=device or "cpu") if not probe.probeable(mine) else mine
            mine = mine.to(device=device, dtype=dtype).eval()
            weight = getattr(probed, "weight", None)
            mine.weight.copy_(torch.ones_like(mine.weight) if their_name == SHARED_QK_NORM else weight)
            x = torch.randn(3, *mine.weight.shape, generator=torch.Generator().manual_seed(0))
            x = x.to(device=mine.weight.device, dtype=dtype)
            # theirs on (positions, heads, d_head) where its weights are per head (Cohere's, before the transpose)
            got = mine(x.transpose(0, 1)[None])[0].transpose(0, 1) if x.dim() == 3 else mine(x)
            if not torch.allclose(probed(x), got, rtol=1e-3, atol=1e-5):
                why = (
                    "it computes neither weight * x / rms(x), (1 + weight) * x / rms(x) (Gemma 3's) nor "
                    "weight * (x - mean) / std(x) (Cohere's)"
                )
                if their_name == SHARED_QK_NORM:
                    why = "a QK-norm without weight that computes other than x / rms(x) (Llama 4's L2 norm)"
                raise _refuse(name, type(theirs).__name__, why)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_dropout(config: Any) -> float:
    """The dropout of the attention weights: `attention_dropout`, GPT-J's and CodeGen's `attn_pdrop`."""
    found = getattr(config, "attention_dropout", None) or getattr(config, "attn_pdrop", 0.0)
    return float(found or getattr(getattr(config, "attn_config", None), "attn_pdrop", 0.0) or 0.0)  # MPT's


# The output projection's names: Llama's o_proj, Phi's dense, GPT-J's and CodeGen's out_proj, GPTBigCode's c_proj.
_OUTPUT_NAMES = ("o_proj", "dense", "out_proj", "c_proj")
# A fused [q; k; v] projection's names: GPT-NeoX's, Persimmon's and Falcon's query_key_value, GPTBigCode's c_attn.
_FUSED_NAMES = ("query_key_value", "c_attn")
# MPT's Wqkv: every head's query rows, then every head's key rows, then every head's value rows (its chunk(3)).
_CHUNKED_NAMES = ("Wqkv",)
_QK_NORMS_LOADED = tuple(n for p in _QK_NORM_NAMES for n in p)
_LOADED = ("q_proj", "k_proj", "v_proj", *_FUSED_NAMES, *_CHUNKED_NAMES, "qkv_proj", *_OUTPUT_NAMES,
           *_QK_NORMS_LOADED)  # fmt: skip
# CodeGen's qkv_proj: its rows in blocks (one for each model-parallel shard it was trained on), each block's rows
# its share of the queries, then of the values, then of the keys, as its forward splits them.
BLOCK_ORDER = ("q_proj", "v_proj", "k_proj")
# Config fields of layers that compute a variant we do not (each is None or False where they do not).
_UNSUPPORTED_FIELDS = {
    "qk_layernorm": "QK LayerNorm (StableLM, Phi, Persimmon)",
    # Falcon's ALiBi: slopes rounded to bfloat16, scaled by 1/sqrt(head_dim), and added twice under eager (in the
    # layer and in the mask its model builds) but once under sdpa; Bloom's and MPT's load (alibi_slopes_of)
    "alibi": "Falcon's ALiBi position biases (computed differently by its eager and sdpa paths)",
}
# Parameters of a layer's own that name the variant it computes, where the check's reference computes none of it
# (MultiHeadAttention computes DiffLlama's: from_hf loads them).
OWN_PARAMETER_VARIANTS = {
    "lambda_q1": "differential attention (DiffLlama: two softmax maps of each head's halves subtracted, weighted by "
    "a lambda learned from lambda_q1, lambda_k1, lambda_q2, lambda_k2, then a norm)",
}


def own_variant(names: Any) -> str | None:
    """The variant a layer's own parameters name (`OWN_PARAMETER_VARIANTS`), or None."""
    return next((OWN_PARAMETER_VARIANTS[n] for n in names if n in OWN_PARAMETER_VARIANTS), None)


def _fused(layer: nn.Module) -> nn.Linear | None:
    """The layer's fused `[q; k; v]` projection (`query_key_value`, `c_attn`) where it has no `q_proj`, or None."""
    if isinstance(getattr(layer, "q_proj", None), nn.Module):
        return None
    return next((f for n in _FUSED_NAMES if isinstance(f := getattr(layer, n, None), nn.Linear)), None)


def _multi_query(layer: nn.Module) -> bool:
    """Falcon-7B's and GPTBigCode's `multi_query` (one key and value head); Falcon-40B's grouped layout apart."""
    config = getattr(layer, "config", None)
    return bool(getattr(config, "multi_query", False)) and not getattr(config, "new_decoder_architecture", False)


def per_head_fused(layer: nn.Module) -> nn.Linear | None:
    """GPT-NeoX's, Persimmon's, Falcon's and GPTBigCode's (without multi_query) fused projection, each head's rows
    `[q_h; k_h; v_h]` together, or None."""
    fused = _fused(layer)
    grouped = getattr(getattr(layer, "config", None), "new_decoder_architecture", False)
    return None if fused is None or _multi_query(layer) or grouped else fused


def grouped_fused(layer: nn.Module) -> nn.Linear | None:
    """Falcon-40B's `query_key_value` (`new_decoder_architecture`): for each KV head, its group's query heads' rows,
    then its key's, then its value's; or None."""
    fused = _fused(layer)
    config = getattr(layer, "config", None)
    return fused if fused is not None and getattr(config, "new_decoder_architecture", False) else None


def _split_grouped(layer: nn.Module, fused: nn.Linear, config: Any, head_dim: int) -> dict[str, Any]:
    """The q/k/v projections Falcon-40B's grouped `query_key_value` holds, as `(weight, bias)` pairs (copies)."""
    heads, kv_heads = config.num_attention_heads, config.num_kv_heads
    shape = ((heads + 2 * kv_heads) * head_dim, config.hidden_size)
    if heads % kv_heads or tuple(fused.weight.shape) != shape:
        why = f"the config's sizes make a grouped [q; k; v] of {shape}"
        raise _refuse("query_key_value.weight", tuple(fused.weight.shape), why)
    group = heads // kv_heads

    def parts(t: Tensor) -> list[Tensor]:
        rows = t.detach().unflatten(0, (kv_heads, group + 2, head_dim))
        return [rows[:, :group].flatten(0, 2), rows[:, group].flatten(0, 1), rows[:, group + 1].flatten(0, 1)]

    weights = parts(fused.weight)
    biases = (None,) * 3 if fused.bias is None else parts(fused.bias)
    names = ("q_proj", "k_proj", "v_proj")
    return {n: SimpleNamespace(weight=w, bias=b) for n, w, b in zip(names, weights, biases, strict=True)}


def stacked_fused(layer: nn.Module) -> nn.Linear | None:
    """Falcon-7B's `query_key_value` and GPTBigCode's `c_attn` under `multi_query`: every head's query rows, then
    the one key head's, then the one value head's; Phi-3's `qkv_proj` (no `mp_num`): every query head's rows, then
    every KV head's key rows, then their value rows; or None."""
    fused = _fused(layer)
    if fused is not None and _multi_query(layer):
        return fused
    held = getattr(layer, "qkv_proj", None)
    if isinstance(held, nn.Linear) and fused is None and block_fused(layer) is None:
        if not isinstance(getattr(layer, "q_proj", None), nn.Module):
            return held
    return None


def _split_stacked(layer: nn.Module, fused: nn.Linear, config: Any, head_dim: int) -> dict[str, Any]:
    """The q/k/v projections a stacked fused projection holds, `[q (num_heads * d_head); k (num_kv_heads * d_head);
    v (num_kv_heads * d_head)]` rows (one KV head under multi_query), as `(weight, bias)` pairs (views of it)."""
    kv = _kv_heads(config) * head_dim
    widths = [config.num_attention_heads * head_dim, kv, kv]
    if tuple(fused.weight.shape) != (sum(widths), config.hidden_size):
        kind = "multi-query" if _multi_query(layer) else "stacked"
        why = f"the config's sizes make a {kind} [q; k; v] of {(sum(widths), config.hidden_size)}"
        raise _refuse(f"{_stacked_name(layer)}.weight", tuple(fused.weight.shape), why)
    rows = fused.weight.detach().split(widths)
    biases = (None,) * 3 if fused.bias is None else fused.bias.detach().split(widths)
    names = ("q_proj", "k_proj", "v_proj")
    return {n: SimpleNamespace(weight=w, bias=b) for n, w, b in zip(names, rows, biases, strict=True)}


def chunked_fused(layer: nn.Module) -> nn.Linear | None:
    """MPT's `Wqkv` (`[q; k; v]`, each `num_heads * head_dim` rows, split by `chunk(3)`), or None."""
    if isinstance(getattr(layer, "q_proj", None), nn.Module):
        return None
    return next((f for n in _CHUNKED_NAMES if isinstance(f := getattr(layer, n, None), nn.Linear)), None)


def _split_chunked(fused: nn.Linear, config: Any, head_dim: int) -> dict[str, Any]:
    """The q/k/v projections MPT's `Wqkv` holds, as `(weight, bias)` pairs (views of it)."""
    width = config.num_attention_heads * head_dim
    if tuple(fused.weight.shape) != (3 * width, config.hidden_size):
        why = f"the config's sizes make [q; k; v] of {(3 * width, config.hidden_size)}"
        raise _refuse("Wqkv.weight", tuple(fused.weight.shape), why)
    rows = fused.weight.detach().split(width)
    biases = (None,) * 3 if fused.bias is None else fused.bias.detach().split(width)
    names = ("q_proj", "k_proj", "v_proj")
    return {n: SimpleNamespace(weight=w, bias=b) for n, w, b in zip(names, rows, biases, strict=True)}


def _kv_heads(config: Any) -> int:
    """The KV heads a config makes: Falcon's and GPTBigCode's multi_query 1 (else every head), Falcon-40B's
    num_kv_heads (its new_decoder_architecture), else num_key_value_heads (all heads where it is unset)."""
    if getattr(config, "new_decoder_architecture", False):
        return config.num_kv_heads
    if hasattr(config, "multi_query"):  # its field says it (GPTBigCode's num_key_value_heads is not one of its own)
        return 1 if config.multi_query else config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _fused_name(layer: nn.Module) -> str:
    return next(n for n in _FUSED_NAMES if isinstance(getattr(layer, n, None), nn.Linear))


def _stacked_name(layer: nn.Module) -> str:
    return next(n for n in (*_FUSED_NAMES, "qkv_proj") if isinstance(getattr(layer, n, None), nn.Linear))


def block_fused(layer: nn.Module) -> tuple[nn.Linear, int] | None:
    """CodeGen's `qkv_proj` and its number of blocks (`mp_num`), each block `[q_b; v_b; k_b]`, or None."""
    fused, blocks = getattr(layer, "qkv_proj", None), getattr(layer, "mp_num", None)
    if not isinstance(fused, nn.Linear) or isinstance(getattr(layer, "q_proj", None), nn.Module):
        return None
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        return None
    return fused, blocks


def _split_blocks(layer: nn.Module, fused: nn.Linear, blocks: int, config: Any) -> dict[str, Any]:
    """The q/k/v projections CodeGen's `qkv_proj` holds, as `(weight, bias)` pairs (views of it): its rows are
    `blocks` blocks, each `[q_b; v_b; k_b]` of `hidden_size / blocks` rows (the order its forward splits)."""
    hidden = config.hidden_size
    if hidden % blocks or tuple(fused.weight.shape) != (3 * hidden, hidden):
        why = f"CodeGen's layout is {blocks} blocks of [q; v; k] rows, {(3 * hidden, hidden)} in all"
        raise _refuse("qkv_proj.weight", tuple(fused.weight.shape), why)
    weight = fused.weight.detach().unflatten(0, (blocks, 3, hidden // blocks))
    bias = None if fused.bias is None else fused.bias.detach().unflatten(0, (blocks, 3, hidden // blocks))
    rows = {name: weight[:, i].flatten(0, 1) for i, name in enumerate(BLOCK_ORDER)}
    biases = {name: None if bias is None else bias[:, i].flatten(0, 1) for i, name in enumerate(BLOCK_ORDER)}
    return {name: SimpleNamespace(weight=rows[name], bias=biases[name]) for name in rows}


def _split_per_head(layer: nn.Module, fused: nn.Linear, config: Any, head_dim: int) -> dict[str, Any]:
    """The q/k/v projections a per-head fused `query_key_value` holds, as `(weight, bias)` pairs (views of it)."""
    heads = config.num_attention_heads
    if tuple(fused.weight.shape) != (3 * heads * head_dim, config.hidden_size):
        why = f"the config's sizes make a per-head fused [q; k; v] of {(3 * heads * head_dim, config.hidden_size)}"
        raise _refuse(f"{_fused_name(layer)}.weight", tuple(fused.weight.shape), why)
    weight = fused.weight.detach().unflatten(0, (heads, 3, head_dim))
    bias = None if fused.bias is None else fused.bias.detach().unflatten(0, (heads, 3, head_dim))
    rows = {name: weight[:, i].flatten(0, 1) for i, name in enumerate(("q_proj", "k_proj", "v_proj"))}
    biases = {name: None if bias is None else bias[:, i].flatten(0, 1) for i, name in enumerate(rows)}
    return {name: SimpleNamespace(weight=rows[name], bias=biases[name]) for name in rows}


def projection_names(layer: nn.Module) -> dict[str, str]:
    """Our projection's name -> the layer's (`o_proj` is Phi's `dense`)."""
    output = next((n for n in _OUTPUT_NAMES if isinstance(getattr(layer, n, None), nn.Linear)), "o_proj")
    return {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": output}


def _refuse_structure(attention: nn.Module, config: Any, d_head: int) -> None:
    """Refuse, by name, what the layer holds that a `MultiHeadAttention` would not load or compute."""
    own = [name for name, _ in attention.named_parameters(recurse=False) if name not in ("sinks", *K.LAMBDAS)]
    lambdas = [getattr(attention, name, None) for name in K.LAMBDAS]
    if any(isinstance(held, nn.Parameter) for held in lambdas):  # DiffLlama's: four vectors of a head's width
        shapes = [tuple(held.shape) if isinstance(held, Tensor) else None for held in lambdas]
        if any(shape != (d_head,) for shape in shapes):
            raise _refuse("lambdas", shapes, f"differential attention's lambdas are four vectors of ({d_head},)")
    sinks = getattr(attention, "sinks", None)
    if isinstance(sinks, nn.Parameter) and tuple(sinks.shape) != (config.num_attention_heads,):
        why = f"attention sinks are one logit per query head ({config.num_attention_heads},)"
        raise _refuse("sinks", tuple(sinks.shape), why)
    variant = own_variant(own)
    if variant is not None:
        raise _refuse("parameters", own, f"the layer computes {variant}, which MultiHeadAttention does not")
    if own:
        raise _refuse(
            "parameters", own, "the layer holds parameters of its own (attention sinks?) that are not loaded"
        )
    for name, child in attention.named_children():
        if name not in _LOADED and any(True for _ in child.parameters()):
            why = f"the layer holds a submodule with parameters ({type(child).__name__}) that is not loaded"
            raise _refuse(name, type(child).__name__, why)
    heads = config.num_attention_heads
    (q_name, k_name), _ = qk_norm_names(attention)
    every = {q_name: heads * d_head, k_name: (getattr(config, "num_key_value_heads", None) or heads) * d_head}
    over = _norm_over(getattr(attention, q_name, None), config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name in (q_name, k_name):
        norm = getattr(attention, name, None)
        weight = getattr(norm, "weight", None)
        shape = {"head": (d_head,), "all": (every[name],)}.get(over, (heads if name == q_name else kv_heads, d_head))
        if norm is not None and (not isinstance(weight, Tensor) or tuple(weight.shape) != shape):
            held = None if not isinstance(weight, Tensor) else tuple(weight.shape)
            why = (
                f"it normalises features {held}, neither each head's d_head={d_head}, every head's "
                f"together ({every[name]}) nor each head's with weights of its own, as q_norm does"
            )
            raise _refuse(name, type(norm).__name__, why)
    dropout = getattr(attention, "resid_dropout", None)  # GPT-J, CodeGen: a dropout of the layer's output
    if isinstance(dropout, nn.Dropout) and dropout.p > 0:
        raise _refuse("resid_pdrop", dropout.p, "a dropout of the layer's output (resid_dropout) is not computed here")
    hidden = getattr(attention, "hidden_dropout", None)  # Bloom: its output dropped out before the residual is added
    if isinstance(hidden, float) and hidden > 0:
        raise _refuse("config.hidden_dropout", hidden, "a dropout of the layer's output is not computed here")
    for field, what in _UNSUPPORTED_FIELDS.items():
        value = getattr(config, field, None)
        if value is not None and value is not False:
            raise _refuse(f"config.{field}", value, f"{what} is not computed here")


def _rotates(config: Any, index: int) -> bool:
    """Whether layer `index` applies RoPE where `config.no_rope_layers` says (SmolLM3, Llama 4: 1 rotates, 0 not);
    True where the config has no such list."""
    switches = getattr(config, "no_rope_layers", None)
    return not switches or index >= len(switches) or bool(switches[index])


def from_hf(cls: Any, attention: nn.Module, *, config: Any = None, verify: bool = True, nope: bool = False) -> Any:
    """Build `cls` (a `MultiHeadAttention`) computing what `attention`, a transformers layer, computes; `config` is
    its model's, for a layer that keeps none (Bloom's, MPT's). `nope`: without the config's RoPE (a layer seen to
    rotate nothing, `_ignores_positions`)."""
    config = getattr(attention, "config", None) if config is None else config
    if config is None:
        raise ConfigError(
            f"{_OWNER}: {type(attention).__name__} has no .config; pass a transformers attention layer, and for one "
            "that keeps no config (Bloom's, MPT's) its model's: from_hf(layer, config=model.config)."
        )
    if isinstance(getattr(attention, "kv_a_proj_with_mqa", None), nn.Linear):
        raise ConfigError(
            f"{_OWNER}: {type(attention).__name__} is multi-head latent attention (kv_a_proj_with_mqa); "
            "load it with shapesafe_mha.LatentAttention.from_hf(layer)."
        )
    names = projection_names(attention)
    projections: dict[str, Any] = {ours: getattr(attention, theirs, None) for ours, theirs in names.items()}
    head_dim = _head_dim(config)
    fused = per_head_fused(attention)
    if fused is not None:  # GPT-NeoX, Persimmon: every head has its own key and value (MHA)
        projections.update(_split_per_head(attention, fused, config, head_dim))
    blocks = block_fused(attention)
    if blocks is not None:  # CodeGen: blocks of [q; v; k] rows
        projections.update(_split_blocks(attention, *blocks, config))
    stacked = stacked_fused(attention)
    if stacked is not None:  # Falcon-7B, GPTBigCode (multi-query), Phi-3: the query rows, then the keys', the values'
        projections.update(_split_stacked(attention, stacked, config, head_dim))
    grouped = grouped_fused(attention)
    if grouped is not None:  # Falcon-40B: for each KV head, its group's query rows, then its key's and value's
        projections.update(_split_grouped(attention, grouped, config, head_dim))
    chunked = chunked_fused(attention)
    if chunked is not None:  # MPT: every head's query rows, then their keys', then their values'
        projections.update(_split_chunked(chunked, config, head_dim))
    missing = [names[name] for name, proj in projections.items() if not isinstance(proj, nn.Linear | SimpleNamespace)]
    if missing:
        raise ConfigError(
            f"{_OWNER}: {type(attention).__name__} has no nn.Linear {', '.join(missing)}; only the q/k/v/o_proj layout "
            "(Llama, Mistral, Qwen2; Phi's dense and GPT-J's out_proj as o_proj), GPT-NeoX's per-head query_key_value, "
            "Phi-3's stacked qkv_proj and CodeGen's qkv_proj in blocks are supported."
        )
    _refuse_structure(attention, config, head_dim)
    options = variant_options(attention, config)
    theta, scaling = rope_of(config, _layer_type(attention, config))
    if nope or not _rotates(config, getattr(attention, "layer_idx", 0) or 0):
        theta, scaling = None, None  # a NoPE layer (SmolLM3, Llama 4): the config's RoPE is its other layers'
    if theta is not None:
        options["rope_dim"], options["rope_interleaved"] = rope_layout_of(attention, config, head_dim)
    elif hasattr(config, "rotary_dim") and not nope:  # GPT-J, CodeGen: RoPE of their own tables, on rotary_dim features
        theta, options["rope_dim"], options["rope_interleaved"] = in_layer_rope(attention, config, head_dim)
    num_heads = config.num_attention_heads
    multi_head = fused is None and blocks is None and chunked is None
    num_kv_heads = _kv_heads(config) if multi_head or stacked is not None or grouped is not None else num_heads
    q_proj = projections["q_proj"]
    module = cls(
        config.hidden_size,
        num_heads,
        num_kv_heads,
        d_head=head_dim,
        bias=True,
        dropout=_attention_dropout(config),
        rope_theta=theta,
        rope_scaling=scaling,
        device=q_proj.weight.device,
        dtype=q_proj.weight.dtype,
        **options,
    )
    for name, theirs in projections.items():
        ours: Any = module._modules[name]
        if theirs.weight.shape != ours.weight.shape:
            raise _refuse(
                f"{name}.weight",
                tuple(theirs.weight.shape),
                f"the config's sizes make it {tuple(ours.weight.shape)} (hidden_size={config.hidden_size}, "
                f"num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads}, head_dim={head_dim})",
            )
    if module.qk_norm:
        load_norms(module, attention)
    with torch.no_grad():
        if module.sinks is not None:
            module.sinks.copy_(attention.sinks)
        for name in K.LAMBDAS if module.differential_lambda_init is not None else ():
            module._parameters[name].copy_(getattr(attention, name))
        if module.alibi_slopes is not None:  # the slopes its model passes (Bloom's, MPT's), not ours
            module.alibi_slopes.copy_(alibi_slopes_of(attention, config))  # pyright: ignore[reportArgumentType]
        for name, theirs in projections.items():
            ours = module._modules[name]
            ours.weight.copy_(theirs.weight)
            if theirs.bias is None:
                ours.register_parameter("bias", None)
            else:
                ours.bias.copy_(theirs.bias)
    module.train(attention.training)
    if verify:
        try:
            verify_against_hf(_OWNER, module, attention, config)
        except ConfigError:
            if theta is None or not _ignores_positions(attention, config):
                raise
            # The layer is seen to rotate nothing (Cohere2's full-attention layers apply no RoPE, whatever the
            # config's rope_theta): the same layer without RoPE, verified in turn.
            return from_hf(cls, attention, config=config, verify=True, nope=True)
    return module


def _ignores_positions(layer: nn.Module, config: Any) -> bool:
    """Whether `layer`'s causal forward is the same with every rotary position at 0: it applies no RoPE."""
    if not probe.probeable(layer):
        return False
    try:
        with probe.probing(layer) as probed:
            x = probe.probe_tokens(config.hidden_size, probe.device_of(layer), probe.dtype_of(probed))
            rotated = hf_outputs(probed, x, decode=False, config=config)
            unrotated = hf_outputs(probed, x, decode=False, unrotated=True, config=config)
        probe.verify("", rotated, unrotated, source="")
    except Exception:  # it differs, or cannot be run so: the refusal already made stands
        return False
    return True


def _modeling(layer: nn.Module) -> Any:
    """The transformers modeling module of `layer`'s class, or of the transformers class a user's subclass extends
    (its rotary class and `apply_rotary_pos_emb` live there, not beside the subclass)."""
    modules = [cls.__module__ for cls in type(layer).__mro__]
    return importlib.import_module(next((m for m in modules if m.startswith("transformers.")), modules[0]))


def _layer_type(layer: nn.Module, config: Any) -> str | None:
    types = getattr(config, "layer_types", None)
    index = getattr(layer, "layer_idx", 0) or 0
    return types[index] if types and index < len(types) else None


def _rotary_for(layer: nn.Module, config: Any) -> Any:
    """The model's own rotary class for `layer` (`LlamaRotaryEmbedding` beside `LlamaAttention`), built from config."""
    modeling = _modeling(layer)
    prefix = type(config).__name__.removesuffix("Config")
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding", None)
    if rotary_cls is None:
        named = [getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding")]
        rotary_cls = named[0] if len(named) == 1 else None
    if rotary_cls is None:
        return None
    return rotary_cls(config=config)


def hf_outputs(
    layer: nn.Module,
    x: Tensor,
    *,
    decode: bool = True,
    unrotated: bool = False,
    config: Any = None,
    shift: int = 0,
) -> probe.Outputs:
    """`layer` called as its model calls it (its rotary class, its mask function, a `DynamicCache`) on the probe.

    The causal forward is a prefill through the cache (so two calls in all), one rotary class serving both, as
    one serves a model's generation. A layer built alone has no attention implementation set, which its model
    would set: eager meanwhile, which is what the layer then runs. `unrotated`: cos/sin for position 0
    everywhere (the mask keeps the real positions); `shift`: cos/sin for positions from `shift` on. `config`: the
    model's, for a layer that keeps none (default `layer.config`). Bloom's layer is given its block's residual as
    0 (the attention alone; its output dropout, `hidden_dropout`, is refused where it is not 0) and the `alibi`
    its model builds with `build_alibi_tensor`; MPT's the `position_bias` of `build_mpt_alibi_tensor` and a bool
    mask, as MptModel passes them.
    """
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = layer.config if config is None else config
    unset = getattr(config, "_attn_implementation", None) is None
    if unset:
        config._attn_implementation = "eager"  # transformers' default for a model; unset again below
    try:
        return _hf_outputs(layer, config, x, decode, unrotated, shift, DynamicCache, create_causal_mask,
                           create_sliding_window_causal_mask)  # fmt: skip
    finally:
        if unset:
            config._attn_implementation = None


def _hf_outputs(
    layer: nn.Module,
    config: Any,
    x: Tensor,
    decode: bool,
    unrotated: bool,
    shift: int,
    cache_cls: Any,
    causal: Any,
    sliding: Any,
) -> probe.Outputs:
    create_causal_mask, create_sliding_window_causal_mask, DynamicCache = causal, sliding, cache_cls
    layer_type = _layer_type(layer, config)
    if layer_type is not None:
        sliding = layer_type == "sliding_attention"
    else:
        sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    if layer_type == "chunked_attention":  # Llama 4's, as its model masks it
        from transformers.masking_utils import create_chunked_causal_mask

        make_mask = create_chunked_causal_mask
    mask_parameters = inspect.signature(make_mask).parameters
    cache_word = "cache" if "cache" in mask_parameters else "past_key_values"
    parameters = inspect.signature(layer.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    layer_cache_word = next((w for w in _CACHE_WORDS if w in parameters), "past_key_values")
    rotary = _rotary_for(layer, config) if "position_embeddings" in parameters else None
    if rotary is not None:
        rotary = rotary.to(x.device)
    layer_idx = getattr(layer, "layer_idx", None)

    def call(chunk: Tensor, start: int, cache: Any) -> Tensor:
        positions = torch.arange(start, start + chunk.shape[1], device=x.device)[None]
        index = {"layer_idx": layer_idx} if "layer_idx" in mask_parameters and layer_idx is not None else {}
        mask = make_mask(config=config, inputs_embeds=chunk, attention_mask=None, position_ids=positions,
                         **{cache_word: cache}, **index)  # fmt: skip  (the cache layer this one writes)
        kwargs: dict[str, Any] = {"attention_mask": mask, layer_cache_word: cache}
        if rotary is not None:
            takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
            angles = positions * 0 if unrotated else positions + shift
            kwargs["position_embeddings"] = rotary(chunk, angles, *([layer_type] if takes_type else []))
        if takes_kwargs or "position_ids" in parameters:
            kwargs["position_ids"] = positions
        if "cache_position" in parameters:
            kwargs["cache_position"] = positions[0]
        if "residual" in parameters:  # Bloom adds its block's residual to the output: 0, the attention alone
            kwargs["residual"] = torch.zeros_like(chunk)
        bias_word = next((w for w in ("alibi", "position_bias") if w in parameters), None)
        if bias_word is not None:  # Bloom's, MPT's ALiBi as its model builds it; Falcon's None (its alibi refused)
            every = torch.ones(chunk.shape[0], start + chunk.shape[1], dtype=torch.long, device=x.device)
            kwargs[bias_word] = model_biases(layer, config, every.shape[1], every, chunk.dtype)
        if bias_word == "position_bias" and mask is not None:  # MptModel: create_causal_mask(...).to(torch.bool)
            kwargs["attention_mask"] = mask.to(torch.bool)
        out = layer(chunk, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    prompt, step = x[:, : probe.PROMPT].contiguous(), x[:, probe.PROMPT :].contiguous()
    with torch.no_grad():
        if not decode:
            return {probe.FORWARD: call(prompt, 0, None)}
        # a hybrid model's config may call this index another kind of layer: then a plain cache
        attention_layer = layer_type in (None, "full_attention", "sliding_attention", "chunked_attention")
        cache = DynamicCache(config=config) if attention_layer else DynamicCache()
        outputs = {probe.shifted(probe.FORWARD, shift): call(prompt, 0, cache)}
        outputs[probe.shifted(probe.DECODING, shift)] = call(step, probe.PROMPT, cache)
    return outputs


_CACHE_WORDS = ("cache", "past_key_values", "past_key_value", "layer_past")  # GPT-NeoX: layer_past


def _run_source(
    owner: str, layer: nn.Module, x: Tensor, config: Any, decode: bool = True, shift: int = 0
) -> probe.Outputs:
    try:
        return hf_outputs(layer, x, decode=decode, config=config, shift=shift)
    except Exception as error:
        raise ConfigError(
            f"{owner}: {type(layer).__name__} could not be run as its model runs it, to verify the conversion "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); pass verify=False "
            "to convert it unverified."
        ) from error


def verify_against_hf(owner: str, module: nn.Module, layer: nn.Module, config: Any = None) -> None:
    """Raise `ConfigError` unless `module` computes what the transformers `layer` computes, on the probe
    (`config`: its model's, default `layer.config`)."""
    if not (probe.probeable(module) and probe.probeable(layer)):
        return  # meta holds no values to compare
    config = layer.config if config is None else config
    with probe.probing(layer) as theirs_probed, probe.probing(module) as ours_probed:
        x = probe.probe_tokens(config.hidden_size, probe.device_of(layer), probe.dtype_of(theirs_probed))
        theirs = _run_source(owner, theirs_probed, x, config)
        windowed = getattr(ours_probed, "window", None) is not None  # a window cache is as long as its window
        ours = probe.our_outputs(ours_probed, x, cache=_plain_cache(ours_probed, x.shape[0]) if windowed else None)
        shift = _turning_shift(ours_probed)
        if shift:  # RoPE scaled by length: a prefill up to the length it turns at, and a decoding step past it
            theirs.update(_run_source(owner, theirs_probed, x, config, shift=shift))
            cache = _plain_cache(ours_probed, x.shape[0]) if windowed else None
            ours.update(probe.our_outputs(ours_probed, x, cache=cache, shift=shift))
        source = type(layer).__name__
        try:
            probe.verify(owner, ours, theirs, source=source)
        except ConfigError:
            suspects = _suspects(ours_probed, theirs_probed, x, config, ours, theirs)
            probe.verify(owner, ours, theirs, source=source, suspects=suspects)
            raise


def _turning_shift(module: Any) -> int:
    """Where a second probe starts its rotary positions so that its prefill ends at the length a RoPE scaled by
    length turns at (dynamic's `max_position_embeddings`, longrope's original one) and its decoding step passes it;
    0 where the module has no such RoPE, or the plain probe already reaches past it."""
    rotary = getattr(module, "rotary", None)
    context = getattr(rotary, "context", None)
    return context - probe.PROMPT if isinstance(context, int) and context > probe.PROMPT else 0


def _plain_cache(module: Any, batch: int) -> Any:
    """A cache that keeps every position (the module's own would be as long as its window)."""
    weight = module.k_proj.weight
    capacity = probe.PROMPT + 1
    return KVCache(batch, module.num_kv_heads, capacity, module.d_head, dtype=weight.dtype, device=weight.device)


def _suspects(
    ours: Any, theirs: nn.Module, x: Tensor, config: Any, our_outputs: probe.Outputs, their_outputs: probe.Outputs
) -> list[str]:
    """What a difference comes from, where a second probe tells: the decoding step alone, if the causal forward
    agrees (no evidence about RoPE then: the unrotated probe is a forward); else RoPE, if both agree with nothing
    rotated."""
    forward = {what: out for what, out in their_outputs.items() if what.startswith(probe.FORWARD)}
    try:
        probe.verify("", our_outputs, forward, source="")
    except ConfigError:
        pass
    else:
        window = getattr(ours, "window", None)
        detail = (
            f": with sliding_window=1, {type(theirs).__name__}'s decoding step attends to more than the query's own "
            "key, which its forward keeps to"
            if window == 1
            else ""
        )
        return [f"the decoding step alone (the causal forward agrees){detail}"]
    if getattr(ours, "rotary", None) is None:
        return []
    try:
        probe.verify("", probe.our_outputs(ours, x, decode=False, unrotated=True),
                     hf_outputs(theirs, x, decode=False, unrotated=True, config=config), source="")  # fmt: skip
    except ConfigError:
        return []
    return [
        f"the rotary embeddings (with every position at 0, {type(theirs).__name__} agrees: interleaved pairs, "
        "partial rotary or another RoPE scaling)"
    ]


def to_hf(module: Any, config: Any, *, verify: bool = True) -> nn.Module:
    """The transformers attention layer of `config`'s model type, holding `module`'s weights."""
    if not isinstance(getattr(config, "model_type", None), str):
        raise ConfigError(
            f"MultiHeadAttention.to_hf(): config must be a transformers model config (LlamaConfig(...), "
            f"AutoConfig.from_pretrained(name)), but got {type(config).__name__}."
        )
    kind = type(config).__name__.removesuffix("Config")
    try:  # the modeling module beside the config's (Gemma3TextConfig's is gemma3's, with Gemma3Attention)
        modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        named = getattr(modeling, f"{kind}Attention", None)
        layer_cls = named or getattr(modeling, f"{kind.removesuffix('Text')}Attention")
    except (ImportError, AttributeError):
        raise ConfigError(
            f"MultiHeadAttention.to_hf(): no transformers attention class for model_type={config.model_type!r}."
        ) from None
    first_type = (getattr(config, "layer_types", None) or [None])[0]  # to_hf builds layer 0
    theta, scaling = rope_of(config, first_type)
    if not _rotates(config, 0):
        theta, scaling = None, None  # layer 0 is a NoPE layer (no_rope_layers)
    in_layer = None  # GPT-J, CodeGen: (theta, rope_dim, interleaved) of the layer's own tables
    if theta is None and hasattr(config, "rotary_dim"):
        try:
            in_layer = in_layer_rope(layer_cls(config, layer_idx=0), config, _head_dim(config))
        except ConfigError as error:
            raise ConfigError(str(error).replace(_OWNER, "MultiHeadAttention.to_hf()", 1)) from None
        theta = in_layer[0]
    wanted = {
        "hidden_size": module.d_model,
        "num_attention_heads": module.num_heads,
        "num_key_value_heads": module.num_kv_heads,
        "head_dim": module.d_head,
        "rope_theta": module.rope_theta,
        "rope_parameters (scaling)": None if module.rotary is None else _scaling(module.rotary.scaling),
        "partial rotary (rope_dim)": None if module.rope_dim == module.d_head else module.rope_dim,
        "attention_dropout": float(module.dropout),
    }
    found = {k: getattr(config, k, None) for k in wanted}
    found.update(
        num_key_value_heads=_kv_heads(config),
        head_dim=_head_dim(config),
        rope_theta=theta,
        attention_dropout=_attention_dropout(config),
    )
    found["rope_parameters (scaling)"] = _scaling(scaling) if module.rotary is not None else None
    partial = rope_dim_of(config, _head_dim(config), first_type) if theta is not None else None
    found["partial rotary (rope_dim)"] = in_layer[1] if in_layer is not None else partial
    different = {k: (found[k], v) for k, v in wanted.items() if found[k] != v}
    if different:
        listed = ", ".join(f"{k}={theirs!r} (module: {ours!r})" for k, (theirs, ours) in different.items())
        raise ConfigError(f"MultiHeadAttention.to_hf(): the config does not describe this module: {listed}.")
    weight = module.q_proj.weight
    theirs = layer_cls(config, layer_idx=0).to(device=weight.device, dtype=weight.dtype)
    options = variant_options(theirs, config)
    if theta is not None:
        pairs = in_layer[2] if in_layer is not None else rope_layout_of(theirs, config, _head_dim(config))[1]
        options["rope_interleaved"] = pairs or None
    ours = {
        "rope_interleaved": module.rope_interleaved or None,
        "window": module.window,
        "qk_norm": module.qk_norm or None,
        "qk_norm_over": module.qk_norm_over if module.qk_norm else None,
        "qk_norm_centred": module.qk_norm_centred or None,
        "qk_norm_offset": module.qk_norm_offset if module.qk_norm else None,
        "qk_norm_after_rope": module.qk_norm_after_rope or None,
        "logit_softcap": module.logit_softcap,
        "query_pre_attn_scalar": module.query_pre_attn_scalar,
        "clip_qkv": module.clip_qkv,
        "attention_sinks": module.sinks is not None or None,
        "alibi": module.alibi_slopes is not None or None,
        "output_gate": module.output_gate or None,
        "temperature_tuning": module.temperature_tuning,
        "chunk_size": module.chunk_size,
        "differential_lambda_init": module.differential_lambda_init,
    }
    if module.differential_lambda_init is not None and not module.qk_norm:  # norm_eps is its norm's
        ours["norm_eps"] = module.norm_eps
    different = {k: (options.get(k), v) for k, v in ours.items() if options.get(k) != v}
    if different:
        listed = ", ".join(f"{k}={theirs_!r} (module: {mine!r})" for k, (theirs_, mine) in different.items())
        raise ConfigError(f"MultiHeadAttention.to_hf(): the config's layer 0 computes another variant: {listed}.")
    with torch.no_grad():
        if module.qk_norm and isinstance(getattr(theirs, SHARED_QK_NORM, None), nn.Module):
            for name in ("q_norm", "k_norm"):  # Llama 4's qk_norm holds no weight: ours must be ones
                if not torch.all(module._modules[name].weight == 1):
                    raise ConfigError(
                        f"MultiHeadAttention.to_hf(): {name}'s weights are not all 1, but {layer_cls.__name__}'s "
                        f"{SHARED_QK_NORM} holds no weight (an L2 norm); it cannot hold this module."
                    )
        elif module.qk_norm:
            for name, their_name in zip(("q_norm", "k_norm"), qk_norm_names(theirs)[0], strict=True):
                getattr(theirs, their_name).weight.copy_(module._modules[name].weight)
        if module.sinks is not None:
            theirs.sinks.copy_(module.sinks)
        for name in K.LAMBDAS if module.differential_lambda_init is not None else ():
            getattr(theirs, name).copy_(module._parameters[name])
        if module.alibi_slopes is not None:  # the layer holds none: its model passes them, and they must be ours
            given = alibi_slopes_of(theirs, config)
            if given is None or not torch.allclose(given.to(module.alibi_slopes), module.alibi_slopes):
                raise ConfigError(
                    f"MultiHeadAttention.to_hf(): alibi_slopes are {module.alibi_slopes.tolist()} here, but "
                    f"{layer_cls.__name__}'s model passes it {None if given is None else given.tolist()}; it cannot "
                    "hold this module."
                )
        fused, blocks = per_head_fused(theirs), block_fused(theirs)
        chunked = chunked_fused(theirs)
        if chunked is not None:
            _write_stacked(module, chunked, layer_cls.__name__)
        stacked, grouped = stacked_fused(theirs), grouped_fused(theirs)
        if fused is not None:
            _write_per_head(module, fused, layer_cls.__name__)
        if blocks is not None:
            _write_blocks(module, *blocks, layer_cls.__name__)
        if stacked is not None:
            _write_stacked(module, stacked, layer_cls.__name__)
        if grouped is not None:
            _write_grouped(module, grouped, layer_cls.__name__)
        held = (fused, blocks, stacked, grouped, chunked)
        for name, their_name in projection_names(theirs).items():
            if any(f is not None for f in held) and name != "o_proj":
                continue
            mine: Any = module._modules[name]
            other = getattr(theirs, their_name)
            if (mine.bias is None) != (other.bias is None):
                raise ConfigError(
                    f"MultiHeadAttention.to_hf(): {name} has bias={mine.bias is not None} here but "
                    f"{other.bias is not None} in {layer_cls.__name__} (config.attention_bias?)."
                )
            other.weight.copy_(mine.weight)
            if mine.bias is not None:
                other.bias.copy_(mine.bias)
    theirs.train(module.training)
    if verify:
        verify_against_hf("MultiHeadAttention.to_hf()", module, theirs, config)
    return theirs


def _same_biases(projections: list[Any], fused: nn.Linear, layer_name: str, fused_name: str) -> None:
    if len({p.bias is None for p in projections} | {fused.bias is None}) > 1:
        raise ConfigError(
            f"MultiHeadAttention.to_hf(): q/k/v_proj have biases {[p.bias is not None for p in projections]} here, "
            f"but {layer_name}'s {fused_name} has bias={fused.bias is not None} (config.attention_bias?)."
        )


def _write_blocks(module: Any, fused: nn.Linear, blocks: int, layer_name: str) -> None:
    """Our q/k/v projections into CodeGen's `qkv_proj`: `blocks` blocks of rows, each `[q_b; v_b; k_b]`."""
    projections = [module._modules[name] for name in BLOCK_ORDER]
    _same_biases(projections, fused, layer_name, "qkv_proj")
    fused.weight.copy_(torch.stack([p.weight.unflatten(0, (blocks, -1)) for p in projections], 1).flatten(0, 2))
    if fused.bias is not None:
        fused.bias.copy_(torch.stack([p.bias.unflatten(0, (blocks, -1)) for p in projections], 1).flatten(0, 2))


def _write_stacked(module: Any, fused: nn.Linear, layer_name: str) -> None:
    """Our q/k/v projections into a multi-query fused projection: the query rows, then the key's, then the value's."""
    projections = [module._modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    _same_biases(projections, fused, layer_name, "the fused projection")
    fused.weight.copy_(torch.cat([p.weight for p in projections]))
    if fused.bias is not None:
        fused.bias.copy_(torch.cat([p.bias for p in projections]))


def _write_grouped(module: Any, fused: nn.Linear, layer_name: str) -> None:
    """Our q/k/v projections into Falcon-40B's grouped `query_key_value`: for each KV head, its group's query
    rows, then its key's and its value's."""
    projections = [module._modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    _same_biases(projections, fused, layer_name, "query_key_value")
    kv, group, d = module.num_kv_heads, module.group, module.d_head

    def rows(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        parts = [q.unflatten(0, (kv, group, d)), k.unflatten(0, (kv, 1, d)), v.unflatten(0, (kv, 1, d))]
        return torch.cat(parts, dim=1).flatten(0, 2)

    fused.weight.copy_(rows(*(p.weight for p in projections)))
    if fused.bias is not None:
        fused.bias.copy_(rows(*(p.bias for p in projections)))


def _write_per_head(module: Any, fused: nn.Linear, layer_name: str) -> None:
    """Our q/k/v projections into a per-head fused `query_key_value`, each head's rows `[q_h; k_h; v_h]`."""
    projections = [module._modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    _same_biases(projections, fused, layer_name, "query_key_value")
    heads, d_head = module.num_heads, module.d_head
    fused.weight.copy_(torch.stack([p.weight.unflatten(0, (heads, d_head)) for p in projections], 1).flatten(0, 2))
    if fused.bias is not None:
        fused.bias.copy_(torch.stack([p.bias.unflatten(0, (heads, d_head)) for p in projections], 1).flatten(0, 2))


def _scaling(parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    """RoPE scaling parameters as compared: the theta apart (compared on its own)."""
    return None if parameters is None else {k: v for k, v in parameters.items() if k != "rope_theta"}


def latent_from_hf(cls: Any, attention: nn.Module, *, verify: bool = True) -> Any:
    """Build `cls` (a `LatentAttention`) computing what `attention` (DeepseekV3Attention or alike) computes."""
    owner = "LatentAttention.from_hf()"
    config = getattr(attention, "config", None)
    if config is None or not isinstance(getattr(attention, "kv_a_proj_with_mqa", None), nn.Linear):
        raise ConfigError(
            f"{owner}: {type(attention).__name__} is not a multi-head latent attention layer (no .config and "
            "kv_a_proj_with_mqa); for q/k/v/o_proj layers use MultiHeadAttention.from_hf."
        )
    try:
        theta, scaling = rope_of(config)
    except ConfigError as error:
        raise ConfigError(str(error).replace(_OWNER, owner, 1)) from None
    theta = 10000.0 if theta is None else theta
    d_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    expected = d_head**-0.5
    if scaling is not None and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])  # DeepSeek-V3: the scale times yarn_get_mscale(factor, mscale_all_dim)**2
        expected *= (0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    num_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", num_heads) or num_heads
    if kv_heads != num_heads:  # transformers' layer repeats the rebuilt K/V; MLA has every head's own
        raise ConfigError(
            f"{owner}: num_key_value_heads={kv_heads} != num_attention_heads={num_heads}: latent attention "
            "rebuilds a key and a value for every head; this layer would compute something else, so it is refused."
        )
    norm = attention.kv_a_layernorm
    projection: Any = attention.kv_a_proj_with_mqa
    weight = projection.weight
    module = cls(
        config.hidden_size,
        num_heads,
        kv_lora_rank=config.kv_lora_rank,
        d_nope=config.qk_nope_head_dim,
        d_rope=config.qk_rope_head_dim,
        d_value=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        bias=bool(getattr(config, "attention_bias", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        scale=expected,
        interleaved=bool(getattr(config, "rope_interleave", False)),
        norm_eps=_norm_eps(norm, owner),
        dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        device=weight.device,
        dtype=weight.dtype,
    )
    held = getattr(attention, "scaling", module.scale)
    if abs(held - module.scale) > 1e-12 * module.scale:
        why = f"the config makes it {module.scale:g} (1/sqrt(qk_head_dim), YaRN's mscale_all_dim squared)"
        raise _refuse("scaling", held, why, owner)
    theirs = attention.state_dict()
    shapes = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    for name, tensor in theirs.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            why = (
                f"the config makes it {shapes[name]} (hidden_size={config.hidden_size}, num_attention_heads="
                f"{num_heads}, kv_lora_rank={config.kv_lora_rank}, q_lora_rank={config.q_lora_rank}, "
                f"qk_nope_head_dim={config.qk_nope_head_dim}, qk_rope_head_dim={config.qk_rope_head_dim}, "
                f"v_head_dim={config.v_head_dim})"
            )
            raise _refuse(f"{name}.shape", tuple(tensor.shape), why, owner)
    missing, unexpected = module.load_state_dict(theirs, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{owner}: {type(attention).__name__}'s parameters do not match the layout: missing {missing}, "
            f"unexpected {unexpected}."
        )
    module.train(attention.training)
    if verify:
        if hasattr(config, "rope_interleave"):
            verify_against_hf(owner, module, attention)
        else:  # no field says how RoPE pairs features (DeepSeek-V2 interleaves): the probe shows it
            try:
                verify_against_hf(owner, module, attention)
            except ConfigError:  # (built again: a built module's pairing is fixed, as its caches' keys are)
                pairs = cls.from_config(
                    dataclasses.replace(module.config, interleaved=True), device=weight.device, dtype=weight.dtype
                )
                pairs.load_state_dict(module.state_dict())
                module = pairs.train(attention.training)
                verify_against_hf(owner, module, attention)
    return module
