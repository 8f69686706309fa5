"""Behaviours that a curated mutation run found unpinned: each test states one and fails without it."""

import math
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import (
    AttentionConfig,  # noqa: F401  (re-exported type, used in annotations)
    attention_configs,
    attention_inputs,
    check_attention,
    projection_weights,
    tolerance,
)

F64 = {"atol": 1e-10, "rtol": 1e-8}


def _module(num_kv_heads: int = 2, **kwargs: Any) -> ssm.MultiHeadAttention:
    torch.manual_seed(0)
    return ssm.MultiHeadAttention(32, 4, num_kv_heads, dtype=torch.float64, **kwargs)


def _x(batch: int = 2, seq: int = 6) -> torch.Tensor:
    return torch.randn(batch, seq, 32, dtype=torch.float64)


# --- masks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_a_float_mask_keeps_causality_and_key_padding(num_kv_heads: int) -> None:
    """A float attn_mask is added to the scores; is_causal and key_padding_mask still forbid their keys."""
    module, x = _module(num_kv_heads), _x()
    float_mask = torch.randn(6, 6, dtype=torch.float64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 4:] = True
    out = module(x, attn_mask=float_mask, key_padding_mask=padding, is_causal=True)
    expected = per_head_attention(
        x, x, x, module.weights(), num_heads=4, num_kv_heads=num_kv_heads,
        attn_mask=float_mask, key_padding_mask=padding, is_causal=True,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **F64)
    # Independent of the reference: changing a future or a padded key changes nothing.
    later = x.clone()
    later[:, 5] += 10.0
    changed = module(later, attn_mask=float_mask, key_padding_mask=padding, is_causal=True)
    torch.testing.assert_close(changed[:, :5], out[:, :5], **F64)


def test_masks_on_another_device_are_refused() -> None:
    module, x = _module(), _x()
    with pytest.raises(ssm.ShapeError, match="attn_mask is on meta, but the module's parameters are on cpu"):
        module(x, attn_mask=torch.ones(6, 6, dtype=torch.bool, device="meta"))
    with pytest.raises(ssm.ShapeError, match="key_padding_mask is on meta"):
        module(x, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool, device="meta"))
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ssm.ShapeError, match="attn_mask is on meta, but q is on cpu"):
        ssm.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool, device="meta"))


def test_q_k_v_of_different_float_dtypes_are_refused_by_the_stages() -> None:
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ssm.ShapeError, match="k has dtype float64, but q has float32"):
        ssm.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(ssm.ShapeError, match="v has dtype float16, but q has float32"):
        ssm.scaled_dot_product_attention(q, q, q.half())
    with pytest.raises(ssm.ShapeError, match="weight has dtype float64, but x has float32"):
        ssm.project(torch.randn(1, 3, 8), torch.randn(4, 8, dtype=torch.float64))


@given(data=st.data())
def test_causal_rows_before_every_key_are_zeros_on_every_path(data: st.DataObject) -> None:
    """seq > kv_seq, causal: the first seq - kv_seq queries see no key; zeros (never NaN), as the reference."""
    config = data.draw(attention_configs(max_seq=20), label="config")
    if config.seq <= config.kv_seq:
        config = type(config)(**(config.as_dict() | {"seq": config.kv_seq + 1}))
    weights = data.draw(projection_weights(config))
    inputs = data.draw(attention_inputs(config))
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    need_weights = data.draw(st.booleans(), label="need_weights")
    with torch.set_grad_enabled(data.draw(st.booleans(), label="grad")):
        out = module(inputs.query, inputs.key, inputs.value, is_causal=True, need_weights=need_weights)
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()
    expected = per_head_attention(
        inputs.query, inputs.key, inputs.value, weights,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=True,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **F64)  # NaN != NaN: a NaN would fail here too


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_need_weights_returns_each_heads_probabilities(num_kv_heads: int) -> None:
    """Per head, not averaged: row h equals softmax(q_h k_g^T / sqrt(d_head)) computed here from the weights."""
    module, x = _module(num_kv_heads), _x(1, 5)
    _, probabilities = module(x, need_weights=True)
    w = module.weights()
    group = 4 // num_kv_heads
    for head in range(4):
        kv = head // group
        q = x @ w.w_q[head * 8 : (head + 1) * 8].T + w.b_q[head * 8 : (head + 1) * 8]  # pyright: ignore[reportOptionalSubscript]
        k = x @ w.w_k[kv * 8 : (kv + 1) * 8].T + w.b_k[kv * 8 : (kv + 1) * 8]  # pyright: ignore[reportOptionalSubscript]
        expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
        torch.testing.assert_close(probabilities[:, head], expected, **F64)


# --- dropout ---------------------------------------------------------------------------------------------


def test_dropout_acts_in_training_only_and_from_torch_carries_it() -> None:
    module, x = _module(dropout=0.5), _x()
    expected = per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(module.eval()(x), expected, **F64)
    module.train()
    torch.manual_seed(1)
    assert not torch.allclose(module(x), expected)
    theirs = torch.nn.MultiheadAttention(32, 4, dropout=0.25, batch_first=True)
    assert ssm.MultiHeadAttention.from_torch(theirs).dropout == 0.25


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_dropout_zeroes_some_probabilities_and_divides_the_rest_by_the_keep_rate(
    softcap: float | None, num_kv_heads: int, device: str
) -> None:
    """Dropout acts on the probabilities, MHA and GQA: with the identity for values, the output is the weights with
    each entry either 0 or divided by 1 - dropout_p (both occur), and a query allowed no key stays zeros, never NaN."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, m, 8, generator=generator).to(device) for n, m in ((4, 5), (num_kv_heads, 8)))
    values = torch.eye(8, device=device).expand(2, num_kv_heads, 8, 8)  # output row = the query's weights
    mask = torch.ones(5, 8, dtype=torch.bool, device=device)
    mask[1] = False
    weights = ssm.attention_weights(q, k, attn_mask=mask, softcap=softcap)
    torch.manual_seed(0)
    out = ssm.scaled_dot_product_attention(q, k, values, attn_mask=mask, dropout_p=0.25, softcap=softcap)
    kept = out != 0
    torch.testing.assert_close(out[kept], weights[kept] / 0.75)
    assert kept.any() and (~kept & (weights != 0)).any()
    assert torch.all(out[:, :, 1] == 0)


# --- verdicts and the cache ------------------------------------------------------------------------------


def test_a_verdict_covers_keyword_arguments_too() -> None:
    """A right call with a keyword, then the same call with a wrong value for it: rejected."""
    q = torch.randn(1, 4, 3, 8)
    good, bad = torch.ones(3, 3, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)
    ssm.scaled_dot_product_attention(q, q, q, attn_mask=good)
    with pytest.raises(ssm.ShapeError, match=r"attn_mask has kv_seq=4"):
        ssm.scaled_dot_product_attention(q, q, q, attn_mask=bad)
    ssm.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    with pytest.raises(ssm.ConfigError, match=r"dropout_p must be in \[0, 1\)"):
        ssm.scaled_dot_product_attention(q, q, q, dropout_p=1.5)


def test_a_failed_write_leaves_the_cache_length_alone() -> None:
    """Even unchecked, an append that torch rejects half way does not count the positions it did not write."""
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with ssm.unchecked(), pytest.raises(RuntimeError):
        cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5))
    assert len(cache) == 2


def test_appending_exactly_up_to_capacity_works_and_one_more_does_not() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = module.new_cache(batch=1, capacity=4)
    module(torch.randn(1, 3, 16), is_causal=True, kv_cache=cache)
    module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    assert len(cache) == cache.capacity == 4
    with pytest.raises(
        ssm.ShapeError, match="appending new=1 positions to the 4 in kv_cache would exceed its capacity=4"
    ):
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    direct = ssm.KVCache(1, 2, 3, 4, dtype=torch.float32)
    direct.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert len(direct) == 3


# --- tolerances measured per dtype -----------------------------------------------------------------------

# Worst deviation from the float64 reference over 20 seeds (GQA 32/8/2, causal): float32 2.4e-7,
# bfloat16 7.8e-3, float16 7.5e-4. The bounds are a few times those, far below a wrong answer (~1).
MEASURED_BOUNDS = {torch.float32: 1e-6, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", list(MEASURED_BOUNDS))
def test_every_float_dtype_is_within_its_measured_error_and_wrong_answers_are_not(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 8, 2, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    expected = per_head_attention(x, x, x, module.weights(), num_heads=8, num_kv_heads=2, is_causal=True)
    module = module.to(dtype)
    bound = MEASURED_BOUNDS[dtype]
    got = module(x.to(dtype), is_causal=True).double()
    assert (got - expected).abs().max() <= bound
    not_causal = module(x.to(dtype)).double()
    only_bias = module.o_proj.bias.double().expand_as(expected)  # pyright: ignore[reportOptionalMemberAccess]
    for wrong in (not_causal, only_bias):
        assert (wrong - expected).abs().max() > 10 * bound


# --- the toolkit's own sensitivity -----------------------------------------------------------------------


def _reference_fn(offset: float = 0.0, nan: bool = False) -> Any:
    """The reference itself, plus a constant offset (or a NaN): a deviation of exactly `offset`."""

    def fn(x: torch.Tensor, w: Any, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> torch.Tensor:
        wide = x.double()
        tensors = (w.w_q, w.w_k, w.w_v, w.w_o, w.b_q, w.b_k, w.b_v, w.b_o)
        weights = ssm.AttentionWeights(*(None if t is None else t.double() for t in tensors))  # type: ignore[arg-type]
        out = per_head_attention(
            wide, wide, wide, weights, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal
        )
        out = out + offset
        if nan:
            out[..., 0, 0] = math.nan
        return out.to(x.dtype)

    return fn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_deviation_just_above_the_tolerance_fails_and_just_below_passes(dtype: torch.dtype) -> None:
    tol = tolerance(dtype)
    check_attention(_reference_fn(0.25 * tol), dtype=dtype, max_examples=10)
    with pytest.raises(AssertionError, match=rf"tolerance {tol:g}"):
        check_attention(_reference_fn(4 * tol), dtype=dtype, max_examples=10)


def test_a_nan_in_the_output_fails() -> None:
    with pytest.raises(AssertionError, match="differs from the per-head reference by nan"):
        check_attention(_reference_fn(nan=True), max_examples=10)


def test_the_default_draws_every_kind_within_the_default_budget() -> None:
    seen: dict[str, int] = {}

    def counting(x: torch.Tensor, w: Any, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> torch.Tensor:
        kind = "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"
        seen[kind] = seen.get(kind, 0) + 1
        return _reference_fn()(x, w, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal)

    check_attention(counting)
    assert set(seen) == {"mha", "gqa", "mqa"}
    budget = settings().max_examples  # the active profile's (ci: 50 here); hypothesis' default is 100
    assert sum(seen.values()) >= budget >= 50, "without max_examples, the active profile's budget"


def test_settings_and_profiles_give_the_budget_and_assume_skips() -> None:
    calls: list[int] = []

    def counting(x: torch.Tensor, w: Any, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> torch.Tensor:
        calls.append(1)
        return _reference_fn()(x, w, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal)

    check_attention(counting, settings=settings(max_examples=7))
    assert len(calls) == 7

    def only_even_heads(x: torch.Tensor, w: Any, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> torch.Tensor:
        assume(num_heads % 2 == 0)  # the user's own precondition: not a failure
        return _reference_fn()(x, w, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal)

    check_attention(only_even_heads, max_examples=20)


def test_a_float32_check_uses_float32_tolerance() -> None:
    """1e-6 off is within float32's tolerance but not float64's."""
    check_attention(_reference_fn(1e-6), dtype=torch.float32, max_examples=10)
    with pytest.raises(AssertionError):
        check_attention(_reference_fn(1e-6), dtype=torch.float64, max_examples=10)


def test_a_cache_moved_to_another_dtype_rejects_the_old_one() -> None:
    """The append verdict is per cache state: after kv_cache.to(float64) a float32 append is refused."""
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    cache.to(torch.float64)
    with pytest.raises(ssm.ShapeError, match="k has dtype float32, but the cache holds float64"):
        cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))


def test_a_bool_head_count_never_shares_the_verdict_of_1() -> None:
    x = torch.randn(1, 3, 8)
    ssm.split_heads(x, 1)
    with pytest.raises(ssm.ConfigError, match="num_heads must be a positive int, but got True"):
        ssm.split_heads(x, True)  # pyright: ignore[reportArgumentType]


def test_apply_rotary_refuses_an_odd_head_width() -> None:
    table = torch.randn(3, 5)
    with pytest.raises(ssm.ShapeError, match=r"q has d_head=5 \(axis 3\), which is odd"):
        ssm.apply_rotary(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), table, table)


def test_a_global_module_hook_turns_the_fast_path_off() -> None:
    """register_module_forward_hook sees every module call: then the projections must really be called."""
    module, x = _module(num_kv_heads=4), _x()
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__) if isinstance(m, torch.nn.Linear) else None
    )
    try:
        with torch.no_grad():
            module(x)
    finally:
        handle.remove()
    assert seen == ["Linear"] * 4


def test_from_weights_keeps_each_projections_bias_as_given() -> None:
    """Weights with q/k/v biases but none on o (Qwen2's layout): the module has no o bias, and matches."""
    source = _module()
    weights = source.weights()
    weights = ssm.AttentionWeights(*(getattr(weights, n) for n in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v")))
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=4, num_kv_heads=2)
    assert module.o_proj.bias is None and module.q_proj.bias is not None
    x = _x()
    torch.testing.assert_close(module(x), per_head_attention(x, x, x, weights, num_heads=4, num_kv_heads=2), **F64)


def test_rows_with_nothing_to_attend_to_have_finite_gradients() -> None:
    """A fully masked row is zeros in the output, and no NaN reaches any gradient."""
    module = _module()
    x = _x(1, 4).requires_grad_()
    padding = torch.tensor([[True, True, False, False]])
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[0] = False  # query 0 may attend to nothing
    out = module(x, attn_mask=mask, key_padding_mask=padding)
    assert torch.all(out[:, 0] == module.o_proj.bias)  # pyright: ignore[reportOptionalMemberAccess]
    out.square().sum().backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_zero_head_count_is_a_config_error_everywhere() -> None:
    x = torch.randn(1, 3, 8)
    with pytest.raises(ssm.ConfigError, match="num_heads must be a positive int, but got 0"):
        ssm.split_heads(x, 0)
    with pytest.raises(ssm.ConfigError, match="num_kv_heads must be a positive int, but got 0"):
        ssm.group_queries(torch.randn(1, 4, 3, 8), 0)
    with pytest.raises(ssm.ConfigError, match="num_heads must be a positive int, but got 0"):
        ssm.MultiHeadAttention(8, 0)


def test_a_cache_of_another_dtype_than_the_module_is_refused_and_left_alone() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(ssm.ShapeError, match=r"kv_cache holds float64 on cpu, but the module computes float32"):
        module(torch.randn(1, 2, 16), kv_cache=cache)
    assert len(cache) == 0


def test_a_remembered_stage_call_does_not_cover_another_flag_value_given_by_keyword() -> None:
    """A public stage's remembered plan binds its flags: a call with another flag by keyword is another key,
    computed with its own flag (a plan run for it would return a result, not fail, so no recheck would see it)."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8)
    for first, second in ((False, True), (True, False)):
        ssm.scaled_dot_product_attention(q, k, k, is_causal=first)
        got = ssm.scaled_dot_product_attention(q, k, k, is_causal=second)
        torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=second))


def test_a_remembered_stage_call_with_the_int_1_does_not_cover_true() -> None:
    """`group_queries(q, 1)` remembered, then `group_queries(q, True)`: refused as a fresh call refuses a bool head
    count (True == 1 and hashes alike, so only the type in the key tells them apart; nothing fails in torch)."""
    q = torch.randn(1, 4, 5, 8)
    ssm.group_queries(q, 1)
    with pytest.raises(ssm.ConfigError, match="num_kv_heads must be a positive int, but got True"):
        ssm.group_queries(q, True)
