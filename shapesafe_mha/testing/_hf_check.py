"""`check_hf_attention`: a Hugging Face attention class, built and called as its model does, against the reference.

Each example builds the class from its config class with drawn sizes (GQA where the config has
`num_key_value_heads`), loads drawn weights into its layout (`q/k/v/o_proj`, GPT-2's `Conv1D`
`c_attn`/`c_proj`, any biases it has), and calls it the way the model's `forward` does: cos/sin from
the model's own rotary class, the mask from transformers' `create_causal_mask`, a `DynamicCache`
for decoding. The expected output is our per-head reference, which applies RoPE itself. Four
properties run in turn, so a failure names what broke: heads, RoPE/positions, padding/mask,
decoding/cache.

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
from transformers.masking_utils import create_causal_mask

from .._core.errors import ConfigError
from .._core.weights import AttentionWeights
from .._interop.adapters import load_weights
from .._interop.hf import rope_of
from ._diagnose import Scenario
from ._strategies import ALL_KINDS, AttentionConfig, attention_configs, attention_inputs, projection_weights
from ._toolkit import _to, judge, resolve, run_property

# Config fields that change what attention computes, and the values under which it is the reference's.
_FIELDS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "attention_multiplier": (None,),  # Granite: a scale of its own
    "partial_rotary_factor": (None, 1.0),
    "scale_attn_weights": (True,),  # GPT-2
    "scale_attn_by_inverse_layer_idx": (False,),
}


@dataclass(frozen=True)
class _Layer:
    """One drawn layer: the transformers config, the attention module and the weights it holds."""

    config: Any
    module: nn.Module
    weights: AttentionWeights
    rotary: nn.Module | None
    theta: float | None


class _Target:
    """What is checked: the attention class, its config class, how the model builds and calls it."""

    def __init__(self, attention_cls: type[nn.Module], config_cls: type, attn_implementation: str) -> None:
        self.attention_cls, self.config_cls, self.implementation = attention_cls, config_cls, attn_implementation
        default = config_cls()
        self.has_kv_heads = hasattr(default, "num_key_value_heads")
        self.has_head_dim = hasattr(default, "head_dim")
        self.has_bias_switch = hasattr(default, "attention_bias")
        self.has_window = hasattr(default, "sliding_window")
        self.width_free = self.has_head_dim and self._accepts(hidden_size=6, num_attention_heads=4, head_dim=2)
        theta = None
        if getattr(default, "rope_parameters", None) or getattr(default, "rope_theta", None):
            theta, _ = rope_of(default)
        self.rotary_cls = self._rotary_class(default) if theta is not None else None
        parameters = inspect.signature(attention_cls.forward).parameters
        self.cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self.takes_position_embeddings = "position_embeddings" in parameters
        self.takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self._refuse_what_the_reference_does_not_compute()

    def _refuse_what_the_reference_does_not_compute(self) -> None:
        """QK-norm, softcapping, other scales, non-causal layers: a ConfigError naming the field, not a failed check."""
        sizes: dict[str, Any] = {"hidden_size": 8, "num_attention_heads": 2, "attn_implementation": self.implementation}
        if self.has_kv_heads:
            sizes["num_key_value_heads"] = 1
        if self.has_head_dim:
            sizes["head_dim"] = 4
        if self.has_window:
            sizes["sliding_window"] = None
        config = self.config_cls(**sizes)
        module = self.attention_cls(config, layer_idx=0)
        # Decided from the config's fields and the layer's structure, never from a computed
        # attribute such as `scaling`: a wrong one there is a bug to catch, not a variant to refuse.
        why = next(
            (f"{norm}={type(getattr(module, norm)).__name__}: QK-norm" for norm in ("q_norm", "k_norm")
             if getattr(module, norm, None) is not None),
            None,
        )  # fmt: skip
        for field, fine in _FIELDS.items():
            if why is None and hasattr(config, field) and getattr(config, field) not in fine:
                why = f"config.{field}={getattr(config, field)!r}"
        if why is not None:
            raise ConfigError(
                f"check_hf_attention(): {self.name}: {why} computes what the per-head reference does not; "
                "it cannot be checked against it."
            )

    def _accepts(self, **sizes: int) -> bool:
        """Whether the config class accepts these sizes (Llama's wants hidden_size a multiple of the heads)."""
        try:
            self.config_cls(**sizes)
        except Exception:
            return False
        return True

    def _rotary_class(self, default: Any) -> type[nn.Module] | None:
        """The model's own rotary class (`LlamaRotaryEmbedding` for `LlamaConfig`), looked up where the model is."""
        model_type = default.model_type
        prefix = self.config_cls.__name__.removesuffix("Config")
        try:
            modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            return None
        return getattr(modeling, f"{prefix}RotaryEmbedding", None)

    @property
    def name(self) -> str:
        return self.attention_cls.__name__

    def configs(self, max_seq: int) -> st.SearchStrategy[AttentionConfig]:
        drawn = attention_configs(
            ALL_KINDS if self.has_kv_heads else ("mha",),
            max_heads=4,
            max_seq=max_seq,
            max_batch=2,
            max_d_head=8,
            bias=True,  # drawn for every projection; the layer keeps those it has
            cross=False,
            even_d_head=self.rotary_cls is not None,
            d_model_is_inner=not self.has_head_dim,
        )
        if self.width_free or not self.has_head_dim:
            return drawn
        # hidden_size a multiple of the heads, head_dim still free: the nearest multiple
        return drawn.map(lambda c: replace(c, d_model=c.num_heads * max(1, round(c.d_model / c.num_heads))))

    def build(self, c: AttentionConfig, weights: AttentionWeights, data: Any, dtype: torch.dtype) -> _Layer:
        kwargs: dict[str, Any] = {
            "hidden_size": c.d_model,
            "num_attention_heads": c.num_heads,
            "num_hidden_layers": 1,
            "attn_implementation": self.implementation,
        }
        if self.has_kv_heads:
            kwargs["num_key_value_heads"] = c.num_kv_heads
        if self.has_head_dim:
            kwargs["head_dim"] = c.d_head
        if self.has_bias_switch:
            kwargs["attention_bias"] = data.draw(st.booleans(), label="attention_bias")
        if self.has_window:
            kwargs["sliding_window"] = None  # sliding windows are another layer; the reference has none
        theta = None
        if self.rotary_cls is not None:
            theta = data.draw(st.sampled_from([10.0, 10000.0]), label="rope_theta")
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        config = self.config_cls(**kwargs)
        module = self.attention_cls(config, layer_idx=0).to(dtype=dtype, device=weights.w_q.device).eval()
        held = load_weights(module, weights)
        rotary = None if self.rotary_cls is None else self.rotary_cls(config).to(device=weights.w_q.device)
        return _Layer(config, module, held, rotary, theta)

    def call(
        self, layer: _Layer, x: Tensor, positions: Tensor, mask: Tensor | None, cache: Any, neutral: bool
    ) -> Tensor:
        """One call, as the model's forward makes it; `neutral` passes cos=1, sin=0 (no rotation)."""
        kwargs: dict[str, Any] = {"attention_mask": mask, self.cache_keyword: cache}
        if self.takes_position_embeddings:
            if layer.rotary is None or neutral:
                size = layer.weights.w_q.shape[0] // layer.config.num_attention_heads
                shape = (1, x.shape[1], size)
                kwargs["position_embeddings"] = (x.new_ones(shape), x.new_zeros(shape))
            else:
                kwargs["position_embeddings"] = layer.rotary(x, positions)
        if self.takes_kwargs:
            kwargs["position_ids"] = positions
        with torch.no_grad():
            out = layer.module(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def mask(self, layer: _Layer, x: Tensor, attention_mask: Tensor | None, cache: Any, positions: Tensor) -> Any:
        return create_causal_mask(
            config=layer.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache, position_ids=positions
        )


def _sizes(c: AttentionConfig, layer: _Layer) -> str:
    held = "".join(role for role in "qkvo" if getattr(layer.weights, f"b_{role}") is not None)
    return (
        f"seq={c.seq}, batch={c.batch}, hidden_size={c.d_model}, num_heads={c.num_heads}, "
        f"num_kv_heads={c.num_kv_heads}, head_dim={c.d_head}, biases={held or 'none'!r}"
        + (f", rope_theta={layer.theta:g}" if layer.theta is not None else "")
    )


def _heads(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    positions = torch.arange(c.seq, device=x.device)[None]

    def run(weights: AttentionWeights) -> Tensor:
        load_weights(layer.module, weights)
        return target.call(layer, x, positions, target.mask(layer, x, None, None, positions), None, neutral=True)

    scenario = _scenario(layer, x, c, rope=False)
    note = "one causal forward, no rotation (cos=1, sin=0)" if target.rotary_cls else "one causal forward"
    return run, scenario, None, note


def _rope(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    start = data.draw(st.integers(0, 64), label="first position")
    positions = torch.arange(start, start + c.seq, device=x.device)[None]

    def run(weights: AttentionWeights) -> Tensor:
        load_weights(layer.module, weights)
        return target.call(layer, x, positions, target.mask(layer, x, None, None, positions), None, neutral=False)

    scenario = _scenario(layer, x, c, rope=True, positions=positions.expand(c.batch, -1))
    rotary = type(layer.rotary).__name__
    return run, scenario, None, f"one causal forward at positions {start}..{start + c.seq - 1}, cos/sin from {rotary}"


def _padding(target: _Target, c: AttentionConfig, data: Any, dtype: torch.dtype, layer: _Layer, x: Tensor) -> Any:
    lengths = data.draw(st.lists(st.integers(1, c.seq), min_size=c.batch, max_size=c.batch), label="lengths")
    left = data.draw(st.booleans(), label="left padding")
    index = torch.arange(c.seq, device=x.device)
    real = torch.stack([(index >= c.seq - n) if left else (index < n) for n in lengths])
    positions = index[None]  # the model's default position_ids ignore padding

    def run(weights: AttentionWeights) -> Tensor:
        load_weights(layer.module, weights)
        mask = target.mask(layer, x, real.long(), None, positions)
        return target.call(layer, x, positions, mask, None, neutral=False)[real]

    scenario = _scenario(layer, x, c, rope=layer.theta is not None, padding=~real)
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
        load_weights(layer.module, weights)
        cache = DynamicCache(config=layer.config)
        pieces, done = [], 0
        for size in [prefill] + [1] * (c.seq - prefill):
            chunk = x[:, done : done + size].contiguous()  # as the model's hidden states are
            positions = torch.arange(done, done + size, device=x.device)[None]
            mask = target.mask(layer, chunk, None, cache, positions)
            pieces.append(target.call(layer, chunk, positions, mask, cache, neutral=False))
            done += size
        return torch.cat(pieces, dim=1)

    scenario = _scenario(layer, x, c, rope=layer.theta is not None)
    note = f"prefill {prefill} token(s), then one at a time through a DynamicCache, == one causal forward"
    return run, scenario, None, note


def _scenario(
    layer: _Layer,
    x: Tensor,
    c: AttentionConfig,
    *,
    rope: bool,
    positions: Tensor | None = None,
    padding: Tensor | None = None,
) -> Scenario:
    wide = x.double()
    return Scenario(
        wide,
        wide,
        wide,
        _to(layer.weights, torch.float64),
        c.num_heads,
        c.num_kv_heads,
        is_causal=True,
        key_padding_mask=padding,
        rope_theta=layer.theta if rope else None,
        positions=positions,
    )


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
    from `hidden_size / heads` where the config has `head_dim`, with and without `attention_bias`),
    builds `attention_cls(config_cls(...), layer_idx=0)`, loads drawn weights into its projections,
    and checks four properties in turn, each against `reference.per_head_attention` (which applies
    rotary embeddings itself, from `rope_theta`):

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
        ConfigError: the class computes what the reference does not (QK-norm, logit softcapping, a
            scale other than 1/sqrt(head_dim), sliding windows, a non-causal layer), named by field.
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
            where = f"{_sizes(c, layer)}\n  property: {note}"
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

        run_property(check, kinds=ALL_KINDS, max_examples=max_examples, base=settings, configs=target.configs(max_seq))
