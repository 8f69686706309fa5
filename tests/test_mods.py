"""check_attention and check_module check users' variants through FlexAttention's score_mod and mask_mod.

Each variant is a correct implementation that passes with the mod that describes it, and the same
implementation with one classic mistake planted, whose report names the property and the mistake.
"""

import re
from collections.abc import Callable
from typing import Any, Literal

import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import create_block_mask

import shapesafe_mha as ssm
from shapesafe_mha import AttentionWeights, ConfigError
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import ALL_KINDS, AttentionConfig, check_attention, check_module

EXAMPLES = 15  # per check: each draw runs the reference head by head, so keep the budget small (CI has 2 cores)


def heads_of(x: Tensor, w: AttentionWeights, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    q = ssm.split_heads(ssm.project(x, w.w_q, w.b_q), num_heads)
    k = ssm.split_heads(ssm.project(x, w.w_k, w.b_k), num_kv_heads)
    v = ssm.split_heads(ssm.project(x, w.w_v, w.b_v), num_kv_heads)
    return q, k, v


def out_of(heads: Tensor, w: AttentionWeights) -> Tensor:
    return ssm.project(ssm.merge_heads(heads), w.w_o, w.b_o)


def report_of(check: Callable[[], None]) -> str:
    with pytest.raises(AssertionError) as failure:
        check()
    return str(failure.value)


# --- a per-head temperature ------------------------------------------------------------------------------


def temperature(h: Tensor) -> Tensor:
    """Query head h's temperature: every head its own."""
    return 1.0 + 0.5 * h


def temperature_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score / temperature(h)


def tempered(per_kv_head: bool = False) -> Callable[..., Tensor]:
    """Attention whose query head h divides its scores by its temperature; the bug indexes it per KV head."""

    def fn(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **mods: Any
    ) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        heads = torch.arange(num_heads)
        if per_kv_head:
            heads = heads // (num_heads // num_kv_heads)
        scaled = q / temperature(heads).to(q.dtype)[:, None, None]
        return out_of(ssm.scaled_dot_product_attention(scaled, k, v, is_causal=is_causal), w)

    return fn


def test_a_per_head_temperature_passes_with_its_score_mod() -> None:
    """The variant is checked as it is (not only at temperature 1), GQA and MQA included, causal too."""
    check_attention(tempered(), score_mod=temperature_mod, max_examples=EXAMPLES)
    check_attention(tempered(), score_mod=temperature_mod, is_causal=True, max_examples=EXAMPLES)


def test_a_temperature_indexed_per_kv_head_is_caught_and_named() -> None:
    """Temperature[h // group] for temperature[h]: same under MHA, wrong under GQA; the report says which mistake."""
    report = report_of(
        lambda: check_attention(tempered(per_kv_head=True), score_mod=temperature_mod, max_examples=EXAMPLES)
    )
    assert "property: the reference applies score_mod=temperature_mod on each query head's scaled scores" in report
    # On a degenerate smallest example (a temperature of 1 at KV head 0) "not applied" matches too, and is listed first.
    bug_class = next(line for line in report.splitlines() if line.lstrip().startswith("bug class:"))
    assert "score_mod given the KV head index (h // group) instead of the query head h" in bug_class
    assert re.search(r"num_kv_heads=\d+, d_head", report) and "(mha," not in report


def test_with_one_kv_head_the_kv_head_index_is_named_once() -> None:
    """MQA: h // group and h % num_kv_heads are both 0, one mistake; the report names it as the KV head index and
    does not list it again as h % num_kv_heads."""
    report = report_of(
        lambda: check_attention(
            tempered(per_kv_head=True), score_mod=temperature_mod, kinds=("mqa",), max_examples=EXAMPLES
        )
    )
    bug_class = next(line for line in report.splitlines() if line.lstrip().startswith("bug class:"))
    assert bug_class.endswith("a per-head parameter (temperature, slope) indexed per KV head"), report
    assert "h % num_kv_heads" not in report


def per_example_temperature_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Query head h's temperature, times one of each example of the batch: the mod reads b as well as h."""
    return score / (temperature(h) * (1.0 + 0.5 * b))


def test_a_mistake_in_a_mod_that_reads_the_batch_index_is_named_too() -> None:
    """The report's variants give the mod every index it receives, b included: a temperature indexed per KV head is
    named for a mod that also reads the example b, as for one that does not."""

    def fn(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **_: Any) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        per_kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
        examples = 1.0 + 0.5 * torch.arange(x.shape[0])
        scaled = q / (temperature(per_kv_head)[:, None, None] * examples[:, None, None, None]).to(q.dtype)
        return out_of(ssm.scaled_dot_product_attention(scaled, k, v, is_causal=is_causal), w)

    report = report_of(
        lambda: check_attention(fn, score_mod=per_example_temperature_mod, kinds=("gqa",), max_examples=EXAMPLES)
    )
    assert "score_mod given the KV head index (h // group) instead of the query head h" in report, report


# --- ALiBi, whose slopes depend on num_heads: a function of the config gives the mod --------------------


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's geometric slopes, 2^(-8 (h + 1) / num_heads) (Press et al.)."""
    return torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads)


def alibi_mod(config: AttentionConfig) -> Callable[..., Tensor]:
    slopes = alibi_slopes(config.num_heads)

    def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def alibi_attention(bug: str | None = None) -> Callable[..., Tensor]:
    """ALiBi as users write it: a float bias (num_heads, seq, kv_seq) added to the scores as attn_mask."""

    def fn(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **mods: Any
    ) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        slopes = alibi_slopes(num_heads).to(q.dtype)
        if bug == "head order":
            slopes = slopes.flip(0)
        if bug == "per KV head":  # GQA: each query head given its KV head's slope
            slopes = slopes[torch.arange(num_heads) // (num_heads // num_kv_heads)]
        if bug == "tiled":  # GQA: query head h given the slope of h % num_kv_heads
            slopes = slopes[torch.arange(num_heads) % num_kv_heads]
        if bug == "not applied":
            slopes = torch.zeros_like(slopes)
        positions = torch.arange(q.shape[2])
        distance = positions[None, :] - positions[:, None]  # kv_idx - q_idx
        if bug == "sign":
            distance = -distance
        bias = (slopes[:, None, None] * distance)[None]
        return out_of(ssm.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=is_causal), w)

    return fn


def test_alibi_passes_with_its_score_mod_made_for_each_config() -> None:
    """Slopes that depend on num_heads: score_mod is a function of the drawn config that returns the mod."""
    check_attention(alibi_attention(), score_mod=alibi_mod, is_causal=True, max_examples=EXAMPLES)


@pytest.mark.parametrize(
    ("bug", "named", "kinds"),
    [
        (
            "sign",  # kv_idx - q_idx negated is q_idx - kv_idx: both mistakes are named
            "with score_mod's change to the scores negated (a bias with the wrong sign: ALiBi's distance reversed?); "
            "or with score_mod given q_idx and kv_idx swapped",
            ("gqa",),  # heads of their own slopes, so a variant that loses h cannot pass
        ),
        (
            "head order",
            "with score_mod's heads in reverse order (h read as num_heads - 1 - h: ALiBi's slopes reversed?)",
            ALL_KINDS,
        ),
        (
            "per KV head",
            "with score_mod given the KV head index (h // group) instead of the query head h: a per-head parameter "
            "(temperature, slope) indexed per KV head",
            ALL_KINDS,  # MQA's smallest failing example is off by only 6.8e-6, but by this formula exactly
        ),
        ("tiled", "with score_mod given h % num_kv_heads instead of the query head h", ("mha", "gqa")),
        ("not applied", "bug class: score_mod: the output matches the reference with score_mod not applied", ALL_KINDS),
    ],
)
def test_alibi_with_its_slope_sign_or_head_order_wrong_is_caught_and_named(
    bug: str, named: str, kinds: tuple[Literal["mha", "gqa", "mqa"], ...]
) -> None:
    """Classic ALiBi mistakes (the sign, the head order, slopes per KV head or tiled over them, no bias at all), each
    reported as the score_mod mistake it is, in the report's words to the end of the description."""
    report = report_of(
        lambda: check_attention(
            alibi_attention(bug), score_mod=alibi_mod, is_causal=True, kinds=kinds, max_examples=EXAMPLES
        )
    )
    assert "property: the reference applies score_mod=alibi_mod" in report
    assert "bug class: score_mod: the output matches" in report, report  # score_mod mistakes alone, one class
    assert re.search(rf"{re.escape(named)}(;|$)", report, re.MULTILINE), report


# --- an implementation on FlexAttention, with a mask_mod ----------------------------------------------------


def recent_keys(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal sliding window of 3 keys (not symmetric in q_idx and kv_idx, so swapping them shows)."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 3)


def on_flex(bug: str | None = None) -> Callable[..., Tensor]:
    """Attention on ssm.flex_attention with the check's own mods; the bug builds its BlockMask with q and kv swapped."""

    def fn(
        x: Tensor,
        w: AttentionWeights,
        *,
        num_heads: int,
        num_kv_heads: int,
        is_causal: bool,
        score_mod: Callable[..., Tensor] | None = None,
        mask_mod: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        block_mask = None
        if mask_mod is not None:
            mod = mask_mod if bug is None else (lambda b, h, q_idx, kv_idx: mask_mod(b, h, kv_idx, q_idx))
            block_mask = create_block_mask(mod, None, None, q.shape[2], k.shape[2], device=str(q.device))
        return out_of(ssm.flex_attention(q, k, v, score_mod, block_mask), w)

    return fn


def test_an_implementation_on_flex_attention_passes_with_the_same_mods() -> None:
    """The check hands its mods to the implementation, which gives them to FlexAttention: the values agree."""
    check_attention(on_flex(), score_mod=temperature_mod, mask_mod=recent_keys, max_examples=EXAMPLES)


def test_a_wrong_mask_mod_in_the_flex_implementation_is_caught_and_named() -> None:
    """A BlockMask built from the mask_mod with q_idx and kv_idx swapped: reported as that mask_mod mistake."""
    report = report_of(lambda: check_attention(on_flex("swapped"), mask_mod=recent_keys, max_examples=EXAMPLES))
    assert "property: the reference applies mask_mod=recent_keys (True = may attend" in report
    assert (
        "bug class: mask_mod: the output matches the reference with mask_mod given q_idx and kv_idx swapped" in report
    )


# --- a document mask, checked on a hand-written implementation ---------------------------------------------


def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Documents of 3 tokens packed end to end: a token attends only within its own."""
    return q_idx // 3 == kv_idx // 3


def packed(ignore_documents: bool = False) -> Callable[..., Tensor]:
    def fn(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **mods: Any
    ) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        document = torch.arange(q.shape[2]) // 3
        mask = None if ignore_documents else document[:, None] == document[None, :]
        return out_of(ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal), w)

    return fn


def test_a_document_mask_passes_combined_with_causal_and_fails_when_ignored() -> None:
    """mask_mod combines with is_causal (a key must be allowed by both); ignoring it is named as such."""
    check_attention(packed(), mask_mod=same_document, is_causal=True, max_examples=EXAMPLES)
    report = report_of(
        lambda: check_attention(packed(ignore_documents=True), mask_mod=same_document, max_examples=EXAMPLES)
    )
    assert "bug class: mask_mod: the output matches the reference with mask_mod not applied" in report


# --- a window per head, as a mask_mod -----------------------------------------------------------------------


WIDTHS = torch.tensor([1, 3, 0, 2, 5, 4, 7, 6])  # each query head's window, read from a table (up to 8 heads)


def head_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal, query head h of example b seeing its WIDTHS[h] + b + 1 most recent keys: a window per head and
    example."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WIDTHS[h] + b)


def windowed(bug: str | None = None) -> Callable[..., Tensor]:
    """The windows as a bool mask (True = may attend) per example and head; the bugs index it per KV head, negate
    it, or measure the distance from the key to the query."""

    def fn(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **_: Any) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        heads = torch.arange(num_heads)
        if bug == "per KV head":
            heads = heads // (num_heads // num_kv_heads)
        width = (WIDTHS[heads][None, :] + torch.arange(x.shape[0])[:, None])[:, :, None, None]
        distance = torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
        if bug == "swapped":
            distance = -distance
        allowed = (distance >= 0) & (distance <= width)
        if bug == "negated":
            allowed = ~allowed
        return out_of(ssm.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal), w)

    return fn


def test_a_window_per_head_passes_with_its_mask_mod() -> None:
    check_attention(windowed(), mask_mod=head_window, max_examples=EXAMPLES)


def head_window_as_ints(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """head_window as 1 and 0: the reference reads a mask_mod's result as bool."""
    return head_window(b, h, q_idx, kv_idx).int()


@pytest.mark.parametrize(
    ("bug", "mod", "named"),
    [
        ("per KV head", head_window, "with mask_mod given the KV head index (h // group) instead of the query head h"),
        ("negated", head_window, "with mask_mod negated (True taken as masked out; FlexAttention's True = may attend)"),
        ("swapped", head_window, "with mask_mod given q_idx and kv_idx swapped"),
        (
            "negated",
            head_window_as_ints,
            "with mask_mod negated (True taken as masked out; FlexAttention's True = may attend)",
        ),
    ],
    ids=["per KV head", "negated", "swapped", "negated, the mod's result 1 and 0"],
)
def test_a_mask_mod_mistake_in_a_window_per_head_is_named(bug: str, mod: Callable[..., Tensor], named: str) -> None:
    """mask_mod mistakes: the window of query head h read at its KV head, True taken as masked out (a mod that returns
    1 and 0 negated as the bools they stand for, not bit by bit), and q_idx and kv_idx swapped; the mod reads b and h,
    so each variant must pass them on."""
    report = report_of(
        lambda: check_attention(windowed(bug), mask_mod=mod, kinds=("mha", "gqa"), max_examples=EXAMPLES)
    )
    assert "bug class: mask_mod" in report and re.search(rf"{re.escape(named)}(;|$)", report, re.MULTILINE), report


def test_a_mask_mod_may_be_a_function_of_the_config() -> None:
    """mask_mod, like score_mod, may be a function of the drawn AttentionConfig that returns the mod: it is called with
    each example's config, and what it returns is applied (a causal window of seq // 2 earlier keys, which the code
    computes itself)."""
    configs: list[AttentionConfig] = []

    def window_for(config: AttentionConfig) -> Callable[..., Tensor]:
        configs.append(config)
        width = config.seq // 2
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= width)

    def fn(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **_: Any) -> Tensor:
        q, k, v = heads_of(x, w, num_heads, num_kv_heads)
        distance = torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
        allowed = (distance >= 0) & (distance <= x.shape[1] // 2)
        return out_of(ssm.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal), w)

    check_attention(fn, mask_mod=window_for, max_examples=EXAMPLES)
    assert configs and all(isinstance(config, AttentionConfig) for config in configs)


# --- modules -----------------------------------------------------------------------------------------------


class TemperedAttention(nn.Module):
    """A module with a per-head temperature buffer (1 + h/2); `per_kv_head` plants the bug."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool, per_kv_head: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_proj = nn.Linear(d_model, num_heads * d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=bias)
        heads = torch.arange(num_heads)
        self.register_buffer("temperature", temperature(heads // (num_heads // num_kv_heads) if per_kv_head else heads))

    def forward(self, x: Tensor) -> Tensor:
        q = ssm.split_heads(self.q_proj(x), self.num_heads)
        k = ssm.split_heads(self.k_proj(x), self.num_kv_heads)
        v = ssm.split_heads(self.v_proj(x), self.num_kv_heads)
        out = ssm.scaled_dot_product_attention(q / self.temperature[:, None, None], k, v)
        return self.o_proj(ssm.merge_heads(out))


def test_check_module_applies_the_mods_to_the_reference() -> None:
    """The module computes its variant itself; the mod tells the reference what it computes."""
    check_module(
        lambda *sizes: TemperedAttention(*sizes, per_kv_head=False), score_mod=temperature_mod, max_examples=10
    )
    report = report_of(
        lambda: check_module(
            lambda *sizes: TemperedAttention(*sizes, per_kv_head=True), score_mod=temperature_mod, max_examples=10
        )
    )
    assert "score_mod given the KV head index (h // group) instead of the query head h" in report


# --- the reference itself, and what stays as it was -------------------------------------------------------


@torch.no_grad()  # torch's FlexAttention has no backward on CPU, so it refuses inputs that require grad
def test_the_reference_applies_mods_as_flex_attention_does() -> None:
    """per_head_attention with mods equals ssm.flex_attention with the same mods on the same projections."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(24, num_heads=6, num_kv_heads=2, dtype=torch.float64)
    w, x = module.weights(), torch.randn(2, 7, 24, dtype=torch.float64)
    got = per_head_attention(x, x, x, w, num_heads=6, num_kv_heads=2, score_mod=temperature_mod, mask_mod=recent_keys)
    q, k, v = heads_of(x, w, 6, 2)
    mask = create_block_mask(recent_keys, None, None, 7, 7, device="cpu")
    torch.testing.assert_close(got, out_of(ssm.flex_attention(q, k, v, temperature_mod, mask), w), rtol=0, atol=1e-12)


def test_identity_mods_change_nothing_and_reports_without_mods_have_no_property_line() -> None:
    """A score_mod returning the score and a mask_mod allowing everything are the reference itself; and a
    report without mods reads as before (no property line)."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    plain = per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=2, is_causal=True)
    modded = per_head_attention(
        x, x, x, module.weights(), num_heads=4, num_kv_heads=2, is_causal=True,
        score_mod=lambda score, b, h, q_idx, kv_idx: score, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= 0,
    )  # fmt: skip
    assert torch.equal(plain, modded)
    report = report_of(lambda: check_attention(tempered(), max_examples=EXAMPLES))
    assert "property:" not in report and "bug class" not in report.splitlines()[0]


def test_a_mod_of_the_wrong_signature_is_a_config_error() -> None:
    """A score_mod that takes neither FlexAttention's five arguments nor a config is refused by name, up front."""
    with pytest.raises(ConfigError, match=r"score_mod must be FlexAttention's score_mod\(score, b, h, q_idx, kv_idx\)"):
        check_attention(tempered(), score_mod=lambda score, h: score, max_examples=1)
    with pytest.raises(ConfigError, match=r"mask_mod must be FlexAttention's mask_mod\(b, h, q_idx, kv_idx\)"):
        check_attention(tempered(), mask_mod=lambda b, h, q_idx: True, max_examples=1)


def test_a_function_of_the_config_that_returns_no_mod_is_refused_by_the_mods_name() -> None:
    """What a function of the config returns is checked as the mod it stands for: a two-argument score_mod or a
    three-argument mask_mod made for the drawn config is refused by that mod's own name and signature."""
    with pytest.raises(
        ConfigError,
        match=r"^score_mod must be FlexAttention's score_mod\(score, b, h, q_idx, kv_idx\).*takes 2 positional",
    ):
        check_attention(tempered(), score_mod=lambda config: lambda score, h: score, max_examples=1)
    with pytest.raises(
        ConfigError, match=r"^mask_mod must be FlexAttention's mask_mod\(b, h, q_idx, kv_idx\).*takes 3 positional"
    ):
        check_attention(tempered(), mask_mod=lambda config: lambda b, h, q_idx: True, max_examples=1)


def test_a_mods_parameters_with_defaults_do_not_count_as_its_arguments() -> None:
    """A mod is read by the positional arguments it needs: a score_mod with a sixth positional parameter that has a
    default is still FlexAttention's five-argument score_mod (the reference passes five), and applies as written."""

    def with_default(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, scale: float = 1.0) -> Tensor:
        return temperature_mod(score, b, h, q_idx, kv_idx) * scale

    check_attention(tempered(), score_mod=with_default, max_examples=3)


def test_check_module_applies_a_mask_mod_to_the_reference() -> None:
    """A module with a causal window of 3 keys passes check_module with the mask_mod that says so, and fails
    without it (the reference then attends to every earlier key)."""

    def build(d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> nn.Module:
        return ssm.MultiHeadAttention(d_model, h, hkv, d_head=d_head, bias=bias, window=3)

    check_module(build, is_causal=True, mask_mod=recent_keys, max_examples=10)
    with pytest.raises(AssertionError, match="smallest failing config: seq=4, "):
        check_module(build, is_causal=True, max_examples=10)


def test_the_property_line_names_both_mods_and_a_mod_object_by_its_type() -> None:
    """With both mods, the report's property line follows the config line and names each, the score_mod first; a
    mod with no __qualname__ (a functools.partial) is named by its type."""
    import functools

    scaled = functools.partial(lambda factor, score, b, h, q_idx, kv_idx: score * factor, 1.0)
    report = report_of(lambda: check_attention(tempered(), score_mod=scaled, mask_mod=recent_keys, max_examples=5))
    assert re.search(
        r"smallest failing config: [^\n]*float64\)\n  property: the reference applies score_mod=partial on each query "
        r"head's scaled scores and mask_mod=recent_keys \(True = may attend, combined with the other masks\)\n",
        report,
    ), report


def test_a_mod_that_is_no_function_is_refused_by_its_type_and_one_taking_any_arguments_is_taken() -> None:
    """A mod that is not callable is refused up front, the message naming its type; one that takes `*args` (any
    number) is taken as FlexAttention's mod and applied."""
    with pytest.raises(ConfigError, match=r"^score_mod must be FlexAttention's score_mod\(.*but it is a float\.$"):
        check_attention(tempered(), score_mod=2.0, max_examples=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^mask_mod must be FlexAttention's mask_mod\(.*but it is a str\.$"):
        check_attention(tempered(), mask_mod="causal", max_examples=1)  # type: ignore[arg-type]

    def any_arguments(*args: Tensor) -> Tensor:
        return temperature_mod(*args)

    check_attention(tempered(), score_mod=any_arguments, max_examples=3)
