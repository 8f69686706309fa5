"""`AttentionConfig`: every option of a `MultiHeadAttention`, described and validated once.

The module's constructor keywords, `extra_repr`, `from_config` and what setting an option on a built module
does are derived from these fields: a field added here is listed everywhere those read it.
"""

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from .._core.errors import ConfigError

if TYPE_CHECKING:  # (torch is imported by what uses them: the command line's help imports none)
    from .._core.weights import AttentionWeights


@dataclasses.dataclass(frozen=True)
class Range:
    """The values an option takes: a `kind` (`int`: an int; `float`: any int or float; a bool is neither) from
    `low` to `high`, each bound inclusive unless `low_open`/`high_open` (None: no bound; a string: the config's
    resolved size of that name, such as "d_head"). `optional`: None is accepted too (the option off).
    `plain`: the range says all there is, so `AttentionConfig.__post_init__` checks it from here; otherwise a
    rule of the option's own (an even width, a message that names the fix) checks it and the table only
    declares it (for tests and readers). `says`: the range in a message's words; `label`: how the message
    names the option, where that differs from its name; `step`: an int's values lie that far apart from `low`
    (2: the even widths)."""

    kind: type
    low: float | str | None
    high: float | str | None
    says: str
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    plain: bool = True
    label: str | None = None
    step: int = 1

    def bound(self, bound: float | str | None, config: "AttentionConfig | None") -> float | None:
        """A bound as a number: a named size resolved against `config` (needed for such a bound)."""
        if isinstance(bound, str):
            return float(getattr(config, _RESOLVED.get(bound, bound)))
        return bound

    def holds(self, value: Any, config: "AttentionConfig | None", upper: bool = True) -> bool:
        """Whether `value` is of this kind and within both bounds (NaN is within none; `upper=False`: above the
        lower one)."""
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int else int | float):
            return False
        low, high = self.bound(self.low, config), self.bound(self.high, config) if upper else None
        if self.kind is int and low is not None and (value - low) % self.step:
            return False
        above = low is None or (value > low if self.low_open else value >= low)
        below = high is None or (value < high if self.high_open else value <= high)
        return bool(above and below)


def check_range(
    owner: str,
    name: str,
    value: Any,
    config: "AttentionConfig | None" = None,
    upper: bool = True,
    ranges: "Mapping[str, Range] | None" = None,
) -> None:
    """`ConfigError` naming the option `name` (as `owner` begins it) and its range (`ranges`, default `RANGES`)
    unless `value` is within it (`upper`: its upper bound too; `config`: the sizes a bound names)."""
    edges = (RANGES if ranges is None else ranges)[name]
    if not edges.holds(value, config, upper):
        raise ConfigError(f"{owner}{edges.label or name} must be {edges.says}, but got {value!r}.")


def check_groups(num_heads: int, num_kv_heads: int, owner: str) -> None:
    """Raise `ConfigError` unless `num_kv_heads` divides `num_heads`."""
    if num_heads % num_kv_heads == 0:
        return
    from .._core.messages import divisors  # (torch's floor: `shapesafe-mha --help` reads this module without it)

    raise ConfigError(
        f"{owner}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; each KV head serves "
        f"a group of query heads, so num_kv_heads must be one of {divisors(num_heads)}."
    )


def check_temperature_tuning(owner: str, tuning: Any) -> tuple[int, float] | None:
    """`(floor_scale, attn_scale)` from `tuning`, or None; `ConfigError` unless a positive int and a finite number."""
    if tuning is None:
        return None
    pair = tuple(tuning) if isinstance(tuning, tuple | list) else ()
    if (
        len(pair) != 2
        or isinstance(pair[0], bool)
        or not isinstance(pair[0], int)
        or pair[0] < 1
        or isinstance(pair[1], bool)
        or not isinstance(pair[1], int | float)
        or not math.isfinite(pair[1])
    ):
        raise ConfigError(
            f"{owner}temperature_tuning must be (floor_scale, attn_scale): a positive int and a finite number "
            f"(Llama 4: (8192, 0.1)), but got {tuning!r}."
        )
    return pair[0], float(pair[1])


INF = math.inf
_POSITIVE_INT = "a positive int"
_FINITE_POSITIVE = "a finite positive number"

# Every numeric option's range, once: `__post_init__` checks the plain ones from here, tests try each bound and
# one value past it on either side (tests/test_option_edges.py). An option that is no number is in NON_NUMERIC.
RANGES: dict[str, Range] = {
    "d_model": Range(int, 1, None, _POSITIVE_INT),
    "num_heads": Range(int, 1, None, _POSITIVE_INT),
    # each KV head serves a group of query heads: at most num_heads of them (and a divisor: `check_groups`)
    "num_kv_heads": Range(int, 1, "num_heads", _POSITIVE_INT, optional=True, plain=False),
    "d_head": Range(int, 1, None, _POSITIVE_INT, optional=True),
    "dropout": Range(float, 0.0, 1.0, "a number in [0, 1)", high_open=True),
    "rope_theta": Range(float, 0.0, INF, "a positive finite number (Llama: 10000.0)", True, True, optional=True),
    # the rotated pairs of a head's features: an even width up to d_head (`rotated_width` checks it)
    "rope_dim": Range(int, 2, "d_head", "an even int in [2, d_head]", optional=True, plain=False, step=2),
    "qk_norm_offset": Range(float, -INF, INF, "a finite number (Gemma 3: 1.0)", True, True),
    "norm_eps": Range(float, 0.0, INF, "a finite number >= 0", high_open=True),
    "window": Range(int, 1, None, "a positive int (the keys a query sees, itself included)", optional=True),
    "logit_softcap": Range(float, 0.0, INF, _FINITE_POSITIVE, True, True, optional=True, label="logit softcap"),
    "query_pre_attn_scalar": Range(float, 0.0, INF, _FINITE_POSITIVE, True, True, optional=True),
    "clip_qkv": Range(float, 0.0, INF, _FINITE_POSITIVE, True, True, optional=True),
    "chunk_size": Range(int, 1, None, "a positive int (Llama 4: 8192)", optional=True),
    "differential_lambda_init": Range(
        float, -INF, INF, "a finite number (DiffLlama: 0.8 - 0.6 * exp(-0.3 * layer_idx))", True, True, optional=True
    ),
}

# The options that are no number on a line, and what they are instead (each checked by a rule of its own).
NON_NUMERIC: dict[str, str] = {
    "bias": "True or False",
    "rope_scaling": "a rope_scaling mapping, as transformers' rope_parameters (checked by RotaryEmbedding)",
    "rope_interleaved": "True or False",
    "qk_norm": "True or False",
    "qk_norm_over": "'head', 'all' or 'per_head'",
    "qk_norm_centred": "True or False",
    "qk_norm_after_rope": "True or False",
    "temperature_tuning": "None or a pair (floor_scale: a positive int, attn_scale: a finite number)",
    "attention_sinks": "True or False",
    "alibi": "True or False",
    "output_gate": "True or False",
}

# The options whose value is a size that some stage's shape shows (a verdict's constants: `_constants`).
SIZED = ("window", "rope_dim")
# The options that take one of a few words, and those words.
CHOICES: dict[str, tuple[str, ...]] = {"qk_norm_over": ("head", "all", "per_head")}
# A flag's False where it has a name of its own (RoPE on halves, an RMSNorm, a QK-norm before RoPE): the CLI's
# `--rope-interleaved/--rope-halves`; every other flag's False is `no-` and its name.
OPPOSITES = {
    "rope_interleaved": "rope-halves",
    "qk_norm_centred": "qk-norm-rms",
    "qk_norm_after_rope": "qk-norm-before-rope",
}

_RESOLVED = {"num_heads": "num_heads", "d_head": "head_width"}  # a bound's name -> the config's resolved value


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
        norm_eps: the epsilon of QK-norm, and of differential attention's norm of each head pair.
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
        differential_lambda_init: differential attention (Ye et al. 2024, DiffLlama) with this `lambda_init`
            (DiffLlama: `0.8 - 0.6 * exp(-0.3 * layer_idx)`); None: none. Query heads `p` and `p + num_heads/2` make a
            pair; they read KV heads `j` and `j + num_kv_heads/2`, whose values side by side (`2 * d_head` wide) are
            the pair's; its output is `(1 - lambda_init) * rms_norm((A_p - lambda * A_{p + num_heads/2}) [v_j;
            v_{j + num_kv_heads/2}])` over those `2 * d_head` features (`norm_eps`, no weight), each `A` one head's
            attention probabilities, and `lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) +
            lambda_init` from four learned `(d_head,)` parameters of those names (normal(0, 0.1) at first; each
            exponential computed in float32, as DiffLlama computes it). Needs an even `num_kv_heads` and no dropout
            (DiffLlama's); with `need_weights` the probabilities returned are each head's `A`.

    Raises:
        ConfigError: a size is not a positive int, `num_kv_heads` does not divide `num_heads`, `d_head` is not
            given and `num_heads` does not divide `d_model`, or an option is out of its range or contradicts
            another (each message names the field and the fix).
    """

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    _: dataclasses.KW_ONLY  # every field after the three sizes is a keyword (as the module's constructor takes it)
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
    differential_lambda_init: float | None = None

    def __post_init__(self) -> None:
        num_heads, d_model = self.num_heads, self.d_model
        owner = self.owner
        for name in SIZES[:3]:  # the sizes first: every other check reads them (more KV heads than query
            self._check_range(owner, name, upper=name != "num_kv_heads")  # heads: the message below says why)
        num_kv_heads = self.kv_heads
        if num_kv_heads > num_heads:
            raise ConfigError(
                f"{owner}: num_kv_heads={num_kv_heads} is more than num_heads={num_heads}; each KV head serves "
                f"a group of query heads, so num_kv_heads must divide num_heads (MQA: 1, MHA: {num_heads})."
            )
        check_groups(num_heads, num_kv_heads, owner)
        if self.d_head is None and d_model % num_heads:
            from .._core.messages import divisors, shown  # (torch's floor: see `check_groups`)

            raise ConfigError(
                f"{owner}: d_model must be num_heads * d_head, and {d_model} is not divisible by {num_heads}; "
                f"pass d_head explicitly or use num_heads in {shown(divisors(d_model), limit=5)}."
            )
        for name, edges in RANGES.items():
            if edges.plain and name not in SIZES[:3]:
                self._check_range(owner, name)
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
        self._check_differential(owner)
        if self.chunk_size is not None and self.window is not None:
            raise ConfigError(
                f"{owner}: chunk_size={self.chunk_size} with window={self.window}: no model computes both, and a "
                "window cache would drop keys a chunk still sees; pass one of them."
            )

    def _check_range(self, owner: str, name: str, upper: bool = True) -> None:
        """`ConfigError` naming the option and its range (`RANGES`) unless its value is within it (`upper`:
        its upper bound too)."""
        check_range(f"{owner}: ", name, getattr(self, name), self, upper)

    def _check_differential(self, owner: str) -> None:
        if self.differential_lambda_init is None:
            return
        lambda_init = self.differential_lambda_init
        if self.kv_heads % 2:
            raise ConfigError(
                f"{owner}: differential_lambda_init={lambda_init!r} needs an even num_kv_heads: differential attention "
                f"pairs KV head j with j + num_kv_heads/2 (DiffLlama's values split in two), but got {self.kv_heads}."
            )
        if self.dropout or self.output_gate:
            given = f"dropout={self.dropout!r}" if self.dropout else "output_gate=True"
            raise ConfigError(
                f"{owner}: differential_lambda_init={lambda_init!r} with {given}: no model computes them together "
                "(DiffLlama refuses dropout, whose place between its two maps is not defined); drop one of them."
            )

    def _check_qk_norm(self, owner: str) -> None:
        qk_norm, over, centred, offset, after = (
            self.qk_norm, self.qk_norm_over, self.qk_norm_centred, self.qk_norm_offset, self.qk_norm_after_rope
        )  # fmt: skip
        if over not in CHOICES["qk_norm_over"]:
            raise ConfigError(
                f"{owner}: qk_norm_over must be 'head' (each head's d_head features), 'all' (every head's "
                f"together, OLMo-2) or 'per_head' (each head's, with weights of its own, Cohere), but got {over!r}."
            )
        if not isinstance(centred, bool) or (centred and (not qk_norm or over == "all")):
            raise ConfigError(
                f"{owner}: qk_norm_centred=True needs qk_norm=True over each head (qk_norm_over='head' or "
                f"'per_head'), but got qk_norm_centred={centred!r}, qk_norm={qk_norm!r}, qk_norm_over={over!r}."
            )
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
    def score_scale(self) -> float | None:
        """The scores' scale the options fix: `query_pre_attn_scalar ** -0.5`, or None (SDPA's `d_head ** -0.5`)."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def query_rows(self) -> int:
        """The rows of `q_proj`: each head's `d_head` queries, and with an output gate its `d_head` gate features."""
        return self.num_heads * self.head_width * (2 if self.output_gate else 1)

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
        if self.differential_lambda_init is not None:  # its norm's epsilon is norm_eps
            idle = tuple(name for name in idle if name != "norm_eps")
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in SIZES and f.name not in idle and getattr(self, f.name) != f.default
        }

    def across_heads(self) -> str | None:
        """Why a rank holding some of the heads cannot compute this layer (head parallelism), or None."""
        if self.differential_lambda_init is not None:
            return (
                "differential attention (DiffLlama) pairs query head p with p + num_heads/2 and KV head j with j + "
                "num_kv_heads/2, so a rank holding a contiguous share of the heads cannot compute it; run it unsplit."
            )
        if self.qk_norm and self.qk_norm_over == "all":
            return (
                "qk_norm_over='all' normalises every head's features together (OLMo-2), so a rank holding some of the "
                "heads cannot compute it; only a QK-norm of each head (qk_norm_over='head' or 'per_head') is split by "
                "heads."
            )
        return None

    def held(self) -> dict[str, Any]:
        """The attributes a `MultiHeadAttention` built from this holds: each option its parts do not hold
        (`HELD_BY_PARTS`), as it holds it (`HELD_AS`); the sizes resolved, and `rope_dim` the rotated width."""
        held = {name: HELD_AS.get(name, _same)(getattr(self, name)) for name in OPTIONS if name not in NOT_HELD}
        return held | {"num_kv_heads": self.kv_heads, "d_head": self.head_width, "rope_dim": self.rotated_width}


def described(name: str) -> str:
    """The `Arguments:` entry of the field `name` in `AttentionConfig`'s docstring, the one description of each
    option, on one line ("" where the docstrings are stripped, `python -OO`)."""
    found = re.search(rf"^ {{8}}{name}: (.*?)(?=^ {{8}}\w+:|^ {{4}}\w|\Z)", AttentionConfig.__doc__ or "", re.M | re.S)
    return " ".join(found.group(1).split()) if found else ""


def _same(value: Any) -> Any:
    return value


def copied(mapping: Any) -> Any:
    """A mapping a part holds, as a config holds it: a copy (editing the config's must not edit the part's)."""
    return None if mapping is None else dict(mapping)


P = ParamSpec("P")


def constructor_of(options: Callable[P, Any]) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """A decorator that gives an `__init__(self, *args, **kwargs)` the parameters of `options` (a class, whose
    constructor takes them): for type checkers (its type) and for `help()` and `inspect.signature` (its
    `__signature__`). The `__init__` binds them itself (`bind`)."""
    signature = inspect.signature(options)
    itself = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def give(init: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        init.__signature__ = signature.replace(parameters=[itself, *signature.parameters.values()])  # type: ignore[attr-defined]
        return init

    return give


@functools.cache
def _signature(options: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(options)


def bind(owner: str, options: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call to `options`' constructor, every parameter named (its default where not given); a
    `TypeError` naming `owner` and the keyword or count that does not fit."""
    try:
        bound = _signature(options).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{owner}() {error}") from None
    bound.apply_defaults()
    return bound.arguments


SIZES = ("d_model", "num_heads", "num_kv_heads", "d_head")
_QK_NORM_OPTIONS = ("qk_norm_over", "qk_norm_centred", "qk_norm_offset", "qk_norm_after_rope", "norm_eps")
OPTIONS = tuple(f.name for f in dataclasses.fields(AttentionConfig))


# How a built `MultiHeadAttention` holds each option, for its `__setattr__` and `config` (a field added above and
# held another way than as an attribute of its own name, unchanged, is listed here).
# BUILT_FROM: the parts built from an option; set on a built module it is refused (build one that has it).
BUILT_FROM = {
    "bias": "projections",
    "rope_theta": "rotary tables",
    "rope_scaling": "rotary tables",
    "rope_dim": "rotary tables",
    "rope_interleaved": "rotary tables",
    "qk_norm": "QK-norm modules",
    "qk_norm_over": "QK-norm modules",
    "qk_norm_centred": "QK-norm modules",
    "qk_norm_offset": "QK-norm modules",
    "qk_norm_after_rope": "QK-norm modules",
    "norm_eps": "QK-norm modules",
    "attention_sinks": "sinks parameter",
    "alibi": "ALiBi slopes",
    "output_gate": "q_proj",
    "differential_lambda_init": "lambda parameters",
    "clip_qkv": "caches' keys and values",  # (clipped before they are cached: a cache filled before would mix both)
}


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


# HELD_AS: an option as a built module holds it (validated by the config first).
HELD_AS: dict[str, Callable[[Any], Any]] = {
    "clip_qkv": _number,
    "temperature_tuning": lambda tuning: check_temperature_tuning("", tuning),
    "qk_norm_offset": float,
}


def parts_eps(module: Any, names: tuple[str, ...], held: float) -> float:
    """The epsilon a module's norms `names` hold now (an `eps` set on one of them is followed), `held` where none
    holds one; parts that disagree cannot be described by one `norm_eps`: `ConfigError`."""
    from torch import nn  # (here: the config is read before torch is imported, by the CLI's help)

    from .._compute.norms import HeadNorm, OffsetRMSNorm

    kinds = (nn.RMSNorm, OffsetRMSNorm, HeadNorm)  # the kinds the library builds: a norm of the user's kind is theirs
    parts = {name: part for name in names if isinstance(part := module._modules.get(name), kinds)}
    found = {name: part.eps for name, part in parts.items() if part.eps is not None}
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{name}.eps={eps!r}" for name, eps in found.items())
        raise ConfigError(
            f"{type(module).__name__}: {shown}: its config holds one norm_eps, so these must agree. Set them to one "
            "value, or build the module you want with from_config(dataclasses.replace(module.config, norm_eps=...))."
        )
    eps = next(iter(found.values()), held)
    if eps != held and getattr(module, "differential_lambda_init", None) is not None:
        raise ConfigError(
            f"{type(module).__name__}: the QK-norms' eps is {eps!r}, but differential attention's norm holds "
            f"norm_eps={held!r}: one config holds one norm_eps. Build the module you want with "
            "from_config(dataclasses.replace(module.config, norm_eps=...))."
        )
    return eps


# HELD_BY_PARTS: an option a built module's parts hold, not an attribute of its name: how `config` reads it back.
HELD_BY_PARTS: dict[str, Callable[[Any], Any]] = {
    "norm_eps": lambda module: parts_eps(module, ("q_norm", "k_norm"), module.norm_eps),
    "bias": lambda module: module.q_proj.bias is not None,
    "rope_scaling": lambda module: copied(getattr(module._modules.get("rotary"), "scaling", None)),
    "rope_dim": lambda module: None if module.rope_dim == module.d_head else module.rope_dim,
    "attention_sinks": lambda module: module._parameters.get("sinks") is not None,
    "alibi": lambda module: module._buffers.get("alibi_slopes") is not None,
}
# Held by the parts only (norm_eps is also an attribute: differential attention's norm, and where no part holds one).
NOT_HELD = HELD_BY_PARTS.keys() - {"norm_eps"}


def of_reference(weights: "AttentionWeights", **keywords: Any) -> tuple[AttentionConfig, dict[str, Any]]:
    """The `AttentionConfig` that `per_head_attention`'s keywords describe, and the keywords left to pass beside it
    (masks, positions, `scale`, the options' tensors): `per_head_attention(q, k, v, weights, config, **rest)` computes
    what `per_head_attention(q, k, v, weights, **keywords)` does (the QK-norm's weights as its scales, no offset).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha._modules.config import of_reference
        >>> m = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
        >>> config, rest = of_reference(m.weights(), num_heads=4, num_kv_heads=2, window=3, is_causal=True)
        >>> config.variants(), rest
        ({'window': 3}, {'is_causal': True})

    Raises:
        ConfigError: the keywords describe no layer an `AttentionConfig` can (its message names the option).
    """
    from .._compute.reference import DESCRIBED, per_head_attention  # (imports torch: not at the config's import)

    parameters = inspect.signature(per_head_attention).parameters
    given = {name: p.default for name, p in parameters.items() if p.default is not p.empty} | keywords
    num_heads, rope, norm = given["num_heads"], given["rope_theta"] is not None, given["qk_norm"] is not None
    d_head = weights.w_q.shape[0] // num_heads
    partial = rope and given["rotary_dim"] not in (None, d_head)  # every feature rotated: the config's default
    config = AttentionConfig(
        weights.w_q.shape[1], num_heads, given["num_kv_heads"], d_head=d_head,
        rope_theta=given["rope_theta"], rope_dim=given["rotary_dim"] if partial else None,
        rope_interleaved=rope and given["rope_style"] == "interleaved", qk_norm=norm,
        qk_norm_over=given["qk_norm_over"] if norm else "head", qk_norm_centred=norm and given["qk_norm_centred"],
        qk_norm_after_rope=norm and given["qk_norm_after_rope"], norm_eps=given["norm_eps"], window=given["window"],
        logit_softcap=given["logit_softcap"], clip_qkv=given["clip_qkv"], chunk_size=given["chunk_size"],
        temperature_tuning=given["temperature_tuning"], attention_sinks=given["sinks"] is not None,
        alibi=given["alibi_slopes"] is not None, output_gate=given["output_gate"] is not None,
        differential_lambda_init=None if given["differential"] is None else given["differential"][4],
    )  # fmt: skip
    return config, {name: value for name, value in keywords.items() if name not in DESCRIBED}
