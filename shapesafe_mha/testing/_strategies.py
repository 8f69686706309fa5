"""hypothesis strategies for attention configs, inputs, weights and masks.

Configs are valid by construction: draw `num_kv_heads`, then `group`, and set
`num_heads = num_kv_heads * group`, so hypothesis shrinks failures to small, valid configs.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from hypothesis import strategies as st
from torch import Tensor

from .._core.weights import AttentionWeights

Kind = Literal["mha", "gqa", "mqa"]
ALL_KINDS: tuple[Kind, ...] = ("mha", "gqa", "mqa")
"""Every kind of attention the strategies draw: `kinds=ALL_KINDS` is the default of `attention_configs`."""


@dataclass(frozen=True)
class AttentionConfig:
    """One attention layer's sizes, as drawn by `attention_configs`."""

    batch: int
    seq: int
    kv_seq: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_head: int
    bias: bool
    rope_theta: float | None = None  # rotary position embeddings (d_head is then even)
    bias_on: str = "qkvo"  # which projections have a bias when `bias` (Qwen2: "qkv")

    def has_bias(self, projection: str) -> bool:
        """Whether projection `q`, `k`, `v` or `o` has a bias in this config."""
        return self.bias and projection in self.bias_on

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kind(self) -> Kind:
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def module(self, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Any:
        """A `MultiHeadAttention` of this config (random weights)."""
        from .._modules.multihead import MultiHeadAttention

        return MultiHeadAttention(
            self.d_model,
            self.num_heads,
            self.num_kv_heads,
            d_head=self.d_head,
            bias=self.bias,
            rope_theta=self.rope_theta,
            dtype=dtype,
            device=device,
        )


@dataclass(frozen=True)
class AttentionInputs:
    """`query (batch, seq, d_model)`, `key` and `value` `(batch, kv_seq, d_model)`."""

    query: Tensor
    key: Tensor
    value: Tensor


def _heads(draw: Any, kind: Kind, max_heads: int) -> tuple[int, int]:
    if kind == "mha":
        num_heads = draw(st.integers(1, max_heads))
        return num_heads, num_heads
    if kind == "mqa":
        return draw(st.integers(min(2, max_heads), max_heads)), 1
    num_kv_heads = draw(st.integers(2, max(2, max_heads // 2)))
    group = draw(st.integers(2, max(2, max_heads // num_kv_heads)))
    return num_kv_heads * group, num_kv_heads


# Where attention code commonly switches paths: powers of two (blocks, tiles, kernel cut-offs).
_POWERS_OF_TWO = tuple(2**k for k in range(1, 14))
# Beyond this many positions a drawn config keeps its heads and widths small, so it stays cheap.
_LONG = 32


def boundary_sizes(max_seq: int, thresholds: Sequence[int] = ()) -> list[int]:
    """Sizes on purpose at both sides of each power of two and each threshold, up to `max_seq`, ascending.

    Example:
        >>> from shapesafe_mha.testing import boundary_sizes
        >>> boundary_sizes(20, thresholds=(10,))
        [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 15, 16, 17]
    """
    sizes = {1}
    for edge in (*_POWERS_OF_TWO, *thresholds):
        sizes.update((edge - 1, edge, edge + 1))
    return sorted(s for s in sizes if 1 <= s <= max_seq)


def sequence_lengths(max_seq: int = 512, thresholds: Sequence[int] = ()) -> st.SearchStrategy[int]:
    """Draw a sequence length: mostly small, some at the boundaries, some anywhere up to `max_seq`.

    Half the draws are 1 to 8 (cheap, and where most bugs show); a quarter are boundary values
    (`boundary_sizes`: each power of two and each of `thresholds`, and one either side); a quarter
    are uniform up to `max_seq`. A failure shrinks to the smallest length that still fails, so a
    report says where a threshold is ("seq=9": the first length past 8).

    Example:
        >>> from hypothesis import given, settings
        >>> from shapesafe_mha.testing import sequence_lengths
        >>> seen = []
        >>> @settings(max_examples=200, derandomize=True, database=None)
        ... @given(sequence_lengths(512, thresholds=(300,)))
        ... def collect(n):
        ...     seen.append(n)
        >>> collect()
        >>> min(seen) == 1 and max(seen) > 256 and 301 in seen
        True
    """
    if not isinstance(max_seq, int) or max_seq < 1:
        raise ValueError(f"max_seq must be a positive int, got {max_seq!r}")
    bad = [t for t in thresholds if not isinstance(t, int) or t < 1]
    if bad:
        raise ValueError(f"thresholds must be positive ints (sizes where the implementation switches), got {bad}")
    small = st.integers(1, min(8, max_seq))
    edges = st.sampled_from(boundary_sizes(max_seq, thresholds))
    anywhere = st.integers(1, max_seq)
    return st.one_of(small, small, edges, anywhere)


@st.composite
def attention_configs(
    draw: Any,
    kinds: Sequence[Kind] = ALL_KINDS,
    *,
    max_heads: int = 8,
    max_seq: int = 512,
    max_batch: int = 3,
    max_d_head: int = 8,
    bias: bool | str | None = None,
    cross: bool = True,
    thresholds: Sequence[int] = (),
    rope: bool = False,
    even_d_head: bool = False,
    d_model_is_inner: bool = False,
) -> AttentionConfig:
    """Draw a valid `AttentionConfig` of one of `kinds`.

    Covers the cases bugs hide behind: batch > 1, seq > 1, `kv_seq != seq` (if `cross`),
    `group > 2`, `d_head = 1`, MQA, `num_heads * d_head != d_model`, and sequence lengths across
    the sizes where implementations switch paths (see `sequence_lengths`; pass your own
    `thresholds`). Long sequences come with small heads and widths, so every example stays cheap.
    `rope=True` also draws a `rope_theta` (and an even `d_head`) for rotary position embeddings.

    Constraints that real code has: `bias` is drawn (None), on or off for all four projections
    (True, False), or on for the projections a string names (`"qkv"`: Qwen2's q/k/v biases and
    no output bias; `""`: none, as Mistral); `max_heads` bounds `num_heads`; `even_d_head=True`
    draws only even head widths (RoPE); `d_model_is_inner=True` keeps `d_model == num_heads * d_head`
    (layers that reshape `d_model` into heads, as GPT-2 and most of transformers).

    Example:
        >>> from hypothesis import given, settings
        >>> from shapesafe_mha.testing import attention_configs
        >>> @settings(max_examples=20)
        ... @given(attention_configs(kinds=("gqa",)))
        ... def test_groups(config):
        ...     assert config.num_heads % config.num_kv_heads == 0 and config.num_kv_heads > 1
        >>> test_groups()
    """
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {ALL_KINDS}, got {tuple(kinds)}")
    kind = draw(st.sampled_from(tuple(kinds)))
    seq = draw(sequence_lengths(max_seq, thresholds), label="seq")
    kv_seq = draw(sequence_lengths(max_seq, thresholds), label="kv_seq") if cross else seq
    if max(seq, kv_seq) > _LONG:  # long: keep the rest small
        max_heads, max_d_head, max_batch = min(max_heads, 4), min(max_d_head, 4), min(max_batch, 2)
    num_heads, num_kv_heads = _heads(draw, kind, max(4 if kind == "gqa" else 2, max_heads))
    d_head = draw(st.integers(1, max_d_head))
    rope_theta = None
    if rope or even_d_head:
        d_head = 2 * max(1, d_head // 2)  # rotary embeddings rotate pairs of features
    if rope:
        rope_theta = draw(st.sampled_from([10.0, 10000.0, 500000.0]))
    if d_model_is_inner:
        d_model = num_heads * d_head
    else:
        d_model = draw(st.one_of(st.just(num_heads * d_head), st.integers(1, 4 * max_d_head)))
    if isinstance(bias, str):
        unknown = set(bias) - set("qkvo")
        if unknown:
            raise ValueError(f"bias names the projections with a bias, a subset of 'qkvo'; got {bias!r}")
        has_bias, bias_on = bool(bias), bias
    else:
        has_bias, bias_on = (draw(st.booleans()) if bias is None else bias), "qkvo"
    return AttentionConfig(
        batch=draw(st.integers(1, max_batch)),
        seq=seq,
        kv_seq=kv_seq,
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        d_head=d_head,
        bias=has_bias,
        rope_theta=rope_theta,
        bias_on=bias_on,
    )


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, device: Any) -> Tensor:
    # Drawn on the CPU from a seed, so a failure replays identically on every device.
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)


@st.composite
def attention_inputs(
    draw: Any, config: AttentionConfig, *, dtype: torch.dtype = torch.float64, device: Any = None
) -> AttentionInputs:
    """Draw `query`, `key`, `value` for `config` (from a drawn seed: hypothesis replays it exactly)."""
    generator = _generator(draw(st.integers(0, 2**32 - 1)))
    query = _randn(generator, config.batch, config.seq, config.d_model, dtype=dtype, device=device)
    key = _randn(generator, config.batch, config.kv_seq, config.d_model, dtype=dtype, device=device)
    value = _randn(generator, config.batch, config.kv_seq, config.d_model, dtype=dtype, device=device)
    return AttentionInputs(query, key, value)


@st.composite
def projection_weights(
    draw: Any, config: AttentionConfig, *, dtype: torch.dtype = torch.float64, device: Any = None
) -> AttentionWeights:
    """Draw an `AttentionWeights` for `config` (scaled like `nn.Linear`'s initialisation).

    A projection has a bias where `config.has_bias` says so. (Named so that it does not clash with
    `shapesafe_mha.attention_weights`, the stage that computes softmax scores.)
    """
    generator = _generator(draw(st.integers(0, 2**32 - 1)))
    inner, kv_inner = config.num_heads * config.d_head, config.num_kv_heads * config.d_head

    def linear(d_out: int, d_in: int, name: str) -> tuple[Tensor, Tensor | None]:
        weight = _randn(generator, d_out, d_in, dtype=dtype, device=device) / d_in**0.5
        bias = _randn(generator, d_out, dtype=dtype, device=device) if config.bias else None
        return weight, bias if config.has_bias(name) else None

    w_q, b_q = linear(inner, config.d_model, "q")
    w_k, b_k = linear(kv_inner, config.d_model, "k")
    w_v, b_v = linear(kv_inner, config.d_model, "v")
    w_o, b_o = linear(config.d_model, inner, "o")
    return AttentionWeights(w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)


@st.composite
def attention_masks(draw: Any, config: AttentionConfig, *, device: Any = None) -> Tensor | None:
    """Draw None or a bool mask (True = may attend) in one of the accepted layouts.

    Layouts: `(seq, kv_seq)`, `(batch, 1, seq, kv_seq)`, `(1, num_heads, seq, kv_seq)`,
    `(batch, num_heads, seq, kv_seq)`. Rows with nothing to attend to are allowed.
    """
    layout = draw(st.sampled_from(["none", "2d", "batch", "heads", "full"]))
    if layout == "none":
        return None
    shape = {
        "2d": (config.seq, config.kv_seq),
        "batch": (config.batch, 1, config.seq, config.kv_seq),
        "heads": (1, config.num_heads, config.seq, config.kv_seq),
        "full": (config.batch, config.num_heads, config.seq, config.kv_seq),
    }[layout]
    generator = _generator(draw(st.integers(0, 2**32 - 1)))
    keep = draw(st.sampled_from([0.5, 0.8, 0.95]))
    return (torch.rand(shape, generator=generator) < keep).to(device)


@st.composite
def key_padding_masks(draw: Any, config: AttentionConfig, *, device: Any = None) -> Tensor | None:
    """Draw None or a `(batch, kv_seq)` bool mask, True = padding (right-padded sequences)."""
    if not draw(st.booleans()):
        return None
    lengths = draw(st.lists(st.integers(0, config.kv_seq), min_size=config.batch, max_size=config.batch))
    positions = torch.arange(config.kv_seq)
    return (positions[None, :] >= torch.tensor(lengths)[:, None]).to(device)
