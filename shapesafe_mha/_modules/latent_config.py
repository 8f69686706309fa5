"""`LatentConfig`: every option of a `LatentAttention`, described and validated once.

The module's constructor keywords, `from_config`, `config` and what setting an option on a built module does are
derived from these fields. Options that `MultiHeadAttention` has too (`rope_theta`, `norm_eps`, `dropout`) take
their ranges from `AttentionConfig`'s table (`RANGES`).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._core.errors import ConfigError
from .config import INF, RANGES, Range, check_range

_POSITIVE = "a positive int"
# The sizes: each a positive int (`q_lora_rank` None too: queries projected directly), `d_rope` an even one.
LATENT_RANGES: dict[str, Range] = {
    "d_model": Range(int, 1, None, _POSITIVE),
    "num_heads": Range(int, 1, None, _POSITIVE),
    "kv_lora_rank": Range(int, 1, None, _POSITIVE),
    "d_nope": Range(int, 1, None, _POSITIVE),
    "d_rope": Range(int, 1, None, _POSITIVE),  # and even (`__post_init__` names the fix)
    "d_value": Range(int, 1, None, _POSITIVE),
    "q_lora_rank": Range(int, 1, None, _POSITIVE, optional=True),
    "rope_theta": dataclasses.replace(RANGES["rope_theta"], optional=False),  # MLA always rotates its d_rope part
    "scale": Range(float, 0.0, INF, "a finite positive number", True, True, optional=True),
    "norm_eps": RANGES["norm_eps"],
    "dropout": RANGES["dropout"],
}
LATENT_SIZES = ("d_model", "num_heads", "q_lora_rank", "kv_lora_rank", "d_nope", "d_rope", "d_value")


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """What a `LatentAttention` computes, as one frozen value; `LatentAttention(**fields)` builds it,
    `LatentAttention.from_config(config)` too, and `module.config` describes a built one.

    Each field is the `LatentAttention` constructor keyword of the same name (`d_model` and `num_heads` by
    position too). Validation happens here, on construction (`ConfigError`).

    Example:
        >>> import dataclasses, shapesafe_mha as ssm
        >>> config = ssm.LatentConfig(64, 8, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
        >>> mla = ssm.LatentAttention.from_config(dataclasses.replace(config, q_lora_rank=24))
        >>> mla.config == dataclasses.replace(config, q_lora_rank=24), mla.q_a_proj.out_features
        (True, 24)

    Arguments:
        d_model: width of inputs and outputs.
        num_heads: heads (queries, keys and values alike).
        kv_lora_rank: width of the latent keys and values are rebuilt from (cached).
        d_nope: each query/key head's part without RoPE.
        d_rope: each query/key head's part with RoPE (even), one rotary key for all heads.
        d_value: width of a value head.
        q_lora_rank: width of the queries' bottleneck; None projects queries directly.
        bias: biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (DeepSeek's `attention_bias`).
        rope_theta: base of the rotary frequencies.
        rope_scaling: transformers' `rope_parameters` dict for scaled RoPE ("yarn": DeepSeek-V3, Kimi K2; the
            others `RotaryEmbedding` takes), or None.
        scale: the score scale; None: `(d_nope + d_rope) ** -0.5` (held as None where given equal to it). DeepSeek-V3's
            YaRN multiplies it by the square of its `mscale_all_dim` factor, which `from_hf` reads.
        interleaved: rotate feature pairs `(2i, 2i+1)` (DeepSeek's `rope_interleave`), not `(i, i + d/2)`.
        norm_eps: epsilon of the bottleneck and latent RMSNorms.
        dropout: on the attention probabilities, in training.

    Raises:
        ConfigError: a size is not a positive int, `d_rope` is odd, or an option is out of its range (the
            message names it and the range).
    """

    d_model: int
    num_heads: int
    _: dataclasses.KW_ONLY
    kv_lora_rank: int
    d_nope: int
    d_rope: int
    d_value: int
    q_lora_rank: int | None = None
    bias: bool = False
    rope_theta: float = 10000.0
    interleaved: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    scale: float | None = None
    norm_eps: float = 1e-6
    dropout: float = 0.0

    def __post_init__(self) -> None:
        owner = self.owner + ": "
        for name in LATENT_RANGES:  # (the sizes first, in the constructor's order)
            check_range(owner, name, getattr(self, name), ranges=LATENT_RANGES)
        if self.d_rope % 2:
            raise ConfigError(
                f"{self.owner}: d_rope={self.d_rope} is odd, but rotary embeddings rotate pairs of features; use an "
                f"even d_rope (for example {f'{self.d_rope - 1} or ' if self.d_rope > 1 else ''}{self.d_rope + 1})."
            )
        for name in ("bias", "interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{owner}{name} must be True or False, but got {getattr(self, name)!r}.")
        if self.scale is not None and float(self.scale) == (self.d_nope + self.d_rope) ** -0.5:
            object.__setattr__(self, "scale", None)  # the sizes' default, given: the same layer as without it
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise ConfigError(
                f"{owner}rope_scaling must be a mapping (transformers' rope_parameters) or None, but got "
                f"{self.rope_scaling!r}."
            )

    @property
    def owner(self) -> str:
        """How messages name the layer this describes."""
        return f"LatentAttention(d_model={self.d_model}, num_heads={self.num_heads})"

    @property
    def score_scale(self) -> float:
        """The scores' scale: `scale`, or `(d_nope + d_rope) ** -0.5` where it is None."""
        return (self.d_nope + self.d_rope) ** -0.5 if self.scale is None else float(self.scale)


LATENT_OPTIONS = tuple(f.name for f in dataclasses.fields(LatentConfig))
# What a built `LatentAttention`'s parts were built from: set on a built module, refused (build one that has it).
LATENT_BUILT_FROM = {
    "bias": "projections",
    "rope_theta": "rotary tables",
    "rope_scaling": "rotary tables",
    "norm_eps": "RMSNorms",
    "interleaved": "caches' rotary keys",  # (rotated before they are cached: a cache filled before would mix both)
}
