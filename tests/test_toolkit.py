"""check_attention and check_module catch every classic attention bug, readably, and pass correct code."""

import math
import re
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn

import shapesafe_mha as ssm
from shapesafe_mha import AttentionWeights
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import AttentionConfig, attention_configs, check_attention, check_module, tolerance

# --- a plain-torch implementation, with switches for the classic bugs -------------------------------------


def attention(
    x: Tensor,
    w: AttentionWeights,
    *,
    num_heads: int,
    num_kv_heads: int,
    is_causal: bool,
    bug: str | None = None,
) -> Tensor:
    """Straightforward fused GQA attention; `bug` plants one classic mistake."""
    b, s, d_model = x.shape
    d_head = d_model // num_heads if bug == "d_head_from_d_model" else w.w_q.shape[0] // num_heads
    group = num_heads // num_kv_heads

    def proj(weight: Tensor, bias: Tensor | None, skip_bias: bool = False) -> Tensor:
        return F.linear(x, weight, None if skip_bias else bias)

    q = proj(w.w_q, w.b_q)
    k = proj(w.w_v if bug == "keys_with_value_weight" else w.w_k, w.b_v if bug == "keys_with_value_weight" else w.b_k)
    v = proj(w.w_v, w.b_v, skip_bias=bug == "forgot_v_bias")
    if bug == "no_transpose_before_view":
        q = q.reshape(b, num_heads, s, -1)
        k = k.reshape(b, num_kv_heads, s, -1)
        v = v.reshape(b, num_kv_heads, s, -1)
    else:
        q = q.view(b, s, num_heads, -1).transpose(1, 2)
        k = k.view(b, s, num_kv_heads, -1).transpose(1, 2)
        v = v.view(b, s, num_kv_heads, -1).transpose(1, 2)
    if bug == "repeat_not_repeat_interleave":
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    else:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(d_model if bug == "scale_by_d_model" else d_head)
    scores = q @ k.transpose(-1, -2) * scale
    if is_causal and bug != "ignore_causal_mask":
        offset = {"causal_off_by_one": -1, "causal_sees_next_key": 1}.get(bug or "", 0)
        allowed = torch.ones(s, s, dtype=torch.bool, device=x.device).tril(offset)
        scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, dim=-2 if bug == "softmax_over_queries" else -1)
    probs = torch.nan_to_num(probs)
    out = probs @ v
    if bug == "merge_without_transpose":
        merged = out.reshape(b, s, -1)
    elif bug == "merge_d_h":
        merged = out.permute(0, 2, 3, 1).reshape(b, s, -1)
    else:
        merged = out.transpose(1, 2).reshape(b, s, -1)
    return F.linear(merged, w.w_o, None if bug == "forgot_o_bias" else w.b_o)


BUGS: dict[str, tuple[bool, str]] = {
    # bug: (needs is_causal, the check's kinds)
    "no_transpose_before_view": (False, "all"),
    "merge_without_transpose": (False, "all"),
    "repeat_not_repeat_interleave": (False, "gqa"),
    "scale_by_d_model": (False, "all"),
    "softmax_over_queries": (False, "all"),
    "causal_off_by_one": (True, "all"),
    "ignore_causal_mask": (True, "all"),
    "keys_with_value_weight": (False, "all"),
    "forgot_v_bias": (False, "all"),
    "forgot_o_bias": (False, "all"),
    "d_head_from_d_model": (False, "all"),
}


def _planted(bug: str) -> Callable[..., Tensor]:
    def fn(x: Tensor, w: AttentionWeights, **kwargs: object) -> Tensor:
        return attention(x, w, bug=bug, **kwargs)  # type: ignore[arg-type]

    return fn


@pytest.mark.parametrize("bug", list(BUGS))
def test_every_planted_bug_is_caught_with_a_readable_report(bug: str) -> None:
    """Within the default budget, each classic bug fails with the config, the deviation and where it is."""
    needs_causal, kinds = BUGS[bug]
    with pytest.raises(AssertionError) as caught:
        check_attention(
            _planted(bug), is_causal=needs_causal, kinds=("gqa",) if kinds == "gqa" else ("mha", "gqa", "mqa")
        )
    report = str(caught.value)
    assert re.search(
        r"smallest failing config: seq=\d+, batch=\d+, d_model=\d+, num_heads=\d+, num_kv_heads=\d+, "
        r"d_head=\d+, bias=(True|False), is_causal=(True|False)",
        report,
    ), report
    assert "differs from the per-head reference by" in report or "raised" in report or "returned shape" in report
    assert "tensor(" not in report and "Falsifying" not in report and "_toolkit.py" not in report, report
    if "differs" in report:
        assert re.search(r"query position \d+", report) and ("head" in report), report


@pytest.mark.parametrize(
    ("bug", "named"),
    [
        (
            "repeat_not_repeat_interleave",
            "KV heads tiled: query head i reads KV head i % num_kv_heads (`repeat` where `repeat_interleave` was "
            'meant); if that is your convention (x-transformers), pass kv_heads="interleaved"',
        ),
        ("scale_by_d_model", "scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)"),
        ("causal_off_by_one", "causal mask shifted by one: no query sees its own key"),
        ("forgot_v_bias", "the v projection's bias not added"),
        ("merge_d_h", "heads merged in (d_head num_heads) order: a reshape without the transpose back"),
        (
            "merge_without_transpose",
            "heads merged without the transpose: (batch, num_heads, seq, d_head) reshaped to "
            "(batch, seq, num_heads * d_head), which mixes positions across heads",
        ),
    ],
)
def test_the_report_names_the_bug_class(bug: str, named: str) -> None:
    """The wrong output equals the reference with that one mistake made: the report says which, in its words to the
    end of the description."""
    with pytest.raises(AssertionError) as caught:
        check_attention(_planted(bug), is_causal=bug == "causal_off_by_one", kinds=("gqa",))
    assert re.search(rf"with {re.escape(named)}(;|$)", str(caught.value), re.MULTILINE), str(caught.value)


@pytest.mark.parametrize(
    ("bug", "named"),
    [
        ("causal_off_by_one", "causal mask shifted by one: no query sees its own key"),
        ("causal_sees_next_key", "causal mask shifted by one: each query also sees the next key"),
    ],
)
def test_a_causal_mask_one_key_off_is_named_at_a_length_where_one_and_two_keys_off_differ(bug: str, named: str) -> None:
    """Over 6 positions a mask one key off either way is told apart from two keys off: the diagnosis names the planted
    mistake, and nothing else of the mask kind."""
    from shapesafe_mha.testing._diagnose import Scenario, Tolerance, name_bug

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=generator)
    w = AttentionWeights(*(torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(4)))
    got = attention(x, w, num_heads=2, num_kv_heads=2, is_causal=True, bug=bug)
    found = name_bug(got, Scenario.of(x, x, x, w, num_heads=2, num_kv_heads=2, is_causal=True), Tolerance(1e-9))
    assert [description for kind, description in found if kind == "mask"] == [named], found


def test_a_wrong_head_is_located() -> None:
    """A bug confined to one head is reported as that head."""

    def second_head_scaled(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool
    ) -> Tensor:
        q = ssm.split_heads(ssm.project(x, w.w_q, w.b_q), num_heads).clone()
        k = ssm.split_heads(ssm.project(x, w.w_k, w.b_k), num_kv_heads)
        v = ssm.split_heads(ssm.project(x, w.w_v, w.b_v), num_kv_heads)
        if num_heads > 1:
            q[:, 1] *= 3.0
        out = ssm.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return ssm.project(ssm.merge_heads(out), w.w_o, w.b_o)

    with pytest.raises(AssertionError, match=r"wrong heads: \[1\] of 2"):
        check_attention(second_head_scaled, kinds=("mha",))


def test_a_wrong_head_is_located_in_code_that_assumes_every_bias_is_there() -> None:
    """With bias=True the weights always carry biases, so code may add them unconditionally: each head is isolated
    with its output bias zeroed, not taken away, and the wrong head is still found."""

    def second_head_scaled(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool
    ) -> Tensor:
        assert w.b_q is not None and w.b_k is not None and w.b_v is not None and w.b_o is not None
        q = ssm.split_heads(x @ w.w_q.T + w.b_q, num_heads).clone()
        k = ssm.split_heads(x @ w.w_k.T + w.b_k, num_kv_heads)
        v = ssm.split_heads(x @ w.w_v.T + w.b_v, num_kv_heads)
        if num_heads > 1:
            q[:, 1] *= 3.0
        out = ssm.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return ssm.merge_heads(out) @ w.w_o.T + w.b_o

    with pytest.raises(AssertionError, match=r"wrong heads: \[1\] of \d+"):
        check_attention(second_head_scaled, kinds=("mha",), bias=True)


@pytest.mark.parametrize(
    ("bug", "located"),
    [
        ("forgot_o_bias", "no single head is wrong on its own: the error is in how heads are combined (merge or W_O)"),
        ("scale_by_d_model", "every head (4) is wrong"),
    ],
)
def test_a_bug_outside_any_one_head_or_in_all_of_them_is_located_so(bug: str, located: str) -> None:
    """The output bias dropped is wrong with every head right on its own; a wrong scale makes every head wrong."""
    config = AttentionConfig(seq=5, kv_seq=5, batch=2, d_model=16, num_heads=4, num_kv_heads=4, d_head=4, bias=True)
    with pytest.raises(AssertionError) as caught:
        check_attention(_planted(bug), configs=st.just(config), max_examples=1)
    assert located in [line.strip() for line in str(caught.value).splitlines()], str(caught.value)


def test_an_exception_is_a_failure_with_the_cause_chained() -> None:
    """If the implementation raises, the report says so and chains the original exception."""

    def crashes(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> Tensor:
        raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="the implementation raised RuntimeError: boom") as caught:
        check_attention(crashes, max_examples=5)
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize("is_causal", [False, True])
def test_correct_implementations_pass(is_causal: bool) -> None:
    """The plain-torch implementation, our stages, and our module all pass, causal or not."""
    check_attention(attention, is_causal=is_causal)

    def stages(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> Tensor:
        q = ssm.split_heads(ssm.project(x, w.w_q, w.b_q), num_heads)
        k = ssm.split_heads(ssm.project(x, w.w_k, w.b_k), num_kv_heads)
        v = ssm.split_heads(ssm.project(x, w.w_v, w.b_v), num_kv_heads)
        out = ssm.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return ssm.project(ssm.merge_heads(out), w.w_o, w.b_o)

    check_attention(stages, is_causal=is_causal)
    check_module(
        lambda d_model, h, hkv, d_head, bias: ssm.MultiHeadAttention(d_model, h, hkv, d_head=d_head, bias=bias),
        is_causal=is_causal,
    )


def test_check_module_catches_a_module_with_a_bug() -> None:
    """check_module loads the drawn weights into q/k/v/o_proj and catches a module that forgets o_proj's bias."""

    class NoOutputBias(ssm.MultiHeadAttention):
        def forward(self, query: Tensor, *args: object, **kwargs: object) -> Tensor:  # type: ignore[override]
            out = super().forward(query, *args, **kwargs)  # type: ignore[arg-type]
            return out - self.o_proj.bias if self.o_proj.bias is not None else out  # type: ignore[operator]

    with pytest.raises(AssertionError, match="smallest failing config"):
        check_module(lambda d, h, hkv, dh, bias: NoOutputBias(d, h, hkv, d_head=dh, bias=True))


def test_float32_uses_a_float32_tolerance() -> None:
    """In float32 the reference is computed in float64 and compared with float32's tolerance."""
    check_attention(attention, dtype=torch.float32, max_examples=20)


# --- control over the draws -------------------------------------------------------------------------------


def _recording(seen: list[tuple[int, ...]], inner: Callable[..., Tensor] = attention) -> Callable[..., Tensor]:
    def fn(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> Tensor:
        biases = tuple(int(b is not None) for b in (w.b_q, w.b_k, w.b_v, w.b_o))
        seen.append((x.shape[1], x.shape[2], num_heads, num_kv_heads, w.w_q.shape[0] // num_heads, *biases))
        return inner(x, w, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal)

    return fn


def test_configs_and_constraints_bound_every_draw() -> None:
    """configs= replaces the draws; bias="qkv", max_heads, even_d_head and d_model_is_inner hold in every example."""
    seen: list[tuple[int, ...]] = []
    check_attention(_recording(seen), configs=attention_configs(kinds=("gqa",), max_seq=4), max_examples=15)
    assert seen and all(seq <= 4 and heads > kv_heads > 1 for seq, _, heads, kv_heads, *_ in seen)
    seen.clear()
    check_attention(_recording(seen), bias="qkv", max_heads=4, even_d_head=True, d_model_is_inner=True, max_examples=25)
    assert seen
    for _, d_model, heads, _, d_head, b_q, b_k, b_v, b_o in seen:
        assert (b_q, b_k, b_v, b_o) == (1, 1, 1, 0) and heads <= 4 and d_head % 2 == 0 and d_model == heads * d_head
    with pytest.raises(
        ValueError, match=r"^pass either configs= or constraints \(bias, max_heads, \.\.\.\), not both$"
    ):
        check_attention(attention, configs=attention_configs(), bias=False)


# --- tolerances --------------------------------------------------------------------------------------------


def _off_by(offset: float) -> Callable[..., Tensor]:
    def fn(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x, w, **kwargs) + offset

    return fn


def test_atol_and_rtol_set_the_tolerance() -> None:
    """1e-6 off fails float64's default, passes atol=1e-5; rtol scales with the expected values."""
    with pytest.raises(AssertionError, match=r"tolerance 1e-08"):
        check_attention(_off_by(1e-3), max_examples=5)
    check_attention(_off_by(1e-6), atol=1e-5, max_examples=10)
    with pytest.raises(AssertionError, match=r"tolerance atol=0, rtol=1e-09"):
        check_attention(_off_by(1e-6), atol=0, rtol=1e-9, max_examples=10)


def test_a_negative_or_non_numeric_tolerance_is_refused_by_name_before_anything_runs() -> None:
    """atol and rtol are non-negative numbers: anything else is a ValueError naming the argument and the value given,
    raised before the code under test is called (here it would divide by zero), from check_attention and
    check_module alike."""

    def never(*args: Any, **kwargs: Any) -> Tensor:
        raise ZeroDivisionError

    for kwargs, named in (
        ({"atol": -1e-3}, "atol must be a non-negative number, got -0.001"),
        ({"rtol": "1e-3"}, "rtol must be a non-negative number, got '1e-3'"),
        ({"atol": 1e-3, "rtol": -1}, "rtol must be a non-negative number, got -1"),
    ):
        with pytest.raises(ValueError, match=rf"^{re.escape(named)}$"):
            check_attention(never, max_examples=1, **kwargs)
        with pytest.raises(ValueError, match=rf"^{re.escape(named)}$"):
            check_module(never, max_examples=1, **kwargs)


def test_a_float32_check_rejects_an_output_off_by_1e_3_everywhere() -> None:
    """1e-3 everywhere is a wrong answer in float32 (its rounding here is about 1e-6, see test_pins' measured bounds):
    the check fails it, whatever tolerance(float32) says; the number is pinned here, not read from tolerance()."""
    with pytest.raises(AssertionError, match=r"differs from the per-head reference by 0\.001 "):
        check_attention(_off_by(1e-3), dtype=torch.float32, max_examples=5)


def test_float32_inside_a_float64_check_is_named_not_called_a_bug() -> None:
    """Softmax in float32, the rest in float64: the report says so, and names no wrong head."""

    def softmax_in_float32(
        x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool
    ) -> Tensor:
        q = ssm.split_heads(F.linear(x, w.w_q, w.b_q), num_heads)
        k = ssm.split_heads(F.linear(x, w.w_k, w.b_k), num_kv_heads).repeat_interleave(num_heads // num_kv_heads, 1)
        v = ssm.split_heads(F.linear(x, w.w_v, w.b_v), num_kv_heads).repeat_interleave(num_heads // num_kv_heads, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        return F.linear(ssm.merge_heads(probs @ v), w.w_o, w.b_o)

    with pytest.raises(AssertionError, match=r"computes in float32 inside \(softmax\?\)") as caught:
        check_attention(softmax_in_float32, max_examples=20)
    assert "wrong heads" not in str(caught.value) and "every head" not in str(caught.value)
    check_attention(softmax_in_float32, atol=1e-5, max_examples=20)


# --- more properties for the user's code -------------------------------------------------------------------


def _module_call(x: Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **extra: Any):
    module = ssm.MultiHeadAttention.from_weights(
        w, num_heads=num_heads, num_kv_heads=num_kv_heads, rope_theta=extra.pop("rope_theta", None)
    )
    memory = extra.pop("memory", None)
    return (
        module(x, memory, memory, is_causal=is_causal, **extra)
        if memory is not None
        else module(x, is_causal=is_causal, **extra)
    )


def test_masks_cross_attention_and_rope_pass_correct_code() -> None:
    """Bool and float masks with key padding, cross-attention, and RoPE the reference applies itself."""
    check_attention(_module_call, masks=True, max_examples=15)
    check_attention(_module_call, cross=True, max_examples=15)
    check_attention(_module_call, rope=True, is_causal=True, max_examples=15)


def test_masks_and_rope_catch_what_they_are_for() -> None:
    """Padding ignored and RoPE pairs interleaved are caught, and named."""

    def ignores_padding(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        kwargs.pop("key_padding_mask")
        return _module_call(x, w, **kwargs)

    with pytest.raises(AssertionError, match="padding ignored"):
        check_attention(ignores_padding, masks=True)
    with pytest.raises(AssertionError, match=r"rope_interleaved=True not applied \(RoPE pairs adjacent features"):
        check_attention(_module_call, rope=True, rope_style="interleaved")


def test_rope_turned_the_wrong_way_past_position_0_is_named() -> None:
    """A decoding branch (positions past 0) that turns RoPE the wrong way is named as such: the variant turns the
    keys with the queries' own positions, wherever they start, not with positions counted from 0, and as many as the
    sequence has (GQA with d_model = num_heads * d_head: even its smallest example has more features than positions)."""

    def wrong_way_when_decoding(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        positions = kwargs["positions"]
        if positions[0, 0] > 0:  # the cached-step branch, with the sign of sin flipped
            positions = -positions
        return _module_call(x, w, **{**kwargs, "positions": positions})

    with pytest.raises(AssertionError, match=r"RoPE turned the wrong way \(the sign of sin, or of rotate_half\)"):
        check_attention(wrong_way_when_decoding, rope=True, is_causal=True, kinds=("gqa",), d_model_is_inner=True)


def test_rope_turned_the_wrong_way_in_cross_attention_is_named() -> None:
    """Cross-attention with RoPE (the reference's own code, every angle negated): named as RoPE turned the wrong way,
    the variant turning the kv_seq keys by their own positions 0..kv_seq-1, not by the queries'."""

    def wrong_way(x: Tensor, w: AttentionWeights, *, memory: Tensor, positions: Tensor, **kwargs: Any) -> Tensor:
        keys = torch.arange(memory.shape[1]).expand(memory.shape[0], -1)
        return per_head_attention(x, memory, memory, w, positions=-positions, key_positions=-keys, **kwargs)

    with pytest.raises(AssertionError, match=r"RoPE turned the wrong way \(the sign of sin, or of rotate_half\)"):
        check_attention(wrong_way, cross=True, rope=True)


def test_atol_0_is_exact_and_a_head_with_the_references_bits_is_not_wrong() -> None:
    """atol=0 compares exactly, and a head whose output is the reference's bit for bit is within it: only the head
    whose queries are scaled is reported wrong."""

    def second_head_scaled(x: Tensor, w: AttentionWeights, *, num_heads: int, **kwargs: Any) -> Tensor:
        d_head = w.w_q.shape[0] // num_heads
        scaled = w.w_q.clone()
        scaled[d_head : 2 * d_head] *= 3.0
        return per_head_attention(x, x, x, replace(w, w_q=scaled), num_heads=num_heads, **kwargs)

    with pytest.raises(AssertionError, match=r"wrong heads: \[1\] of \d+"):
        check_attention(second_head_scaled, kinds=("mha",), atol=0)


def test_interleaved_kv_heads_are_a_convention_not_a_bug() -> None:
    """x-transformers' i % kv_heads fails the default with a hint, and passes kv_heads="interleaved"."""

    def tiled(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x, w, bug="repeat_not_repeat_interleave", **kwargs)

    with pytest.raises(AssertionError, match=r'KV heads tiled.*pass kv_heads="interleaved"'):
        check_attention(tiled, kinds=("gqa",))
    check_attention(tiled, kv_heads="interleaved", max_examples=20)


def test_each_kv_head_convention_names_the_other_with_its_hint_in_full() -> None:
    """Checked against the other convention, each one is named with the hint that switches to it: i % num_kv_heads
    (x-transformers) under the default, i // group (transformers, torch) under kv_heads="interleaved"."""

    def tiled(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x, w, bug="repeat_not_repeat_interleave", **kwargs)

    hints = {
        "grouped": (
            tiled,
            "with KV heads tiled: query head i reads KV head i % num_kv_heads (`repeat` where `repeat_interleave` was "
            'meant); if that is your convention (x-transformers), pass kv_heads="interleaved"',
        ),
        "interleaved": (
            attention,
            "with query head i reads KV head i // group (transformers' repeat_kv, torch's enable_gqa), not "
            'i % num_kv_heads; if that is your convention, pass kv_heads="grouped"',
        ),
    }
    for convention, (fn, hint) in hints.items():
        with pytest.raises(AssertionError) as caught:
            check_attention(fn, kinds=("gqa",), kv_heads=convention)  # type: ignore[arg-type]
        report = str(caught.value)
        assert "bug class: heads" in report and re.search(rf"{re.escape(hint)}(;|$)", report, re.MULTILINE), report


# --- adapters ----------------------------------------------------------------------------------------------


class _Fused(nn.Module):
    """Attention with one fused qkv nn.Linear, no output bias (the layout of many ViTs)."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d_head = num_heads, num_kv_heads, d_head
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * d_head, bias=bias)
        self.proj = nn.Linear(num_heads * d_head, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split([self.heads * self.d_head, *[self.kv_heads * self.d_head] * 2], dim=-1)
        q = ssm.split_heads(q, self.heads)
        out = ssm.scaled_dot_product_attention(q, ssm.split_heads(k, self.kv_heads), ssm.split_heads(v, self.kv_heads))
        return self.proj(ssm.merge_heads(out))


def test_check_module_loads_fused_qkv_conv1d_and_missing_biases() -> None:
    """A fused qkv nn.Linear, GPT-2's Conv1D c_attn (transposed), and projections without bias (Mistral) load."""
    check_module(_Fused, max_examples=10)
    check_module(
        lambda d, h, hkv, dh, bias: ssm.MultiHeadAttention(d, h, hkv, d_head=dh, bias=False), bias=True, max_examples=10
    )
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    def gpt2(d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> nn.Module:
        config = GPT2Config(hidden_size=d_model, num_attention_heads=num_heads, attn_implementation="eager")
        return GPT2Attention(config, layer_idx=0).eval()

    check_module(gpt2, kinds=("mha",), d_model_is_inner=True, max_examples=10)


def test_check_module_decodes_step_by_step_against_one_causal_forward() -> None:
    """decode_step: a prefill then token by token through the module's cache == the causal reference."""

    def build(d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> nn.Module:
        return ssm.MultiHeadAttention(d_model, h, hkv, d_head=d_head, bias=bias)

    def step(module: Any, chunk: Tensor, cache: Any) -> tuple[Tensor, Any]:
        cache = module.new_cache(chunk.shape[0], 1024) if cache is None else cache
        return module(chunk, is_causal=True, kv_cache=cache), cache

    check_module(build, decode_step=step, max_examples=10)

    def forgets_the_cache(module: Any, chunk: Tensor, cache: Any) -> tuple[Tensor, Any]:
        return module(chunk, is_causal=True), None  # each step sees only itself

    with pytest.raises(AssertionError, match=r"is_causal=True"):
        check_module(build, decode_step=forgets_the_cache)


def test_x_transformers_attention_passes_with_its_convention_when_present() -> None:
    """x-transformers (if installed): i % kv_heads and a float32 softmax; the default check names the convention."""
    xt = pytest.importorskip("x_transformers.x_transformers")

    def build(d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> nn.Module:
        return xt.Attention(dim=d_model, dim_head=d_head, heads=h, kv_heads=hkv, project_out=True)

    check_module(build, kv_heads="interleaved", atol=1e-5, max_examples=15)
    with pytest.raises(AssertionError, match=r'x-transformers\), pass kv_heads="interleaved"'):
        check_module(build, kinds=("gqa",), atol=1e-5)


def test_a_module_the_loader_cannot_read_is_a_clean_failure() -> None:
    """No output projection under any known name: the loader's error, chained, without hypothesis' tensor dump."""

    class NoOutput(nn.Module):
        def __init__(self, d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> None:
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(d_model, h * d_head), nn.Linear(d_model, hkv * d_head)
            self.v_proj = nn.Linear(d_model, hkv * d_head)

    with pytest.raises(
        AssertionError, match="loading the drawn weights raised ValueError: load_weights: no o projection"
    ) as caught:
        check_module(NoOutput, max_examples=5)
    assert isinstance(caught.value.__cause__, ValueError) and "tensor(" not in str(caught.value)


def test_decoding_prefills_half_the_sequence_then_feeds_one_token_at_a_time() -> None:
    """decode_step's driver: the first step gets the first half of the sequence (at least one token) and cache None,
    each later step the next single token and the cache the step before returned; a step's output may be a tuple,
    whose first item is the output (attention weights beside it are ignored), and the pieces join in order."""
    from shapesafe_mha.testing._toolkit import decoding

    chunks: list[int] = []
    caches: list[Any] = []

    def step(module: Any, chunk: Tensor, cache: Any) -> tuple[Any, Any]:
        chunks.append(chunk.shape[1])
        caches.append(cache)
        out = -chunk
        return ((out, torch.zeros_like(out)) if len(chunks) % 2 else out), len(chunks)

    for seq in range(1, 8):
        chunks.clear()
        caches.clear()
        x = torch.arange(2 * seq * 5, dtype=torch.float64).reshape(2, seq, 5)
        got = decoding(step)(nn.Identity(), x, True)
        half = seq // 2 if seq > 1 else 1
        assert chunks == [half] + [1] * (seq - half), (seq, chunks)
        assert caches == [None, *range(1, len(chunks))], (seq, caches)
        assert torch.equal(got, -x), seq


def test_check_module_builds_with_the_drawn_bias_and_moves_the_module_to_the_inputs_device_and_dtype() -> None:
    """The factory is told whether the drawn projections have biases (a bool: True or False as drawn), and the module
    it builds is moved to the drawn tensors' device and dtype (read from the `.to` call, whatever its form)."""
    told: list[object] = []
    moved: list[tuple[object, object]] = []

    class Recorded(ssm.MultiHeadAttention):
        def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
            moved.append((device, dtype))
            return super().to(*args, **kwargs)

    def build(d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> nn.Module:
        told.append(bias)
        return Recorded(d_model, h, hkv, d_head=d_head, bias=bias)

    for bias in (True, False):
        told.clear()
        check_module(build, bias=bias, max_examples=3)
        assert told and all(b is bias for b in told), told
    assert moved and all(m == (torch.device("cpu"), torch.float64) for m in moved), moved
    moved.clear()
    check_module(build, dtype=torch.float32, max_examples=2)
    assert moved and all(m == (torch.device("cpu"), torch.float32) for m in moved), moved


class _Unnamed(nn.Module):
    """Projections under names no loader knows, without biases: only a load of its own can fill them."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads = num_heads, num_kv_heads
        self.alpha = nn.Linear(d_model, num_heads * d_head, bias=False)
        self.beta = nn.Linear(d_model, num_kv_heads * d_head, bias=False)
        self.gamma = nn.Linear(d_model, num_kv_heads * d_head, bias=False)
        self.delta = nn.Linear(num_heads * d_head, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q = ssm.split_heads(self.alpha(x), self.heads)
        k, v = ssm.split_heads(self.beta(x), self.kv_heads), ssm.split_heads(self.gamma(x), self.kv_heads)
        return self.delta(ssm.merge_heads(ssm.scaled_dot_product_attention(q, k, v)))


def test_check_module_loads_with_the_given_load_and_checks_against_the_weights_it_returns() -> None:
    """`load=` replaces the default loader (which cannot read this module), and the weights it returns (the drawn
    ones without their biases, which the module has not) are the ones the reference computes with; a load that
    returns None leaves the reference the drawn weights. Without it, or where it raises (with or without a
    message), the failure says what raised, first, then the config."""

    def load(module: nn.Module, w: AttentionWeights) -> AttentionWeights:
        with torch.no_grad():
            for name, weight in zip(("alpha", "beta", "gamma", "delta"), (w.w_q, w.w_k, w.w_v, w.w_o), strict=True):
                getattr(module, name).weight.copy_(weight)
        return replace(w, b_q=None, b_k=None, b_v=None, b_o=None)

    check_module(_Unnamed, load=load, bias=True, max_examples=5)

    def load_in_place(module: nn.Module, w: AttentionWeights) -> None:
        load(module, w)

    check_module(_Unnamed, load=load_in_place, bias=False, max_examples=5)  # None: the drawn weights, as they are
    with pytest.raises(
        AssertionError,
        match=r"^building the module or loading the drawn weights raised ValueError: load_weights: no q/k/v/o "
        r"projection found in _Unnamed [^\n]*\n  smallest failing config: seq=1, batch=1, ",
    ):
        check_module(_Unnamed, max_examples=1)

    def refuses(module: nn.Module, w: AttentionWeights) -> None:
        raise KeyError

    with pytest.raises(AssertionError, match=r"^building the module or loading the drawn weights raised KeyError: \n"):
        check_module(_Unnamed, load=refuses, max_examples=1)


# --- the report's lines -------------------------------------------------------------------------------------


def _wrong_at(batch: int, position: int, feature: int) -> Callable[..., Tensor]:
    """The reference's own output (self- or cross-attention), one element of it off by 1."""

    def fn(x: Tensor, w: AttentionWeights, *, memory: Tensor | None = None, **kwargs: Any) -> Tensor:
        source = x if memory is None else memory
        out = per_head_attention(x, source, source, w, **kwargs).clone()
        out[batch, position, feature] += 1.0
        return out

    return fn


def test_the_report_describes_the_failing_config_in_full() -> None:
    """The config line names every size, the projections with a bias where not all four have one, kv_seq where it
    is not seq, the kind, the group and the dtype, from the config the check ran."""
    cross = AttentionConfig(batch=2, seq=3, kv_seq=5, d_model=8, num_heads=4, num_kv_heads=2, d_head=2, bias=True,
                            bias_on="qkv")  # fmt: skip
    with pytest.raises(AssertionError) as caught:
        check_attention(_wrong_at(0, 0, 0), configs=st.just(cross), cross=True, is_causal=True, dtype=torch.float32)
    assert (
        "smallest failing config: seq=3, batch=2, d_model=8, num_heads=4, num_kv_heads=2, d_head=2, bias='qkv', "
        "is_causal=True, kv_seq=5 (gqa, group=2, float32)\n"
    ) in str(caught.value), str(caught.value)
    for bias, named in ((True, "True"), (False, "False")):
        plain = AttentionConfig(batch=1, seq=2, kv_seq=2, d_model=6, num_heads=3, num_kv_heads=1, d_head=2, bias=bias)
        with pytest.raises(AssertionError) as caught:
            check_attention(_wrong_at(0, 0, 0), configs=st.just(plain))
        assert (
            "smallest failing config: seq=2, batch=1, d_model=6, num_heads=3, num_kv_heads=1, d_head=2, "
            f"bias={named}, is_causal=False (mqa, group=3, float64)\n"
        ) in str(caught.value), str(caught.value)


def test_the_report_locates_the_largest_deviation() -> None:
    """A single wrong element is named by its batch, query position and output feature."""
    config = AttentionConfig(batch=3, seq=4, kv_seq=4, d_model=6, num_heads=2, num_kv_heads=2, d_head=3, bias=False)
    for batch, position, feature in ((2, 1, 5), (1, 3, 0), (0, 2, 4)):
        with pytest.raises(AssertionError) as caught:
            check_attention(_wrong_at(batch, position, feature), configs=st.just(config))
        where = f"largest deviation at batch {batch}, query position {position}, output feature {feature}"
        assert where in str(caught.value), str(caught.value)


# --- every option reaches the check ---------------------------------------------------------------------------


def test_the_budget_device_and_thresholds_reach_the_check() -> None:
    """check_attention and check_module honour `settings=` and `max_examples=` (the budget, exactly, on a passing
    check), `device=` (meta, which holds no values, is refused by name) and `thresholds=` (the draws land by them:
    without, none of these 50 does)."""
    from hypothesis import settings

    seen: list[tuple[int, ...]] = []
    check_attention(_recording(seen), settings=settings(max_examples=7))
    assert len(seen) == 7
    forwarded: list[int] = []

    def forward(module: nn.Module, x: Tensor, is_causal: bool) -> Tensor:
        forwarded.append(x.shape[1])
        return module(x)

    build = lambda d, h, hkv, dh, bias: ssm.MultiHeadAttention(d, h, hkv, d_head=dh, bias=bias)  # noqa: E731
    check_module(build, forward=forward, settings=settings(max_examples=6))
    assert len(forwarded) == 6
    seen.clear()
    forwarded.clear()
    check_attention(_recording(seen), max_examples=4)
    check_module(build, forward=forward, max_examples=3)
    assert (len(seen), len(forwarded)) == (4, 3)
    refused = (
        r"^device='meta': these checks compare values with the reference, and meta tensors hold none; check on cpu or "
        r"cuda \(shapesafe_mha.prove checks shapes, which meta can\).$"
    )
    with pytest.raises(ssm.ConfigError, match=refused):
        check_attention(attention, device="meta")
    with pytest.raises(ssm.ConfigError, match=refused):
        check_module(build, device=torch.device("meta"))
    near = tuple(range(290, 311))  # sizes where an implementation switches: a quarter of the draws lands by them
    seen.clear()
    check_attention(_recording(seen), thresholds=near, max_examples=50)
    assert sum(289 <= seq <= 311 for seq, *_ in seen) >= 3, sorted({seq for seq, *_ in seen})
    forwarded.clear()
    check_module(build, forward=forward, thresholds=near, max_examples=50)
    assert sum(289 <= seq <= 311 for seq in forwarded) >= 3, sorted(set(forwarded))


class _Tiled(nn.Module):
    """A module whose query head i reads KV head i % num_kv_heads (x-transformers' convention), nn.Linear names."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads = num_heads, num_kv_heads
        self.q_proj = nn.Linear(d_model, num_heads * d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        w = AttentionWeights(*(p.weight for p in projections), *(p.bias for p in projections))
        return attention(x, w, num_heads=self.heads, num_kv_heads=self.kv_heads, is_causal=False,
                         bug="repeat_not_repeat_interleave")  # fmt: skip


def test_check_module_checks_the_grouped_convention_by_default_and_names_the_tiled_one() -> None:
    """Like check_attention, check_module's default is i // group: a tiled module fails it, with the hint that
    names its convention, and passes kv_heads="interleaved"."""
    with pytest.raises(AssertionError, match=r'KV heads tiled.*pass kv_heads="interleaved"'):
        check_module(_Tiled, kinds=("gqa",))
    check_module(_Tiled, kinds=("gqa",), kv_heads="interleaved", max_examples=10)


def test_check_modules_draws_and_tolerance_are_those_asked_for() -> None:
    """check_module's configs=, bias, max_heads, even_d_head and d_model_is_inner bound every draw (as the factory
    sees it), and atol/rtol set the tolerance, as in check_attention."""
    seen: list[tuple[int, ...]] = []

    def build(d_model: int, h: int, hkv: int, d_head: int, bias: bool) -> nn.Module:
        seen.append((d_model, h, hkv, d_head))
        return ssm.MultiHeadAttention(d_model, h, hkv, d_head=d_head, bias=bias)

    def forward(module: nn.Module, x: Tensor, is_causal: bool) -> Tensor:
        seen.append((x.shape[1],))
        return module(x)

    check_module(build, forward=forward, configs=attention_configs(kinds=("gqa",), max_seq=4), max_examples=10)
    sizes, seqs = [s for s in seen if len(s) == 4], [s[0] for s in seen if len(s) == 1]
    assert sizes and seqs and all(h > hkv > 1 for _, h, hkv, _ in sizes) and max(seqs) <= 4
    seen.clear()
    check_module(build, max_heads=4, even_d_head=True, d_model_is_inner=True, max_examples=20)
    assert seen and all(h <= 4 and d_head % 2 == 0 and d_model == h * d_head for d_model, h, _, d_head in seen)

    def off_by(offset: float) -> Callable[..., nn.Module]:
        class Off(ssm.MultiHeadAttention):
            def forward(self, query: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # type: ignore[override]
                return super().forward(query, *args, **kwargs) + offset  # type: ignore[operator]

        return lambda d, h, hkv, dh, bias: Off(d, h, hkv, d_head=dh, bias=bias)

    with pytest.raises(AssertionError, match=r"tolerance 1e-08"):
        check_module(off_by(1e-6), max_examples=5)
    check_module(off_by(1e-6), atol=1e-5, max_examples=5)
    with pytest.raises(AssertionError, match=r"tolerance atol=0, rtol=1e-09"):
        check_module(off_by(1e-6), atol=0, rtol=1e-9, max_examples=5)


def test_rope_passes_the_drawn_theta_and_positions_that_start_anywhere_from_0_to_64() -> None:
    """rope=True passes the config's own rope_theta (several are drawn) and positions (batch, seq) that count up
    from a drawn start, the same in every row; the starts are 0 (the first step) and others, up to 64."""
    thetas: set[float] = set()
    starts: list[int] = []

    def recording(x: Tensor, w: AttentionWeights, *, rope_theta: float, positions: Tensor, **kwargs: Any) -> Tensor:
        thetas.add(rope_theta)
        start = int(positions[0, 0])
        assert positions.shape == x.shape[:2], (positions.shape, x.shape)
        assert torch.equal(positions, (start + torch.arange(x.shape[1])).expand(x.shape[0], -1)), positions
        starts.append(start)
        return _module_call(x, w, rope_theta=rope_theta, positions=positions, **kwargs)

    check_attention(recording, rope=True, max_examples=50)
    assert len(thetas) > 1 and thetas <= {10.0, 10000.0, 500000.0}, thetas
    assert min(starts) == 0 and 32 < max(starts) <= 64, sorted(set(starts))


def test_rope_pairs_are_rotate_half_by_default_and_gpt_j_pairs_are_named() -> None:
    """The default rope_style is Llama's rotate_half: GPT-J's interleaved pairs fail it, named as the flag of
    adjacent pairs (2i, 2i+1) set where the halves were asked, and pass rope_style="interleaved"."""

    def gpt_j(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return per_head_attention(x, x, x, w, rope_style="interleaved", **kwargs)

    with pytest.raises(AssertionError, match=r"rope_interleaved=True where False was asked \(RoPE pairs adjacent"):
        check_attention(gpt_j, rope=True)
    check_attention(gpt_j, rope=True, rope_style="interleaved", max_examples=5)


def test_a_failed_check_carries_how_far_off_its_example_was() -> None:
    """The raised error's `deviation` (what the CLI's suite reports as the worst) is the failing example's largest
    deviation for a wrong value or float32 rounding, and None where nothing was compared (the code raised)."""
    from shapesafe_mha.testing import FailedCheckError

    def softmax_in_float32(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x.float(), _cast(w, torch.float32), **kwargs).double()

    for fn, off in ((_off_by(1e-3), 1e-3), (softmax_in_float32, None)):
        with pytest.raises(FailedCheckError) as caught:
            check_attention(fn, max_examples=5)
        deviation = caught.value.deviation
        assert deviation is not None and (deviation == pytest.approx(off, rel=1e-6) if off else 0 < deviation < 1e-5)

    def crashes(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        raise RuntimeError("boom")

    with pytest.raises(FailedCheckError) as caught:
        check_attention(crashes, max_examples=1)
    assert caught.value.deviation is None


def _cast(w: AttentionWeights, dtype: torch.dtype) -> AttentionWeights:
    return AttentionWeights(**{f.name: None if (t := getattr(w, f.name)) is None else t.to(dtype) for f in fields(w)})


def test_the_suites_own_module_check_keeps_check_attentions_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI suite compares our module under check_attention's default convention (i // group): were the module
    to tile its KV heads, its failure would name i % num_kv_heads with the hint, as check_attention's does, after a
    config line that ends with the config (the suite's properties add no note to it); and its tolerance is the
    dtype's."""
    from shapesafe_mha.testing import _suite

    def tiled(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x, w, bug="repeat_not_repeat_interleave", **kwargs)

    monkeypatch.setattr(_suite, "_module_fn", tiled)
    prop = ("module == per-head reference (GQA)", _suite._module_vs_reference(False), ("gqa",), False)
    (outcome,) = _suite.run_suite(device="cpu", dtype=torch.float64, examples=20, properties=[prop])
    assert outcome.failure is not None and re.search(r'KV heads tiled.*pass kv_heads="interleaved"', outcome.failure)
    assert re.search(r"smallest failing config: [^\n]*\(gqa, group=\d+, float64\)\n", outcome.failure), outcome.failure
    monkeypatch.setattr(_suite, "_module_fn", _off_by(1e-6))  # float64's own tolerance, 1e-8, applies
    (outcome,) = _suite.run_suite(device="cpu", dtype=torch.float64, examples=5, properties=[prop])
    assert outcome.failure is not None and "(tolerance 1e-08)" in outcome.failure, outcome.failure


def test_an_exception_without_a_message_is_reported_by_its_type() -> None:
    """An exception whose message is empty is still a readable failure: its type, and the cause chained."""

    def crashes(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        raise NotImplementedError

    with pytest.raises(AssertionError, match=r"^the implementation raised NotImplementedError: \n  smallest") as caught:
        check_attention(crashes, max_examples=1)
    assert isinstance(caught.value.__cause__, NotImplementedError)


def test_the_default_draws_keep_odd_head_widths_and_self_attention_keys_at_seq() -> None:
    """Without constraints the draws include odd head widths (d_head 1 among them, where RoPE is off); a check
    without cross= draws configs whose kv_seq is seq (a failure shrunk to seq=3 names no kv_seq of 1), and cross=True
    draws both."""
    seen: list[tuple[int, ...]] = []
    check_attention(_recording(seen), max_examples=30)
    widths = {d_head for *_, d_head, _, _, _, _ in seen}
    assert 1 in widths and any(w % 2 for w in widths if w > 1), widths

    def wrong_from_3(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return attention(x, w, **kwargs) + (x.shape[1] >= 3)

    with pytest.raises(AssertionError, match=r"smallest failing config: seq=3, ") as caught:
        check_attention(wrong_from_3)
    assert "kv_seq" not in str(caught.value), str(caught.value)
    lengths: list[tuple[int, int]] = []

    def cross(x: Tensor, w: AttentionWeights, *, memory: Tensor, **kwargs: Any) -> Tensor:
        lengths.append((x.shape[1], memory.shape[1]))
        return per_head_attention(x, memory, memory, w, **kwargs)

    check_attention(cross, cross=True, max_examples=20)
    assert any(seq != kv_seq for seq, kv_seq in lengths), lengths


def test_a_dtype_without_its_own_tolerance_gets_float32s() -> None:
    """tolerance() answers every dtype: one the table does not list (complex, float8) gets float32's."""
    for dtype in (torch.complex64, torch.complex128, torch.float8_e4m3fn):
        assert tolerance(dtype) == tolerance(torch.float32), dtype


# --- the verdict on one example -----------------------------------------------------------------------------


def test_an_output_of_another_shape_or_not_a_tensor_is_reported_with_both_shapes() -> None:
    """An output one query short, None, or an (output, weights) tuple fails before any value is compared: the report
    gives what came back (its shape, or its type where it is no tensor) and the shape expected, then the config."""
    config = AttentionConfig(batch=2, seq=3, kv_seq=3, d_model=4, num_heads=2, num_kv_heads=1, d_head=2, bias=False)

    def reference(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return per_head_attention(x, x, x, w, **kwargs)

    returns = {
        r"shape \(2, 2, 4\)": lambda x, w, **kwargs: reference(x, w, **kwargs)[:, :-1],
        "shape NoneType": lambda x, w, **kwargs: None,
        "shape tuple": lambda x, w, **kwargs: (reference(x, w, **kwargs), None),
    }
    for returned, fn in returns.items():
        with pytest.raises(
            AssertionError,
            match=rf"^the implementation returned {returned}, expected \(2, 3, 4\)\n  smallest failing config: seq=3, "
            r"batch=2, d_model=4, num_heads=2, num_kv_heads=1, d_head=2, bias=False, is_causal=False \(mqa, group=2, "
            r"float64\)$",
        ):
            check_attention(fn, configs=st.just(config), max_examples=1)


def test_atol_0_accepts_the_references_own_bits() -> None:
    """The reference itself, called as the check calls it, passes atol=0: equal bits are within any tolerance."""

    def reference(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return per_head_attention(x, x, x, w, **kwargs)

    check_attention(reference, atol=0, max_examples=20)
    check_attention(reference, atol=0, is_causal=True, max_examples=20)


def _zero_scenario(batch: int = 1) -> Any:
    """A scenario whose reference output is exactly zero (every weight is), so a deviation is exactly what is added."""
    from shapesafe_mha.testing._diagnose import Scenario

    x = torch.randn(batch, 2, 4, dtype=torch.float64)
    zero = AttentionWeights(*(torch.zeros(4, 4, dtype=torch.float64),) * 4)
    return Scenario.of(x, x, x, zero, num_heads=2, num_kv_heads=2)


def test_a_float64_deviation_of_exactly_1e_5_is_float32_rounding_which_the_advised_atol_accepts() -> None:
    """float32 rounding inside a float64 check is a deviation up to 1e-5 inclusive, the atol the report advises: off
    by exactly 1e-5 it is named rounding (no wrong formula gives an output 1e-5 off everywhere), accepted by that atol
    and by a lenient check (check_hf_attention's default)."""
    from shapesafe_mha.testing._diagnose import FLOAT32_INSIDE, Tolerance
    from shapesafe_mha.testing._toolkit import judge

    scenario = _zero_scenario()
    got = torch.full((1, 2, 4), FLOAT32_INSIDE, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"float32 rounding, not a wrong formula.*pass atol=1e-05 to accept that"):
        judge(got, scenario, Tolerance(1e-8), torch.float64, "here")
    assert judge(got, scenario, Tolerance(1e-8), torch.float64, "here", lenient_float64=True) == FLOAT32_INSIDE
    assert judge(got, scenario, Tolerance(FLOAT32_INSIDE), torch.float64, "here") == FLOAT32_INSIDE


def test_an_empty_output_deviates_by_nothing() -> None:
    """A batch of 0 has no output to be off: its deviation (what the CLI's suite reports as the worst) is 0."""
    from shapesafe_mha.testing._diagnose import Tolerance
    from shapesafe_mha.testing._toolkit import judge

    assert judge(torch.zeros(0, 2, 4, dtype=torch.float64), _zero_scenario(0), Tolerance(0.0), torch.float64, "") == 0


def test_a_wrong_formula_off_by_less_than_1e_5_on_the_rows_that_count_is_named_not_called_rounding() -> None:
    """Where only some query rows count (the padded ones do not), a float64 output a wrong formula gives exactly on
    those rows is named as that formula, even with a deviation under 1e-5 (tiny output weights), not as float32
    rounding: the variant is compared on the same rows."""
    from shapesafe_mha.testing._diagnose import Scenario, Tolerance
    from shapesafe_mha.testing._toolkit import judge

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=generator)
    w = AttentionWeights(*(torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(4)))
    scenario = Scenario.of(x, x, x, replace(w, w_o=w.w_o * 1e-7), num_heads=2, num_kv_heads=2)  # d_head 4, d_model 8
    rows = torch.tensor([[True, True, False], [True, False, False]])
    got = replace(scenario, scale=8**-0.5).expected()[rows]
    with pytest.raises(AssertionError) as caught:
        judge(got, scenario, Tolerance(1e-12), torch.float64, "here", rows=rows)
    deviation = caught.value.deviation  # type: ignore[attr-defined]
    assert 0 < deviation < 1e-5 and "float32 rounding" not in str(caught.value), str(caught.value)
    assert "scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)" in caught.value.report()  # type: ignore[attr-defined]


def test_an_error_that_is_no_failed_check_reaches_the_caller_as_raised_without_hypothesis_notes() -> None:
    """An exception of the user's that is no failed check (here a mod factory's) is raised as it is, its message alone:
    hypothesis' notes (the falsifying call, the drawn tensors) are not attached to it."""

    def reference(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return per_head_attention(x, x, x, w, **kwargs)

    def factory(config: AttentionConfig) -> Any:
        raise LookupError(f"no score_mod for {config.num_heads} heads")

    with pytest.raises(LookupError, match=r"^no score_mod for \d+ heads$") as caught:
        check_attention(reference, score_mod=factory, max_examples=3)
    assert not hasattr(caught.value, "__notes__"), caught.value.__notes__


def test_the_wrong_head_is_located_on_the_rows_that_count() -> None:
    """Where only some query rows count, the heads are told apart on those rows: code whose head 1 scales its queries
    (run returns the counted rows, as check_hf_attention's padding property does) is reported as head 1 alone."""
    from shapesafe_mha.testing._diagnose import Scenario, Tolerance
    from shapesafe_mha.testing._toolkit import judge

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=generator)
    w = AttentionWeights(*(torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(4)))
    scenario = Scenario.of(x, x, x, w, num_heads=2, num_kv_heads=2)
    rows = torch.tensor([[True, True, False], [True, False, False]])

    def run(weights: AttentionWeights) -> Tensor:
        scaled = weights.w_q.clone()
        scaled[4:] *= 3.0
        return replace(scenario, weights=replace(weights, w_q=scaled)).expected()[rows]

    with pytest.raises(AssertionError) as caught:
        judge(run(w), scenario, Tolerance(1e-8), torch.float64, "here", run=run, rows=rows)
    assert "wrong heads: [1] of 2" in caught.value.report()  # type: ignore[attr-defined]


def test_without_configs_the_property_draws_the_kinds_cross_attention_and_thresholds_asked_for() -> None:
    """run_property without configs= (the CLI suite's way) draws its own: only the kinds asked for, cross-attention
    (kv_seq apart from seq) where cross=True and self-attention (kv_seq == seq) where not, lengths by the thresholds
    given; each example's deviation is handed to on_example, as many as the budget."""
    from shapesafe_mha.testing._toolkit import run_property

    seen: list[AttentionConfig] = []
    deviations: list[float] = []

    def check(config: AttentionConfig, data: Any) -> float:
        seen.append(config)
        return float(len(seen))

    near = tuple(range(290, 311))
    run_property(check, kinds=("gqa",), max_examples=50, cross=True, thresholds=near, on_example=deviations.append)
    assert len(seen) == 50 and deviations == [float(i) for i in range(1, 51)]
    assert all(config.kind == "gqa" for config in seen), {config.kind for config in seen}
    assert any(config.kv_seq != config.seq for config in seen)
    assert sum(289 <= config.seq <= 311 or 289 <= config.kv_seq <= 311 for config in seen) >= 3, seen  # none without
    seen.clear()
    run_property(check, kinds=("mha", "mqa"), max_examples=30, cross=False)
    assert len(seen) == 30 and all(config.kv_seq == config.seq for config in seen)
    assert {config.kind for config in seen} == {"mha", "mqa"}


def test_masks_true_catches_an_attn_mask_ignored_and_draws_float_masks_that_add_0_where_keys_are_kept() -> None:
    """masks=True hands the code an attn_mask it must apply (ignoring it fails the check), bool or float; a float
    mask is additive: 0 where the key may be attended and a large negative (at most -1e4: exp underflows to 0)
    where not, and like the bool masks (keys kept with probability 0.5 to 0.95) it keeps most keys."""
    masks: list[Tensor] = []

    def recording(x: Tensor, w: AttentionWeights, *, attn_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        if attn_mask is not None:
            masks.append(attn_mask)
        return per_head_attention(x, x, x, w, attn_mask=attn_mask, **kwargs)

    check_attention(recording, masks=True, max_examples=50)
    floats = [mask for mask in masks if mask.is_floating_point()]
    bools = [mask for mask in masks if mask.dtype == torch.bool]
    assert floats and bools, [mask.dtype for mask in masks]
    values = torch.cat([mask.flatten() for mask in floats])
    assert bool(((values == 0) | (values <= -1e4)).all()), values.unique()
    assert (values == 0).double().mean() > 0.5 and torch.cat([m.flatten() for m in bools]).double().mean() > 0.5

    def ignores_attn_mask(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        kwargs.pop("attn_mask")
        return per_head_attention(x, x, x, w, **kwargs)

    with pytest.raises(AssertionError, match=r"^the implementation differs from the per-head reference by "):
        check_attention(ignores_attn_mask, masks=True)


def test_a_verbose_hypothesis_profile_names_each_draw(capsys: pytest.CaptureFixture[str]) -> None:
    """Under hypothesis' verbose verbosity each example prints its draws, each named by what it is (weights, inputs,
    attn_mask, whether it is made float, padding, RoPE's first position): a user reading them knows which is which."""
    from hypothesis import Verbosity, settings

    def reference(x: Tensor, w: AttentionWeights, **kwargs: Any) -> Tensor:
        return per_head_attention(x, x, x, w, **kwargs)

    check_attention(reference, masks=True, rope=True, settings=settings(verbosity=Verbosity.verbose), max_examples=8)
    named = set(re.findall(r"^Draw \d+(?: \(([^)]*)\))?:", capsys.readouterr().out, re.MULTILINE))
    assert named == {"weights", "inputs", "attn_mask", "float mask", "padding", "first position"}, named


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))],
)
def test_every_tensor_the_check_draws_is_on_the_device_asked_for(device: str) -> None:
    """device= places every drawn tensor the code receives: the input, the weights, memory, both masks (a float
    attn_mask too) and RoPE's positions (on CPU this holds whether or not device= is passed on: run on CUDA)."""
    seen: set[torch.device] = set()

    def recording(x: Tensor, w: AttentionWeights, *, memory: Tensor | None = None, **kwargs: Any) -> Tensor:
        tensors = [x, memory, *(getattr(w, f.name) for f in fields(w)), *kwargs.values()]
        seen.update(t.device for t in tensors if isinstance(t, Tensor))
        source = x if memory is None else memory
        return per_head_attention(x, source, source, w, **kwargs)

    check_attention(recording, device=device, masks=True, rope=True, max_examples=25)
    check_attention(recording, device=device, cross=True, max_examples=10)
    assert seen == {torch.zeros(0, device=device).device}, seen


def test_a_module_that_cannot_be_loaded_is_reported_with_the_config_in_full() -> None:
    """Where building or loading the module fails, the report's config line is the same full line as a wrong value's:
    every size, is_causal and the dtype the check ran."""
    config = AttentionConfig(batch=2, seq=3, kv_seq=3, d_model=8, num_heads=4, num_kv_heads=2, d_head=2, bias=False)
    with pytest.raises(AssertionError) as caught:
        check_module(_Unnamed, configs=st.just(config), is_causal=True, dtype=torch.float32)
    assert str(caught.value).endswith(
        "\n  smallest failing config: seq=3, batch=2, d_model=8, num_heads=4, num_kv_heads=2, d_head=2, bias=False, "
        "is_causal=True (gqa, group=2, float32)"
    ), str(caught.value)


def _diagnosed(
    planted: dict[str, Any], asked: dict[str, Any], *, heads: tuple[int, int] = (2, 2), weights: Any = None
) -> list[Any]:
    """name_bug's matches for an output computed with `planted` (the code's mistake; `weights` changes the weights it
    uses) against a check that asked for `asked`: 6 positions, d_model 8, float64, biases on every projection."""
    from shapesafe_mha.testing._diagnose import Scenario, Tolerance, name_bug

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=generator)
    w = AttentionWeights(
        *(torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(4)),
        *(torch.randn(8, dtype=torch.float64, generator=generator) for _ in range(4)),
    )
    num_heads, num_kv_heads = heads
    if num_kv_heads != num_heads:
        w = replace(w, w_k=w.w_k[: 8 * num_kv_heads // num_heads], w_v=w.w_v[: 8 * num_kv_heads // num_heads],
                    b_k=w.b_k[: 8 * num_kv_heads // num_heads], b_v=w.b_v[: 8 * num_kv_heads // num_heads])  # fmt: skip
    scenario = Scenario.of(x, x, x, w, num_heads=num_heads, num_kv_heads=num_kv_heads, **asked)
    used = weights(w) if weights is not None else w
    got = per_head_attention(x, x, x, used, num_heads=num_heads, num_kv_heads=num_kv_heads, **planted)
    return name_bug(got, scenario, Tolerance(1e-9))


def _gen(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


_SLOPES = torch.tensor([0.5, 0.25], dtype=torch.float64)
_NORM = (1 + _gen(1, 4).abs(), 1 + _gen(2, 4).abs())
_ROPE = {"rope_theta": 10000.0}
_AT = torch.arange(6).expand(2, 6)
_TILED = (
    "KV heads tiled: query head i reads KV head i % num_kv_heads (`repeat` where `repeat_interleave` was meant); if "
    'that is your convention (x-transformers), pass kv_heads="interleaved"'
)
_GROUPED = (
    "query head i reads KV head i // group (transformers' repeat_kv, torch's enable_gqa), not i % num_kv_heads; if "
    'that is your convention, pass kv_heads="grouped"'
)
_VARIANTS = [
    ({"is_causal": True}, {"is_causal": True, "window": 3}, ("window", "window=3 not applied")),
    ({"is_causal": True, "window": 4}, {"is_causal": True, "window": 3}, ("window", "sliding window one key longer")),
    ({}, {"logit_softcap": 2.0}, ("logit_softcap", "logit_softcap=2.0 not applied")),
    ({}, {"sinks": _SLOPES}, ("attention_sinks", "attention_sinks=True not applied")),
    ({}, {"alibi_slopes": _SLOPES}, ("alibi", "alibi=True not applied")),
    ({"alibi_slopes": _SLOPES.flip(0)}, {"alibi_slopes": _SLOPES}, ("ALiBi", "ALiBi slopes in the reverse head order")),
    ({}, {"output_gate": (_gen(3, 8, 8), None)}, ("output_gate", "output_gate=True not applied")),
    ({}, {"out_norm": (1 + _gen(4, 8).abs(), 1e-6)}, ("output norm", "the merged heads' norm not applied")),
    ({"scale": 0.5}, {"scale": 0.3}, ("scaling", "scores scaled by 1/sqrt(d_head), not the config's scale")),
    ({}, {"qk_norm": _NORM}, ("qk_norm", "qk_norm=True not applied")),
    (
        {**_ROPE, "qk_norm": _NORM, "qk_norm_after_rope": True},
        {**_ROPE, "qk_norm": _NORM},
        ("qk_norm_after_rope", "qk_norm_after_rope=True where False was asked"),
    ),
    (
        {**_ROPE, "qk_norm": _NORM},
        {**_ROPE, "qk_norm": _NORM, "qk_norm_after_rope": True},
        ("qk_norm_after_rope", "qk_norm_after_rope=True not applied"),
    ),
    (
        {"qk_norm": _NORM},
        {"qk_norm": _NORM, "qk_norm_centred": True},
        ("qk_norm_centred", "qk_norm_centred=True not applied"),
    ),
    ({"scale": 1.0}, {}, ("scaling", "scores not scaled by 1/sqrt(d_head)")),
    ({"scale": 8**-0.5}, {}, ("scaling", "scores scaled by 1/sqrt(d_model) instead of 1/sqrt(d_head)")),
    ({}, {"is_causal": True}, ("mask", "no causal mask: every query sees every key")),
    ({"is_causal": True}, {}, ("mask", "a causal mask applied where none was asked for")),
    ({}, {"key_padding_mask": _AT >= 4}, ("padding/mask", "padding ignored: padded keys are attended to")),
    ({}, _ROPE, ("rope_theta", "rope_theta=10000.0 not applied")),
    (
        {**_ROPE, "positions": -_AT},
        _ROPE,
        ("RoPE/positions", "RoPE turned the wrong way (the sign of sin, or of rotate_half)"),
    ),
    (
        {**_ROPE, "rope_style": "interleaved"},
        _ROPE,
        ("rope_interleaved", "rope_interleaved=True where False was asked"),
    ),
    (
        {**_ROPE, "rope_style": "half"},
        {**_ROPE, "rope_style": "interleaved"},
        ("rope_interleaved", "rope_interleaved=True not applied"),
    ),
    (
        {**_ROPE, "positions": _AT + 1, "key_positions": _AT},
        _ROPE,
        ("RoPE/positions", "RoPE positions of the queries off by one against the keys'"),
    ),
    (
        {**_ROPE},
        {**_ROPE, "rotary_dim": 2},
        ("rope_dim", "rope_dim=2 not applied"),
    ),
]


@pytest.mark.parametrize(("planted", "asked", "named"), _VARIANTS, ids=[v[2][1][:40] for v in _VARIANTS])
def test_a_variant_the_code_got_wrong_is_named_as_that_mistake(
    planted: dict[str, Any], asked: dict[str, Any], named: tuple[str, str]
) -> None:
    """Code that computes attention with one thing left out or changed (a layer's window, softcapping, the scale, the
    causal mask, RoPE, ...) gives an output the diagnosis names as that mistake, in its words: an option of the layer
    not applied (or a flag of its part set the other way) by the option's name and value, then what the option is."""
    kind, words = named
    found = _diagnosed(planted, asked)
    assert any(k == kind and said.startswith(words) for k, said in found), found


def test_an_option_not_applied_is_named_with_the_words_of_its_description() -> None:
    """The fault an option derives says what the option is in the first words of its description in AttentionConfig,
    so no list of faults repeats the options."""
    found = dict(_diagnosed({"is_causal": True}, {"is_causal": True, "window": 3}))
    assert found["window"] == "window=3 not applied (sliding-window attention)", found


_LAYERS = [asked for _, asked, _ in _VARIANTS] + [
    {**_ROPE, "rotary_dim": 2, "rope_style": "interleaved"},
    {**_ROPE, "rotary_dim": 2, "qk_norm": _NORM, "qk_norm_after_rope": True, "window": 3},
]


@pytest.mark.parametrize("asked", _LAYERS, ids=[",".join(sorted(a)) or "plain" for a in _LAYERS])
def test_each_option_of_the_layer_derives_a_not_applied_fault_that_computes(asked: dict[str, Any]) -> None:
    """The diagnosis derives, for every option the layer sets (`config.variants()`), the fault "<option> not applied":
    the layer with that option at its default (and where the config refuses that alone, the option's whole part at
    its defaults: RoPE's pairs and rotated width have no meaning without RoPE), a layer the reference computes. A
    fault whose change the config refuses would be skipped in silence, and that mistake never named."""
    from shapesafe_mha.testing._diagnose import _DEFAULTS, Scenario, variants

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=generator)
    w = AttentionWeights(*(torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(4)))
    scenario = Scenario.of(x, x, x, w, num_heads=2, num_kv_heads=2, **asked)
    on = scenario.config.variants()
    derived = {
        kind: change
        for kind, said, change in variants(scenario)
        if said.startswith(f"{kind}=") and " not applied" in said
    }
    assert {kind for kind in derived if kind in on} == set(on), derived
    for name in on:
        fault = derived[name](scenario)
        assert getattr(fault.config, name) == _DEFAULTS[name], name
        assert fault.expected().shape == x.shape, name


@pytest.mark.parametrize(
    ("asked", "planted", "named"),
    [
        ({"kv_heads": "grouped"}, {"kv_heads": "interleaved"}, _TILED),
        ({"kv_heads": "interleaved"}, {"kv_heads": "grouped"}, _GROUPED),
    ],
    ids=["tiled", "grouped"],
)
def test_kv_heads_read_in_the_other_convention_are_named_with_the_option_to_pass(
    asked: dict[str, Any], planted: dict[str, Any], named: str
) -> None:
    """4 query heads over 2 KV heads read in the other order than the check was told: named, with the kv_heads= that
    says the code's convention."""
    assert ("heads", named) in _diagnosed(planted, asked, heads=(4, 2))


@pytest.mark.parametrize("role", "qkvo")
def test_a_bias_left_out_is_named_by_its_projection(role: str) -> None:
    """Code that drops one projection's bias is named as that projection's bias not added (not another's)."""
    found = _diagnosed({}, {}, weights=lambda w: replace(w, **{f"b_{role}": None}))
    assert [named for named in found if named[0] == "bias"] == [("bias", f"the {role} projection's bias not added")]


def test_keys_and_values_swapped_are_named() -> None:
    """Keys projected by the value weights and values by the key weights."""
    swap = lambda w: replace(w, w_k=w.w_v, w_v=w.w_k, b_k=w.b_v, b_v=w.b_k)  # noqa: E731
    assert ("k/v", "k and v swapped (keys from the value projection and values from the key projection)") in (
        _diagnosed({}, {}, weights=swap)
    )


@pytest.mark.parametrize("entry", ["check_attention", "check_module"])
def test_a_failed_check_is_the_public_error_its_report_first_and_none_of_our_frames(entry: str) -> None:
    """A failure is `shapesafe_mha.testing.FailedCheckError` (an AssertionError, named by its public path); the report
    starts with the property, the smallest failing config and the bug class; its traceback holds the public call's
    frame and none of the toolkit's below it (pytest hides that one too)."""
    import traceback

    from shapesafe_mha.testing import FailedCheckError

    assert FailedCheckError.__module__ == "shapesafe_mha.testing" and issubclass(FailedCheckError, AssertionError)
    with pytest.raises(FailedCheckError) as caught:
        if entry == "check_attention":
            check_attention(_planted("merge_without_transpose"), kinds=("gqa",))
        else:

            class Unmoved(nn.Module):
                def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> None:
                    super().__init__()
                    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
                    self.q_proj = nn.Linear(d_model, num_heads * d_head, bias=bias)
                    self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=bias)
                    self.k_proj, self.v_proj = (nn.Linear(d_model, num_kv_heads * d_head, bias=bias) for _ in "kv")

                def forward(self, x: Tensor) -> Tensor:
                    w = AttentionWeights(
                        self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.o_proj.weight,
                        self.q_proj.bias, self.k_proj.bias, self.v_proj.bias, self.o_proj.bias,
                    )  # fmt: skip
                    return attention(x, w, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, is_causal=False,
                                     bug="merge_without_transpose")  # fmt: skip

            check_module(Unmoved, kinds=("gqa",))
    assert type(caught.value).__qualname__ == "FailedCheckError"
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("the implementation differs from the per-head reference by "), lines
    assert lines[1].startswith("  smallest failing config: seq="), lines
    assert lines[2].startswith("  bug class: heads: the output matches the reference with heads merged without the "
                               "transpose"), lines  # fmt: skip
    ours = [f.name for f in traceback.extract_tb(caught.value.__traceback__) if "shapesafe_mha" in f.filename]
    assert ours == [entry], ours
