"""check_attention and check_module catch every classic attention bug, readably, and pass correct code."""

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shapesafe_mha as ssm
from shapesafe_mha import AttentionWeights
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import attention_configs, check_attention, check_module

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
        offset = -1 if bug == "causal_off_by_one" else 0
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
    ],
)
def test_the_report_names_the_bug_class(bug: str, named: str) -> None:
    """The wrong output equals the reference with that one mistake made: the report says which, in its words to the
    end of the description."""
    with pytest.raises(AssertionError) as caught:
        check_attention(_planted(bug), is_causal=bug == "causal_off_by_one", kinds=("gqa",))
    assert re.search(rf"with {re.escape(named)}(;|$)", str(caught.value), re.MULTILINE), str(caught.value)


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
    with pytest.raises(ValueError, match="either configs= or constraints"):
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
    with pytest.raises(AssertionError, match=r"RoPE rotates pairs \(i, i \+ d_head/2\) where \(2i, 2i\+1\) was meant"):
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
