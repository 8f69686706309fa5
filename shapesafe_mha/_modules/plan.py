"""What a `MultiHeadAttention` runs, chosen once from its `AttentionConfig` and composed by `run`.

`run`: project -> transforms before the split -> split -> transforms after it -> cache -> masks -> scorer ->
merge -> gate -> o_proj. The head transforms (equinox's `process_heads`, as a tuple) are built by `plan` from the
options: before the split those that see every head's features together (a QK-norm over all heads, OLMo-2;
`clip_qkv`), after it each head's (QK-norm, RoPE or partial RoPE, a QK-norm after RoPE, Llama 4's temperature
tuning). Differential attention (DiffLlama) scores twice, once for each half of the values, and subtracts the
maps' outputs in head pairs (`_differential`). A variant is one field of the config, its transform or scorer option
here, its reader, the reference.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

from .._compute import kernels as K
from .._compute.fastpath import FUSED, NATIVE, FusedQKV
from .._compute.rotary import (
    apply_partial_rotary,
    apply_rotary,
    default_positions,
    partial_rotary_tables,
    rotary_tables,
)
from .._compute.scorer import score
from .._compute.stages import FORWARD_STAGES
from .._core.contract import raw

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


class Plan(NamedTuple):
    """The forward of one configuration: its head transforms and what the scorer is given."""

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


def _clipper(bound: float) -> BeforeSplit:
    def clip(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return s.clip_projections(q, k, v, bound)

    return clip


def _normalize_heads(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
    return s.normalize_qk(m["q_norm"], m["k_norm"], q, k)


def _rotator(partial: bool, interleaved: bool) -> AfterSplit:
    if partial:  # the tables and the rotation of the first rope_dim features only

        def rotate_part(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
            cos, sin = s.partial_rotary_tables(m["rotary"], positions, q)
            return s.apply_partial_rotary(q, k, cos, sin, interleaved)

        return rotate_part

    def rotate(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
        cos, sin = s.rotary_tables(m["rotary"], positions, q)
        return s.apply_rotary(q, k, cos, sin, interleaved)

    return rotate


def _tuner(floor_scale: int, attn_scale: float) -> AfterSplit:
    def tune(s: Any, m: dict[str, Any], q: Tensor, k: Tensor, positions: Any, start: int) -> Any:
        return s.tune_query_temperature(q, start, floor_scale, attn_scale), k

    return tune


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
    start = 0 if kv_cache is None else kv_cache.seen
    if p.positions and positions is None:
        positions = default_positions(query, start)
    for transform in p.after_split:
        q, k = transform(s, m, q, k, positions, start)
    if kv_cache is None:
        k, v = s.attend_to_new(k, v)
    else:
        k, v = s.append_to_cache(kv_cache, kv_cache.keys_buffer, k, v)
        masked = attn_mask is not None or key_padding_mask is not None
        if masked and kv_cache.window is not None and kv_cache.seen != k.shape[2]:  # positions were dropped
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
