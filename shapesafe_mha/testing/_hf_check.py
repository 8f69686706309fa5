"""`check_hf_attention`: a Hugging Face attention class, built and called as its model does, against the reference.

Each example builds the class from its config class with drawn sizes (GQA where the config has
`num_key_value_heads`), loads drawn weights into its layout (`q/k/v/o_proj`, GPT-2's `Conv1D`
`c_attn`/`c_proj`, GPT-NeoX's per-head `query_key_value`, CodeGen's `qkv_proj` in blocks of `[q; v; k]`,
any biases it has), and calls it the way the model's `forward` does: cos/sin from the model's own rotary
class, the mask from transformers' `create_causal_mask` (or its sliding-window one), a `DynamicCache`
for decoding. What the class computes beyond plain attention is read first (`_hf_recipe.read_recipe`:
QK-norms, softcapping, other scales, windows, partial or interleaved RoPE, GPT-J's and CodeGen's RoPE
of `config.rotary_dim` features, which the check draws, with a theta read from their own tables, NoPE
layers, sinks, an output norm, Llama 4's chunked layers as a `mask_mod` and its NoPE layers' temperature tuning as
a `score_mod`, Bloom's and MPT's ALiBi biases built by their modeling module's own function, each with sizes drawn
small enough to matter) and handed to the per-head reference, which computes it
itself; anything else is refused by name. Four properties run in turn, so a failure names what broke: heads,
RoPE/positions, padding/mask, decoding/cache.

transformers is needed here (the `hf` extra); `shapesafe_mha.testing` does not import this module.
"""

import importlib
import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import settings as Settings
from hypothesis import strategies as st
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from .._compute.reference import alibi_slopes
from .._core.weights import AttentionWeights
from .._interop.hf import model_biases, sincos_rope
from ._diagnose import Scenario
from ._hf_recipe import (
    OUT_NORMS,
    OWNER,
    cast_embeddings,
    drawn_rope,
    embeddings,
    load_layer_weights,
    read_recipe,
    rope_parameters,
    tiny_config,
)
from ._strategies import ALL_KINDS, AttentionConfig, attention_configs, attention_inputs, projection_weights
from ._toolkit import _to, judge, resolve, run_property


@dataclass(frozen=True)
class _Layer:
    """One drawn layer: the transformers config, the attention module, the weights it holds and its variants."""

    config: Any
    module: nn.Module
    weights: AttentionWeights
    rotary: nn.Module | None
    theta: float | None
    layer_type: str | None = None
    window: int | None = None
    qk_norm: tuple[Tensor, Tensor] | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: Tensor | None = None
    out_norm: tuple[Tensor, float] | None = None
    qk_norm_bias: tuple[Tensor, Tensor] | None = None
    rotary_dim: int | None = None  # drawn where the layer rotates config.rotary_dim features (GPT-J); None: every one
    temperature: tuple[int, float] | None = None  # Llama 4's (floor_scale, attn_scale) on a NoPE layer
    chunk: int | None = None  # Llama 4's attention_chunk_size on a chunked_attention layer
    gate: tuple[Tensor, Tensor | None] | None = None  # Qwen3-Next's output gate rows (and bias) of q_proj, as held


class _Target:
    """What is checked: the attention class, its config class, how the model builds and calls it."""

    def __init__(self, attention_cls: type[nn.Module], config_cls: type, attn_implementation: str) -> None:
        self.attention_cls, self.config_cls, self.implementation = attention_cls, config_cls, attn_implementation
        self.recipe = read_recipe(attention_cls, config_cls, attn_implementation)
        self.rotary_cls = self.recipe.rotary_cls
        parameters = inspect.signature(attention_cls.forward).parameters
        self.takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.keywords = set(parameters)

    @property
    def name(self) -> str:
        return self.attention_cls.__name__

    def configs(self, max_seq: int) -> st.SearchStrategy[AttentionConfig]:
        r = self.recipe
        drawn = attention_configs(
            ("mqa",) if r.multi_query else ALL_KINDS if r.has_kv_heads and r.fused is None else ("mha",),
            max_heads=4,
            max_seq=max_seq,
            max_batch=2,
            max_d_head=8,
            bias=True,  # drawn for every projection; the layer keeps those it has
            cross=False,
            even_d_head=self.rotary_cls is not None,
            d_model_is_inner=not r.has_head_dim,
        )
        if self.rotary_cls is not None and r.rotary_factor != 1.0:  # the rotated part an even number of features
            drawn = drawn.filter(lambda c: int(c.d_head * r.rotary_factor) % 2 == 0 and c.d_head * r.rotary_factor >= 2)
        if r.blocks > 1:  # CodeGen: hidden_size in whole blocks of qkv_proj
            drawn = drawn.filter(lambda c: c.num_heads * c.d_head % r.blocks == 0)
        if r.tied_width:  # the output projection takes hidden_size features: heads * head_dim is hidden_size
            return drawn.map(lambda c: replace(c, d_model=c.num_heads * c.d_head))
        if r.width_free or not r.has_head_dim:
            return drawn
        # hidden_size a multiple of the heads, head_dim still free: the nearest multiple
        return drawn.map(lambda c: replace(c, d_model=c.num_heads * max(1, round(c.d_model / c.num_heads))))

    def build(self, c: AttentionConfig, weights: AttentionWeights, data: Any, dtype: torch.dtype) -> _Layer:
        r = self.recipe
        kwargs: dict[str, Any] = {
            "hidden_size": c.d_model,
            "num_attention_heads": c.num_heads,
            "attn_implementation": self.implementation,
        }
        if r.has_kv_heads:
            kwargs["num_key_value_heads"] = c.num_kv_heads
        if r.has_head_dim:
            kwargs["head_dim"] = c.d_head
        if r.has_bias_switch:
            kwargs["attention_bias"] = data.draw(st.booleans(), label="attention_bias")
        layer_idx, layer_type = data.draw(st.sampled_from(r.layers), label="layer (index, type)")
        window = None
        if r.windowed:
            window = data.draw(st.integers(2, c.seq + 2), label="sliding_window")  # 1: its cache keeps no key
            kwargs["sliding_window"] = window
        softcap = None
        if r.logit_softcap is not None:  # a cap near the scores' size, where it bends them (the default 50 hardly does)
            softcap = data.draw(st.sampled_from([0.5, 2.0, r.logit_softcap]), label="attn_logit_softcapping")
            kwargs["attn_logit_softcapping"] = softcap
        temperature = None
        if r.temperature and layer_idx in r.nope:  # a floor_scale within the check's positions, where it bends them
            temperature = (
                data.draw(st.sampled_from([1, 2, 3, 8192]), label="floor_scale"),
                data.draw(st.sampled_from([0.1, 0.5]), label="attn_scale"),
            )
            kwargs["floor_scale"], kwargs["attn_scale"] = temperature
        chunk = None
        if layer_type == "chunked_attention":  # chunks the drawn sequences cross, and the config's own
            chunk = data.draw(st.sampled_from([2, 3, 5, *([r.chunk] if r.chunk else [])]), label="attention_chunk_size")
            kwargs["attention_chunk_size"] = chunk
        theta = rotary_dim = None
        if r.in_layer_rope:  # the rotated part drawn (an even number of features); theta is the tables' own
            rotary_dim = data.draw(st.sampled_from(range(2, c.d_head + 1, 2)), label="rotary_dim")
            kwargs["rotary_dim"] = rotary_dim
        elif self.rotary_cls is not None:
            theta = data.draw(st.sampled_from([10.0, 10000.0]), label="rope_theta")
            kwargs["rope_parameters"] = drawn_rope(self.config_cls(), theta)
        config = tiny_config(self.config_cls, **kwargs)
        if theta is not None:  # a config may keep a theta per layer type (Gemma 3): the one this layer's tables use
            theta = float(rope_parameters(config, layer_type).get("rope_theta", theta))
        module = self.attention_cls(config, layer_idx=layer_idx).to(dtype=dtype, device=weights.w_q.device).eval()
        gate = None
        if r.output_gate:  # a gate's rows and bias drawn as a query projection's are
            drawn = data.draw(projection_weights(c, dtype=dtype, device=weights.w_q.device), label="output gate")
            gate = (drawn.w_q, drawn.b_q)
        held = load_layer_weights(module, weights, r, c.num_heads, gate)
        if gate is not None and held.b_q is None:  # a q_proj without a bias: the gate has none either
            gate = (gate[0], None)
        if layer_type is not None:
            sliding = layer_type == "sliding_attention"
        else:
            sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        qk_norm = qk_norm_bias = None
        if r.qk_norm is not None and not r.qk_norm.weighted and layer_idx in (r.qk_norm_layers or {layer_idx}):
            ones = torch.ones(c.d_head, dtype=torch.float64, device=weights.w_q.device)
            qk_norm = (ones, ones)  # a norm without weight: the reference's RMSNorm of weight 1
        elif r.qk_norm is not None and layer_idx in (r.qk_norm_layers or {layer_idx}):
            pair, shifts = [], []
            for name in r.qk_norm.names:
                norm: Any = getattr(module, name)
                wanted = data.draw(_norm_weights(tuple(norm.weight.shape), dtype, weights.w_q.device), label=name)
                with torch.no_grad():
                    norm.weight.copy_(wanted - r.qk_norm.offset)
                    if r.qk_norm.kind == "layer":
                        shift = data.draw(_norm_weights(norm.bias.shape[0], dtype, weights.w_q.device)) - 1
                        norm.bias.copy_(shift)
                        shifts.append(shift.double())
                pair.append(wanted.double())
            qk_norm = (pair[0], pair[1])
            qk_norm_bias = (shifts[0], shifts[1]) if shifts else None
        out_norm = None
        if r.out_norm_eps is not None:
            sub_norm: Any = next(getattr(module, n) for n in OUT_NORMS if hasattr(module, n))
            wanted = data.draw(_norm_weights(sub_norm.weight.shape[0], dtype, weights.w_q.device), label="out_norm")
            with torch.no_grad():
                sub_norm.weight.copy_(wanted)
            out_norm = (wanted.double(), r.out_norm_eps)
        sinks = None
        if r.sinks:
            held_sinks: Any = module.sinks
            sinks = data.draw(_norm_weights(c.num_heads, dtype, weights.w_q.device), label="sinks") * 4 - 4
            with torch.no_grad():
                held_sinks.copy_(sinks)  # logits of -2..2: sinks that take a share of the softmax
            sinks = sinks.double()
        rotary = None if self.rotary_cls is None else self.rotary_cls(config).to(device=weights.w_q.device)
        if rotary is not None and rotary_dim is not None:
            modeling = importlib.import_module(self.attention_cls.__module__)
            theta = sincos_rope(modeling, rotary, rotary_dim, f"{OWNER}: {self.name}")[0]
        scale = None if r.scale is None else r.scale(config)
        if layer_idx in r.nope:
            theta = None  # a NoPE layer: the tables are passed, and ignored
        window = window if sliding else None
        return _Layer(
            config, module, held, rotary, theta, layer_type, window, qk_norm, scale, softcap, sinks, out_norm,
            qk_norm_bias, None if rotary_dim == c.d_head else rotary_dim, temperature, chunk, gate,
        )

    def call(
        self,
        layer: _Layer,
        x: Tensor,
        positions: Tensor,
        mask: Tensor | None,
        cache: Any,
        neutral: bool,
        padding: Tensor | None = None,
    ) -> Tensor:
        """One call, as the model's forward makes it; `neutral` passes the tables of position 0 (no rotation);
        `padding` is the 2-D attention mask (1 = token) over every position, cached and new, where there is one."""
        kwargs: dict[str, Any] = {"attention_mask": mask, self.recipe.cache_keyword: cache}
        alibi = self.recipe.alibi
        if alibi is not None:  # Bloom, MPT: the biases their model builds, over every key; Bloom's residual 0
            kv_len = int(positions[0, -1]) + 1
            every = torch.ones(x.shape[0], kv_len, dtype=torch.long, device=x.device) if padding is None else padding
            kwargs[alibi] = model_biases(layer.module, layer.config, kv_len, every, x.dtype)
            if "residual" in self.keywords:
                kwargs["residual"] = torch.zeros_like(x)
            if alibi == "position_bias" and mask is not None:  # MptModel: create_causal_mask(...).to(torch.bool)
                kwargs["attention_mask"] = mask.to(torch.bool)
        if self.recipe.takes_position_embeddings:
            if layer.rotary is None:
                size = layer.weights.w_q.shape[0] // layer.config.num_attention_heads
                shape = (1, x.shape[1], size)
                kwargs["position_embeddings"] = (x.new_ones(shape), x.new_zeros(shape))
            else:
                at = positions * 0 if neutral else positions
                found = embeddings(layer.rotary, x, at, layer.layer_type)
                kwargs["position_embeddings"] = cast_embeddings(found, x.dtype)
        if self.takes_kwargs or "position_ids" in self.keywords:
            kwargs["position_ids"] = positions
        if "cache_position" in self.keywords:
            kwargs["cache_position"] = positions[0]
        if "alibi" in self.keywords and alibi is None:
            kwargs["alibi"] = None  # as the model passes it where the config switches ALiBi off (Falcon)
        with torch.no_grad():
            out = layer.module(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def mask(self, layer: _Layer, x: Tensor, attention_mask: Tensor | None, cache: Any, positions: Tensor) -> Any:
        make = create_causal_mask if layer.window is None else create_sliding_window_causal_mask
        if layer.layer_type == "chunked_attention":  # Llama 4
            make = create_chunked_causal_mask
        return make(
            config=layer.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache, position_ids=positions
        )

    def cache(self, layer: _Layer) -> Any:
        return DynamicCache(config=layer.config)


def _norm_weights(width: int | tuple[int, ...], dtype: torch.dtype, device: Any) -> st.SearchStrategy[Tensor]:
    """QK-norm weights around 1 (the scale a trained norm keeps), drawn from a seed."""
    return st.integers(0, 2**31 - 1).map(
        lambda seed: (torch.rand(width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5)
        .to(dtype=dtype, device=device)
    )


def _sizes(target: _Target, c: AttentionConfig, layer: _Layer) -> str:
    held = "".join(role for role in "qkvo" if getattr(layer.weights, f"b_{role}") is not None)
    return (
        f"seq={c.seq}, batch={c.batch}, hidden_size={c.d_model}, num_heads={c.num_heads}, "
        f"num_kv_heads={c.num_kv_heads}, head_dim={c.d_head}, biases={held or 'none'!r}"
        + (f", rope_theta={layer.theta:g}" if layer.theta is not None else "")
        + (f", rotary_dim={layer.config.rotary_dim}" if target.recipe.in_layer_rope else "")
        + (f", layer_type={layer.layer_type!r}" if layer.layer_type is not None else "")
        + (f", sliding_window={layer.window}" if layer.window is not None else "")
        + (f", attn_logit_softcapping={layer.softcap:g}" if layer.softcap is not None else "")
        + (f", floor_scale={layer.temperature[0]}, attn_scale={layer.temperature[1]:g}" if layer.temperature else "")
        + (f", attention_chunk_size={layer.chunk}" if layer.chunk is not None else "")
    )


def _heads(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    positions = torch.arange(c.seq, device=x.device)[None]

    def run(weights: AttentionWeights) -> Tensor:
        load_layer_weights(layer.module, weights, target.recipe, c.num_heads, layer.gate)
        return target.call(layer, x, positions, target.mask(layer, x, None, None, positions), None, neutral=True)

    scenario = _scenario(target, layer, x, c, rope=False)
    note = "one causal forward, no rotation (cos=1, sin=0)" if target.rotary_cls else "one causal forward"
    return run, scenario, None, note


def _rope(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    start = data.draw(st.integers(0, 64), label="first position")
    positions = torch.arange(start, start + c.seq, device=x.device)[None]

    def run(weights: AttentionWeights) -> Tensor:
        load_layer_weights(layer.module, weights, target.recipe, c.num_heads, layer.gate)
        return target.call(layer, x, positions, target.mask(layer, x, None, None, positions), None, neutral=False)

    scenario = _scenario(target, layer, x, c, rope=layer.theta is not None, positions=positions.expand(c.batch, -1))
    rotary = type(layer.rotary).__name__
    return run, scenario, None, f"one causal forward at positions {start}..{start + c.seq - 1}, cos/sin from {rotary}"


def _padding(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    lengths = data.draw(st.lists(st.integers(1, c.seq), min_size=c.batch, max_size=c.batch), label="lengths")
    left = data.draw(st.booleans(), label="left padding")
    index = torch.arange(c.seq, device=x.device)
    real = torch.stack([(index >= c.seq - n) if left else (index < n) for n in lengths])
    positions = index[None]  # the model's default position_ids ignore padding

    def run(weights: AttentionWeights) -> Tensor:
        load_layer_weights(layer.module, weights, target.recipe, c.num_heads, layer.gate)
        mask = target.mask(layer, x, real.long(), None, positions)
        return target.call(layer, x, positions, mask, None, neutral=False, padding=real.long())[real]

    scenario = _scenario(target, layer, x, c, rope=layer.theta is not None, padding=~real)
    side = "left" if left else "right"
    return (
        run,
        scenario,
        real,
        f"a {side}-padded batch (lengths {lengths}), the 2D attention_mask through create_causal_mask",
    )


def _decoding(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    prefill = data.draw(st.integers(1, c.seq), label="prefill")

    def run(weights: AttentionWeights) -> Tensor:
        load_layer_weights(layer.module, weights, target.recipe, c.num_heads, layer.gate)
        cache = target.cache(layer)
        pieces, done = [], 0
        for size in [prefill] + [1] * (c.seq - prefill):
            chunk = x[:, done : done + size].contiguous()  # as the model's hidden states are
            positions = torch.arange(done, done + size, device=x.device)[None]
            mask = target.mask(layer, chunk, None, cache, positions)
            pieces.append(target.call(layer, chunk, positions, mask, cache, neutral=False))
            done += size
        return torch.cat(pieces, dim=1)

    scenario = _scenario(target, layer, x, c, rope=layer.theta is not None)
    note = f"prefill {prefill} token(s), then one at a time through a DynamicCache, == one causal forward"
    return run, scenario, None, note


def _scenario(
    target: _Target,
    layer: _Layer,
    x: Tensor,
    c: AttentionConfig,
    *,
    rope: bool,
    positions: Tensor | None = None,
    padding: Tensor | None = None,
) -> Scenario:
    wide = x.double()
    return Scenario.of(
        wide,
        wide,
        wide,
        _to(layer.weights, torch.float64),
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        is_causal=True,
        key_padding_mask=padding,
        rope_theta=layer.theta if rope else None,
        positions=positions,
        rope_style=target.recipe.rope_style,
        rotary_dim=layer.rotary_dim if target.recipe.in_layer_rope else target.recipe.rotary_dim(c.d_head),
        scale=layer.scale,
        qk_norm=layer.qk_norm,
        norm_eps=1e-6 if target.recipe.qk_norm is None else target.recipe.qk_norm.eps,
        qk_norm_over="head" if target.recipe.qk_norm is None else target.recipe.qk_norm.over,
        qk_norm_centred=target.recipe.qk_norm is not None and target.recipe.qk_norm.kind == "centred",
        window=layer.window,
        logit_softcap=layer.softcap,
        sinks=layer.sinks,
        alibi_slopes=alibi_slopes(c.num_heads) if target.recipe.alibi is not None else None,
        output_gate=None if layer.gate is None else (layer.gate[0].double(), _double(layer.gate[1])),
        qk_norm_after_rope=target.recipe.qk_norm is not None and target.recipe.qk_norm.after_rope,
        out_norm=layer.out_norm,
        qk_norm_bias=layer.qk_norm_bias,
        score_mod=None if layer.temperature is None else _temperature(*layer.temperature),
        mask_mod=None if layer.chunk is None else _chunks(layer.chunk, padding, x.shape[0], x.device),
    )


def _double(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.double()


def _chunks(chunk: int, padding: Tensor | None, batch: int, device: Any) -> Any:
    """Llama 4's chunked attention as a mask_mod: a query sees the keys of its own chunk of `chunk` cache indices,
    the chunks counted from each sequence's first real token (after its left padding, as transformers counts)."""
    left = torch.zeros(batch, dtype=torch.long, device=device)
    if padding is not None:
        left = padding.long().cumprod(-1).sum(-1).to(device)  # the leading padding of each sequence

    def mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shift = left[b.long()]
        return torch.div(kv_idx - shift, chunk, rounding_mode="floor") == torch.div(
            q_idx - shift, chunk, rounding_mode="floor"
        )

    return mod


def _temperature(floor_scale: int, attn_scale: float) -> Any:
    """Llama 4's temperature tuning as a score_mod: the queries at cache index `i` (the query's index in a full
    forward) scaled by `log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`, so each row of scores is."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        factor = torch.log1p(torch.floor((q_idx.double() + 1.0) / floor_scale)) * attn_scale + 1.0
        return score * factor.to(score.dtype)

    return mod


PROPERTIES: list[tuple[str, Any, bool]] = [
    # name, property, needs RoPE
    ("heads", _heads, False),
    ("RoPE/positions", _rope, True),
    ("padding/mask", _padding, False),
    ("decoding/cache", _decoding, False),
]


def check_hf_attention(
    attention_cls: type[nn.Module],
    config_cls: type,
    *,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    max_examples: int | None = None,
    settings: Settings | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    max_seq: int = 12,
    device: torch.device | str | None = None,
) -> None:
    """Property-test a Hugging Face attention class, as its model builds and calls it, against the reference.

    hypothesis draws sizes (GQA and MQA where the config has `num_key_value_heads`, `head_dim` apart
    from `hidden_size / heads` where the config has `head_dim`, with and without `attention_bias`; a
    layer of each attention type of `layer_types`, a `sliding_window`, the softcap, QK-norm weights
    and sinks where the class has them, Llama 4's `attention_chunk_size`, `floor_scale` and
    `attn_scale`), builds `attention_cls(config_cls(...), layer_idx=...)`, loads drawn weights into its
    projections, and checks four properties in turn, each against
    `reference.per_head_attention` (which applies rotary embeddings itself, from `rope_theta`, and
    computes the variants the class was read to compute: see docs/hf-attention-classes.md for every
    class of the installed transformers):

    - **heads**: one causal forward (the mask from transformers' `create_causal_mask`); for a RoPE
      model with cos=1, sin=0, so projections, heads, scaling and the causal mask are checked alone;
    - **RoPE/positions**: the same at positions `p..p+seq-1`, cos/sin from the model's rotary class;
    - **padding/mask**: a left- or right-padded batch, its 2D `attention_mask` through
      `create_causal_mask`, compared on the real tokens;
    - **decoding/cache**: a prefill, then one token at a time through a `DynamicCache`, == one
      causal forward.

    Tolerance: `atol`/`rtol` if given, else the dtype's; in float64 a deviation of float32 rounding
    is accepted (transformers' eager attention takes the softmax in float32).

    Example:
        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> from shapesafe_mha.testing.hf import check_hf_attention
        >>> check_hf_attention(LlamaAttention, LlamaConfig, max_examples=5)

    Raises:
        ConfigError: the class computes what the reference does not, or cannot be built and called
            as its model does; the first line names the class and the variant or layout
            (`check_hf_attention(): BertSelfAttention: a layer without an output projection is not
            computed by the per-head reference; ...`). Never raised for a failed property.
        AssertionError: the first property that fails, named in brackets on the report's first
            line (`[RoPE/positions] LlamaAttention (eager, float32) differs from the per-head
            reference by 0.83 ...`), with the smallest failing sizes, what the property did, the
            bug class where a variant of the reference matches, and which heads are wrong.
    """
    target = _Target(attention_cls, config_cls, attn_implementation)
    tol = resolve(dtype, atol, rtol)
    lenient = atol is None and rtol is None
    label = f"{target.name} ({attn_implementation}, {str(dtype).removeprefix('torch.')})"
    for name, prop, needs_rope in PROPERTIES:
        if needs_rope and target.rotary_cls is None:
            continue

        def check(c: AttentionConfig, data: Any, name: str = name, prop: Any = prop) -> float:
            weights = data.draw(projection_weights(c, dtype=dtype, device=device), label="weights")
            x = data.draw(attention_inputs(c, dtype=dtype, device=device), label="inputs").query
            try:
                layer = target.build(c, weights, data, dtype)
            except Exception as error:
                raise AssertionError(
                    f"[{name}] building {target.name}({config_cls.__name__}(...)) raised {error!r}"
                ) from error
            run, scenario, rows, note = prop(target, c, data, dtype, layer, x)
            where = f"{_sizes(target, c, layer)}\n  property: {note}"
            try:
                got = run(layer.weights)
            except Exception as error:
                first = str(error).splitlines()[0] if str(error) else ""
                raise AssertionError(
                    f"[{name}] {label} raised {type(error).__name__}: {first}\n  smallest failing config: {where}"
                ) from error
            return judge(
                got, scenario, tol, dtype, where, run=run, rows=rows, lenient_float64=lenient, what=f"[{name}] {label}"
            )

        kinds = ("mqa",) if target.recipe.multi_query else ALL_KINDS
        run_property(check, kinds=kinds, max_examples=max_examples, base=settings, configs=target.configs(max_seq))
