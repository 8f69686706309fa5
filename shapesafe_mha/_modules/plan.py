"""What a `MultiHeadAttention` runs, chosen once from its `AttentionConfig` and composed by `run`.

`run`: project -> transforms before the split -> split -> transforms after it -> cache -> masks -> scorer ->
merge -> gate -> o_proj. The head transforms (equinox's `process_heads`, as a tuple) are built by `plan` from the
options: before the split those that see every head's features together (a QK-norm over all heads, OLMo-2;
`clip_qkv`), after it each head's (QK-norm, RoPE or partial RoPE, a QK-norm after RoPE, Llama 4's temperature
tuning). Differential attention (DiffLlama) scores twice, once for each half of the values, and subtracts the
maps' outputs in head pairs (`_differential`). A variant is one field of the config, its transform or scorer option
here, its reader, the reference.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.fastpath import FUSED, NATIVE, FusedQKV
from .._compute.norms import HeadNorm, OffsetRMSNorm
from .._compute.rotary import (
    RotaryEmbedding,
    apply_partial_rotary,
    apply_rotary,
    check_rotary_width,
    default_positions,
    partial_rotary_tables,
    rotary_tables,
)
from .._compute.scorer import score
from .._compute.stages import FORWARD_STAGES
from .._core.contract import raw
from .._core.errors import ConfigError

# The stages a plan runs, by the names it calls them; RAW: their functions, what a remembered forward runs.
STAGES = FORWARD_STAGES | {
    "rotary_tables": rotary_tables,
    "apply_rotary": apply_rotary,
    "partial_rotary_tables": partial_rotary_tables,
    "apply_partial_rotary": apply_partial_rotary,
}
RAW = raw(**STAGES)

# (stages, submodules, q, k, v) -> (q, k, v): on the projections, every head's features together
BeforeSplit = Callable[[Any, dict[str, Any], Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
# (stages, submodules, q, k, positions, start) -> (q, k): on the heads; `start`, the cache index of the first query
AfterSplit = Callable[[Any, dict[str, Any], Tensor, Tensor, Any, int], tuple[Tensor, Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The forward of one configuration: its head transforms and what the scorer is given. (Slots: a field read
    on every call is the interpreter's cheapest attribute read.)"""

    gated: bool  # Qwen3-Next: q_proj gives each head its queries and its gate
    before_split: tuple[BeforeSplit, ...]
    after_split: tuple[AfterSplit, ...]
    positions: bool  # the transforms rotate by positions (RoPE)
    one_start: bool  # a transform reads `start` as one cache index for the batch: sequences at others run apart
    chunk_size: int | None
    window: int | None
    softcap: float | None
    differential: tuple[float, float] | None  # DiffLlama's (lambda_init, the norm's eps)


def plan(config: Any) -> Plan:
    """The plan of `config` (an `AttentionConfig`)."""
    every = config.qk_norm and config.qk_norm_over == "all"
    before: list[BeforeSplit] = []
    if every:  # the statistic of every head's features together, before they are split
        before.append(_normalize_all)
    if config.clip_qkv is not None:
        before.append(_clipper(float(config.clip_qkv)))
    after: list[AfterSplit] = []
    if config.qk_norm and not every and not config.qk_norm_after_rope:
        after.append(_normalize_heads)
    if config.rope_theta is not None:
        partial = config.rope_dim is not None and config.rope_dim != config.head_width
        after.append(_rotator(partial, config.rope_interleaved))
    if config.qk_norm_after_rope:  # HunYuan: the rotated queries and keys normalised, and so cached
        after.append(_normalize_heads)
    if config.temperature_tuning is not None:  # Llama 4's NoPE layers: each query scaled by its cache index
        after.append(_tuner(*config.temperature_tuning))
    return Plan(
        config.output_gate,
        tuple(before),
        tuple(after),
        config.rope_theta is not None,
        config.temperature_tuning is not None,  # (`_tuner`: each query's scale from `start` and its offset)
        config.chunk_size,
        config.window,
        config.logit_softcap,
        None if config.differential_lambda_init is None else (config.differential_lambda_init, config.norm_eps),
    )


def _normalize_all(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k = s.normalize_qk_inner(m["q_norm"], m["k_norm"], q, k)
    return q, k, v


# The transforms that take an option are partials of module-level functions, not closures: a plan pickles (with
# the module that holds it: `torch.save`, `copy.deepcopy`).
def _clip(bound: float, s: Any, m: dict[str, Any], q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return s.clip_projections(q, k, v, bound)


def _clipper(bound: float) -> BeforeSplit:
    return functools.partial(_clip, bound)


def _normalize_heads(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
    return s.normalize_qk(m["q_norm"], m["k_norm"], q, k)


def _rotate_part(interleaved: bool, s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
    cos, sin = s.partial_rotary_tables(m["rotary"], positions, q)  # the first rope_dim features only
    return s.apply_partial_rotary(q, k, cos, sin, interleaved)


def _rotate(interleaved: bool, s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
    cos, sin = s.rotary_tables(m["rotary"], positions, q)
    return s.apply_rotary(q, k, cos, sin, interleaved)


def _rotator(partial: bool, interleaved: bool) -> AfterSplit:
    return functools.partial(_rotate_part if partial else _rotate, interleaved)


def _tune(scales: tuple[int, float], s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, at: int) -> Any:
    return s.tune_query_temperature(q, at, *scales), k


def _tuner(floor_scale: int, attn_scale: float) -> AfterSplit:
    return functools.partial(_tune, (floor_scale, attn_scale))


def _differential(
    s: Any,
    parameters: dict[str, Any],
    lambda_init_eps: tuple[float, float],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scoring: tuple[Any, ...],
    need_weights: bool,
) -> tuple[Tensor, Tensor | None, None]:
    """Differential attention (DiffLlama): the scorer run on each half of the values (each head's probabilities
    the same twice; the first run's are the weights asked for), the outputs of heads `p` and `p + num_heads/2`
    subtracted and normalised."""
    first_v, second_v = s.differential_values(v)
    first, weights, _ = score(s, q, k, first_v, *scoring, need_weights=need_weights)
    second, _, _ = score(s, q, k, second_v, *scoring)
    lambdas = [parameters[name] for name in K.LAMBDAS]
    return s.differential_heads(first, second, *lambdas, *lambda_init_eps), weights, None


def run(
    module: Any,
    s: Any,
    path: str,
    fused: FusedQKV | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    need_weights: bool,
    kv_cache: Any,
    positions: Tensor | None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The forward of `module` by its plan, stage by stage: `s` holds the stages, checked (a session's) or plain.
    (`MultiHeadAttention._run` is this function itself: one call fewer on every call.)"""
    p: Plan = module.__dict__["_plan"]
    num_heads, num_kv_heads = module.num_heads, module.num_kv_heads
    m = module._modules  # plain dict lookups: nn.Module.__getattr__ costs a microsecond each
    if path is NATIVE and fused is not None:
        out = m["o_proj"]._parameters
        return s.native_attention(query, fused.weight, fused.bias, out["weight"], out["bias"], num_heads)
    gate = None
    before = p.before_split
    split = False  # whether q, k and v are heads already
    if p.gated:
        q, gate = s.split_gated_query(s.project_gated_query(m["q_proj"], query), num_heads)
        k, v = s.project_key(m["k_proj"], key), s.project_value(m["v_proj"], value)
    elif path is FUSED and fused is not None:
        qkv = s.project_qkv(query, fused.weight, fused.bias)
        if before:
            d_head = module.d_head
            q, k, v = s.unfuse(qkv, num_heads * d_head, num_kv_heads * d_head)
        else:  # three views, the same as unfusing and then splitting each (four fewer calls)
            q, k, v = s.split_fused(qkv, num_heads, num_kv_heads)
            split = True
    else:
        q = s.project_query(m["q_proj"], query)
        k, v = s.project_key(m["k_proj"], key), s.project_value(m["v_proj"], value)
    for transform in before:
        q, k, v = transform(s, m, q, k, v)
    if not split:
        if gate is None:
            q = s.split_query(q, num_heads)
        k, v = s.split_key(k, num_kv_heads), s.split_value(v, num_kv_heads)
    start = 0 if kv_cache is None else kv_cache._start + kv_cache._length  # (`seen`, without a property call)
    if p.positions and positions is None:
        positions = default_positions(query, start)
    for transform in p.after_split:
        q, k = transform(s, m, q, k, positions, start)
    if kv_cache is None:
        k, v = s.attend_to_new(k, v)
    else:
        k, v = s.append_to_cache(kv_cache, kv_cache.keys_buffer, k, v)
        masked = attn_mask is not None or key_padding_mask is not None
        if masked and kv_cache._window is not None and kv_cache.seen != k.shape[2]:  # positions were dropped
            attn_mask, key_padding_mask = s.visible_masks(attn_mask, key_padding_mask, kv_cache.seen, k.shape[2])
    if p.chunk_size is not None:  # Llama 4: a query sees only the keys of its own chunk
        attn_mask = s.chunk_masks(q, k, attn_mask, key_padding_mask, p.chunk_size)
    dropout_p = module.dropout if module.training else 0.0
    own = module.__dict__
    sinks, slopes = own["_parameters"].get("sinks"), own["_buffers"].get("alibi_slopes")
    scale, window, softcap = own["scale"], p.window, p.softcap
    if p.differential is None:  # (positional arguments: this runs on every call)
        out, weights, merged = score(
            s, q, k, v, attn_mask, key_padding_mask, is_causal, window, scale, dropout_p, softcap, sinks, slopes,
            need_weights, True,
        )  # fmt: skip
    else:
        scoring = (attn_mask, key_padding_mask, is_causal, window, scale, dropout_p, softcap, sinks, slopes)
        out, weights, merged = _differential(s, own["_parameters"], p.differential, q, k, v, scoring, need_weights)
    if merged is None:  # one query a head (decoding): the heads merge by one reshape, no transpose
        merged = s.merge_one_query_heads(out) if q.shape[2] == 1 else s.merge(out)
    if gate is not None:
        merged = s.gate_output(merged, gate)
    out = s.project_output(m["o_proj"], merged)
    return out if weights is None else (out, weights)


# The parts a config builds: a module's submodules, parameters and buffers for its options (the stages take plain
# arguments; this is where the config is read for them).
def rotary_of(config: Any, device: Any) -> "RotaryEmbedding | None":
    """The rotary embedding `config` (an `AttentionConfig`) describes, on `device`: None without RoPE."""
    if config.rope_theta is None:
        return None
    width = config.rotated_width
    if width == config.head_width:
        check_rotary_width(width, config.owner)
    return RotaryEmbedding(width, config.rope_theta, config.rope_scaling, config.rope_interleaved).to(device=device)


def qk_norm_modules(config: Any, factory: dict[str, Any]) -> dict[str, nn.Module]:
    """The submodules of `config`'s QK-norm (an `AttentionConfig`), by name: `q_norm` and `k_norm`, or none."""
    return dict(zip(("q_norm", "k_norm"), qk_norms(config, factory), strict=True)) if config.qk_norm else {}


def qk_norms(config: Any, factory: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """The query's and the key's norm of a QK-norm `config` (an `AttentionConfig` with `qk_norm`): an RMSNorm of
    each head (Qwen3), of every head together (`qk_norm_over="all"`, OLMo-2), scaled by `offset + weight`
    (Gemma 3), or a `HeadNorm` with weights of each head or centred (Cohere)."""
    num_heads, num_kv_heads, d_head, eps = config.num_heads, config.kv_heads, config.head_width, config.norm_eps
    over, centred, offset = config.qk_norm_over, config.qk_norm_centred, float(config.qk_norm_offset)
    if over == "per_head" or centred:
        heads = (num_heads, num_kv_heads) if over == "per_head" else (None, None)
        return tuple(HeadNorm(h, d_head, eps, centred, **factory) for h in heads)  # pyright: ignore[reportReturnType]
    widths = (num_heads * d_head, num_kv_heads * d_head) if over == "all" else (d_head, d_head)
    if offset:
        return OffsetRMSNorm(widths[0], eps, offset, **factory), OffsetRMSNorm(widths[1], eps, offset, **factory)
    return nn.RMSNorm(widths[0], eps=eps, **factory), nn.RMSNorm(widths[1], eps=eps, **factory)


def variant_tensors(config: Any, factory: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters and buffers the options of `config` (an `AttentionConfig`) add, by name: attention sinks'
    `sinks` (zeros at first; None without), DiffLlama's four lambda vectors (normal(0, `LAMBDA_STD`); none
    without), and ALiBi's `alibi_slopes` (None without; not learned: a buffer, kept in the state dict so that loaded
    slopes, MPT's, stay)."""
    heads, d_head, dtype = config.num_heads, config.head_width, factory["dtype"] or torch.get_default_dtype()
    sinks = nn.Parameter(torch.zeros(heads, **factory)) if config.attention_sinks else None
    parameters: dict[str, Any] = {"sinks": sinks}
    for name in K.LAMBDAS if config.differential_lambda_init is not None else ():  # DiffLlama's, named as its are
        parameters[name] = nn.Parameter(torch.empty(d_head, **factory).normal_(0, K.LAMBDA_STD))
    slopes = K.alibi_slopes(heads).to(device=factory["device"], dtype=dtype) if config.alibi else None
    return parameters, {"alibi_slopes": slopes}


PARTS = ("rotary", "q_norm", "k_norm")  # the submodules the options build (`rotary_of`, `qk_norm_modules`)
TENSORS = ("sinks", "alibi_slopes", *K.LAMBDAS)  # and the tensors (`variant_tensors`)
_BUILT_KINDS = (RotaryEmbedding, nn.RMSNorm, OffsetRMSNorm, HeadNorm)  # the kinds of part they build


def part_misfit(config: Any, name: str, value: Any) -> str | None:
    """Why `value`, set as the submodule `name` (one of `PARTS`) of a module `config` describes, would not compute what
    the part `config` builds computes (so that the module's `config` would misdescribe it), or None where it does: a
    part where the config builds none or none where it builds one, or a part of the kind it builds made with other
    values. A part of another kind (the user's own tables or norm) is the user's: its results are checked each call."""
    if name == "rotary":
        built: Any = rotary_of(config, "meta")
        fields = ("d_head", "theta", "scaling", "interleaved")
    else:
        built = qk_norm_modules(config, {"device": "meta", "dtype": None}).get(name)
        fields = ("eps", "offset", "centred")
    return misfit(built, value, name, fields, config.variants() or "plain")


class Guarded(nn.Module):
    """The routes around `__setattr__` that `nn.Module` offers, taken through it on a built module: `add_module`
    (and `register_module`) of a part or an option's name is checked as setting it is, and `del` of one is refused
    (the part would be gone while the config still describes it). A subclass names what it guards (`_GUARDED`) and
    the attribute its construction sets last (`_BUILT`)."""

    _GUARDED: frozenset[str] = frozenset()
    _BUILT = ""

    def add_module(self, name: str, module: nn.Module | None) -> None:
        if name in self._GUARDED and self._BUILT in self.__dict__:
            setattr(self, name, module)  # the same checks, and what follows a part replaced
        else:
            super().add_module(name, module)

    def __delattr__(self, name: str) -> None:
        if name in self._GUARDED and self._BUILT in self.__dict__:
            kind = type(self).__name__
            raise ConfigError(
                f"{kind}: {name} cannot be deleted from a built module: its config describes it. Build the module "
                f"you want: {kind}.from_config(dataclasses.replace(module.config, ...)), then load its state_dict."
            )
        super().__delattr__(name)


def misfit(built: Any, value: Any, name: str, fields: tuple[str, ...], described: Any) -> str | None:
    """Why `value` does not compute what `built` (the part its config builds, or None) computes: presence, or a field
    of the same kind of part (and the weight's shape); None where it does, or where it is another kind (the user's)."""
    if built is None or value is None:
        if built is value:
            return None
        return f"the module has {'no' if built is None else 'a'} {name} (its config: {described})"
    if not isinstance(value, type(built)):
        if isinstance(value, _BUILT_KINDS):  # a kind a config builds, but another than this config's (its offset)
            return f"it is a {type(value).__name__}, where the config builds a {type(built).__name__}"
        return None  # a part of the user's own (tables, a norm): what it returns is checked at each call
    for field in fields:
        if getattr(value, field, None) != getattr(built, field, None):
            return f"its {field} is {getattr(value, field, None)!r}, the config's {getattr(built, field, None)!r}"
    weight = getattr(built, "weight", None)
    if weight is not None and tuple(getattr(value, "weight", weight).shape) != tuple(weight.shape):
        return (
            f"its weight is {tuple(value.weight.shape)}, the config's {tuple(weight.shape)} (pruning heads? set the "
            "sizes first, num_heads and num_kv_heads, then parts of the new sizes)"
        )
    return None
