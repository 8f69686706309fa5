"""`AttentionConfig`: every option of a `MultiHeadAttention`, described and validated once.

The module's constructor keywords, `extra_repr`, `from_config` and what setting an option on a built module
does are derived from these fields: a field added here is listed everywhere those read it.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .._compute.stages import check_groups, check_temperature_tuning, check_variants, positive_count
from .._core.errors import ConfigError
from .._core.messages import divisors, shown


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What a `MultiHeadAttention` computes, as one frozen value; `MultiHeadAttention(**fields)` builds it,
    `MultiHeadAttention.from_config(config)` too, and `module.config` describes a built one.

    Each field is the `MultiHeadAttention` constructor keyword of the same name. Validation happens here, on
    construction (`ConfigError`, never an `assert`): a config that exists can be built.

    Example:
        >>> import dataclasses, shapesafe_mha as ssm
        >>> config = ssm.AttentionConfig(d_model=64, num_heads=8, num_kv_heads=2, window=16)
        >>> attn = ssm.MultiHeadAttention.from_config(dataclasses.replace(config, logit_softcap=30.0))
        >>> attn.config.variants()
        {'window': 16, 'logit_softcap': 30.0}

    Arguments:
        d_model: width of inputs and outputs.
        num_heads: query heads.
        num_kv_heads: key/value heads; None means `num_heads` (MHA), 1 is MQA, any divisor of
            `num_heads` is GQA.
        d_head: width of each head; default `d_model // num_heads` (which must then divide).
        bias: biases on all four projections.
        dropout: dropout on the attention probabilities, in training mode.
        rope_theta: rotary position embeddings with this base (Llama: 10000 or 500000); None: none.
        rope_scaling: transformers' `rope_parameters` dict for scaled RoPE ("llama3", "yarn"; "dynamic" and
            "longrope", whose frequencies follow each call's length, `max(positions) + 1`: decoding then turns
            each step by its own, as a transformers model decoding through its cache does), or None.
        rope_dim: partial rotary: rotate only the first `rope_dim` features of each query and key head
            (even, at most `d_head`), the rest passed through, with the frequencies spaced over those
            `rope_dim` (Phi, StableLM, GLM: transformers' `partial_rotary_factor * head_dim`); default
            `d_head`, every feature.
        rope_interleaved: RoPE pairs adjacent features `(2i, 2i+1)` instead of the halves `(i, i + rope_dim/2)`
            of Llama's `rotate_half` (Cohere, GLM, ERNIE).
        qk_norm: RMS-normalise each head's query and key over `d_head` before RoPE, with learned
            weights (`q_norm`, `k_norm` submodules), as Qwen3 and Gemma 3 do.
        qk_norm_over: "head" (default): each head's `d_head` features, weights `(d_head,)`; "all": every
            head's features together, before the head split (OLMo-2), weights `(num_heads * d_head,)` for
            the queries and `(num_kv_heads * d_head,)` for the keys; "per_head": each head's `d_head` features
            with weights of its own, `(num_heads, d_head)` for the queries and `(num_kv_heads, d_head)` for the
            keys (Cohere's `use_qk_norm`; the norms are then `HeadNorm`s).
        qk_norm_centred: the QK-norm subtracts each head's mean first, a LayerNorm without bias
            (`(x - mean) / sqrt(var + eps) * weight`, Cohere), instead of an RMSNorm; per head only.
        qk_norm_offset: the QK-norm scales by `qk_norm_offset + weight` (Gemma 3, whose checkpoints store
            the scale's offset from 1: `1.0`; the norms are then `OffsetRMSNorm`s); default 0, `nn.RMSNorm`.
        qk_norm_after_rope: the per-head QK-norm comes after RoPE instead of before it (HunYuan), so the
            cached keys are the normalised rotated ones.
        norm_eps: the epsilon of QK-norm.
        window: sliding-window attention: a query sees only the `window` most recent keys,
            itself included (Mistral, Gemma); `new_cache` then keeps only those. Without
            `is_causal` the window bounds only how far back a query sees.
        logit_softcap: cap the scores at `±logit_softcap` smoothly, `c * tanh(scores / c)`, before
            the mask (Gemma 2).
        query_pre_attn_scalar: scale the scores by `query_pre_attn_scalar ** -0.5` instead of
            `d_head ** -0.5` (Gemma 2).
        output_gate: an output gate (Qwen3-Next, Qwen3.5): `q_proj` gives each head `d_head` query features
            and then `d_head` gate features, and the merged heads are multiplied by `sigmoid(gate)` before
            `o_proj`. `q_proj` is then `2 * num_heads * d_head` wide.
        clip_qkv: clamp the projected queries, keys and values to `[-clip_qkv, clip_qkv]` before the head
            split (OLMo, OLMoE; after a QK-norm over every head, before a per-head one).
        attention_sinks: attention sinks (gpt-oss): a learned logit per query head, the `sinks` parameter
            (zeros at first), takes part in each row's softmax and is dropped after it, so a head may give
            less than all of its weight to the keys. The scores are then computed here, not by SDPA.
        temperature_tuning: `(floor_scale, attn_scale)`, Llama 4's temperature tuning of its NoPE layers:
            the queries at cache index `i` (counted over every call into a `kv_cache`) are multiplied by
            `1 + attn_scale * log(1 + floor((i + 1) / floor_scale))` after RoPE and QK-norm (Llama 4:
            `(8192, 0.1)`, on layers without RoPE).
        chunk_size: Llama 4's chunked attention (`attention_chunk_size`): a query sees only the keys of its own
            chunk of `chunk_size` positions (with `is_causal`, those up to itself), the chunks counted from
            each sequence's first real key (after the left padding `key_padding_mask` shows, as transformers
            counts them). Not with a `window`.
        alibi: ALiBi position biases (Bloom, MPT) instead of position embeddings: each head `h` adds
            `alibi_slopes[h] * (kv_pos - q_pos)` to its scores (after the scale and the softcap), the query at
            its lower-right aligned position, so a key `d` positions back costs `d * slope`. `alibi_slopes` is a
            buffer (saved in the state dict), Press et al.'s geometric slopes at first (`2 ** (-8 * h / n)`,
            Bloom's interpolation for a head count not a power of two); overwrite it for others (MPT's). The
            scores are then computed here, not by SDPA.

    Raises:
        ConfigError: a size is not a positive int, `num_kv_heads` does not divide `num_heads`, `d_head` is not
            given and `num_heads` does not divide `d_model`, or an option is out of its range or contradicts
            another (each message names the field and the fix).
    """

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    d_head: int | None = None
    bias: bool = True
    dropout: float = 0.0
    rope_theta: float | None = None
    rope_scaling: Mapping[str, Any] | None = None
    rope_dim: int | None = None
    rope_interleaved: bool = False
    qk_norm: bool = False
    qk_norm_over: str = "head"
    qk_norm_centred: bool = False
    qk_norm_offset: float = 0.0
    qk_norm_after_rope: bool = False
    norm_eps: float = 1e-6
    window: int | None = None
    logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    clip_qkv: float | None = None
    temperature_tuning: tuple[int, float] | None = None
    chunk_size: int | None = None
    attention_sinks: bool = False
    alibi: bool = False
    output_gate: bool = False

    def __post_init__(self) -> None:
        num_heads, d_model = self.num_heads, self.d_model
        num_kv_heads = num_heads if self.num_kv_heads is None else self.num_kv_heads
        owner = self.owner
        for name, size in (("d_model", d_model), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            positive_count(f"{owner}: ", name, size)
        if num_kv_heads > num_heads:
            raise ConfigError(
                f"{owner}: num_kv_heads={num_kv_heads} is more than num_heads={num_heads}; each KV head serves "
                f"a group of query heads, so num_kv_heads must divide num_heads (MQA: 1, MHA: {num_heads})."
            )
        check_groups(num_heads, num_kv_heads, owner)
        if self.d_head is None and d_model % num_heads:
            raise ConfigError(
                f"{owner}: d_model must be num_heads * d_head, and {d_model} is not divisible by {num_heads}; "
                f"pass d_head explicitly or use num_heads in {shown(divisors(d_model), limit=5)}."
            )
        positive_count(f"{owner}: ", "d_head", self.head_width)
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"{owner}: dropout must be a number in [0, 1), but got {dropout!r}.")
        check_variants(
            f"{owner}: ", self.window, self.logit_softcap, self.query_pre_attn_scalar, self.norm_eps, self.clip_qkv
        )
        for name in ("output_gate", "attention_sinks", "alibi"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{owner}: {name} must be True or False, but got {getattr(self, name)!r}.")
        if self.output_gate and ((self.qk_norm_over == "all" and self.qk_norm) or self.clip_qkv is not None):
            raise ConfigError(
                f"{owner}: output_gate=True with a QK-norm over every head or clip_qkv: no model computes them "
                "together, and the gate's place among them is not known."
            )
        self.rotated_width  # noqa: B018  (validates the RoPE options)
        self._check_qk_norm(owner)
        check_temperature_tuning(f"{owner}: ", self.temperature_tuning)
        chunk_size = self.chunk_size
        chunked = chunk_size is not None
        if chunked and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
            raise ConfigError(f"{owner}: chunk_size must be a positive int (Llama 4: 8192), but got {chunk_size!r}.")
        if chunk_size is not None and self.window is not None:
            raise ConfigError(
                f"{owner}: chunk_size={chunk_size} with window={self.window}: no model computes both, and a window "
                "cache would drop keys a chunk still sees; pass one of them."
            )

    def _check_qk_norm(self, owner: str) -> None:
        qk_norm, over, centred, offset, after = (
            self.qk_norm, self.qk_norm_over, self.qk_norm_centred, self.qk_norm_offset, self.qk_norm_after_rope
        )  # fmt: skip
        if over not in ("head", "all", "per_head"):
            raise ConfigError(
                f"{owner}: qk_norm_over must be 'head' (each head's d_head features), 'all' (every head's "
                f"together, OLMo-2) or 'per_head' (each head's, with weights of its own, Cohere), but got {over!r}."
            )
        if not isinstance(centred, bool) or (centred and (not qk_norm or over == "all")):
            raise ConfigError(
                f"{owner}: qk_norm_centred=True needs qk_norm=True over each head (qk_norm_over='head' or "
                f"'per_head'), but got qk_norm_centred={centred!r}, qk_norm={qk_norm!r}, qk_norm_over={over!r}."
            )
        if isinstance(offset, bool) or not isinstance(offset, int | float) or not math.isfinite(offset):
            raise ConfigError(f"{owner}: qk_norm_offset must be a finite number (Gemma 3: 1.0), but got {offset!r}.")
        if offset and (centred or over == "per_head"):
            raise ConfigError(
                f"{owner}: qk_norm_offset={offset!r} with qk_norm_centred={centred!r}, qk_norm_over={over!r}: the "
                "scale 1 + weight is Gemma 3's RMSNorm with one weight for every head; no model offsets a centred "
                "norm or one with weights for each head."
            )
        if not isinstance(after, bool) or (after and (not qk_norm or over != "head" or centred)):
            raise ConfigError(
                f"{owner}: qk_norm_after_rope=True needs qk_norm=True over each head (qk_norm_over='head', an RMSNorm: "
                f"HunYuan's), but got qk_norm_after_rope={after!r}, qk_norm={qk_norm!r}, qk_norm_over={over!r}"
                + (", qk_norm_centred=True." if centred else ".")
            )

    @property
    def owner(self) -> str:
        """How messages name the layer this describes."""
        kv = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        return f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={kv})"

    @property
    def kv_heads(self) -> int:
        """`num_kv_heads`, resolved: `num_heads` where it is None (MHA)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_width(self) -> int:
        """`d_head`, resolved: `d_model // num_heads` where it is None."""
        return self.d_model // self.num_heads if self.d_head is None else self.d_head

    @property
    def rotated_width(self) -> int | None:
        """The rotated width of each head (None without RoPE); `ConfigError` for RoPE options it cannot use."""
        owner, theta, rope_dim, interleaved, d_head = (
            self.owner, self.rope_theta, self.rope_dim, self.rope_interleaved, self.head_width
        )  # fmt: skip
        if theta is None:
            if rope_dim is not None or interleaved:
                given = "rope_dim" if rope_dim is not None else "rope_interleaved"
                raise ConfigError(
                    f"{owner}: {given} was given, but the module has no rotary embeddings (rope_theta=None): nothing "
                    f"would use it. Pass rope_theta=... (Llama: 10000.0), or drop {given}."
                )
            return None
        if not isinstance(interleaved, bool):
            raise ConfigError(f"{owner}: rope_interleaved must be True or False, but got {interleaved!r}.")
        if rope_dim is None:
            return d_head
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 2 <= rope_dim <= d_head or rope_dim % 2:
            near = (rope_dim - 1, rope_dim + 1) if isinstance(rope_dim, int) and not isinstance(rope_dim, bool) else ()
            even = [w for w in near if 2 <= w <= d_head and w % 2 == 0]
            suggestion = f" (for example {even[0]})" if even else ""
            raise ConfigError(
                f"{owner}: rope_dim={rope_dim!r}, but the rotary part of a head must be an even int in "
                f"[2, d_head={d_head}]{suggestion}: rotary embeddings rotate pairs of a head's features."
            )
        return rope_dim

    def variants(self) -> dict[str, Any]:
        """The options (not the sizes) that differ from their defaults and change what is computed, in field
        order (a QK-norm's options without a QK-norm change nothing)."""
        idle = () if self.qk_norm else _QK_NORM_OPTIONS
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in SIZES and f.name not in idle and getattr(self, f.name) != f.default
        }


SIZES = ("d_model", "num_heads", "num_kv_heads", "d_head")
_QK_NORM_OPTIONS = ("qk_norm_over", "qk_norm_centred", "qk_norm_offset", "qk_norm_after_rope", "norm_eps")
OPTIONS = tuple(f.name for f in dataclasses.fields(AttentionConfig))
