"""check_attention and check_module catch every classic attention bug, readably, and pass correct code."""

import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import shapesafe_mha as ssm
from shapesafe_mha import AttentionWeights
from shapesafe_mha.testing import check_attention, check_module

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
    if "differs" in report:
        assert re.search(r"query position \d+", report) and ("head" in report), report


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
