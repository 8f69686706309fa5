"""Every execution path of the module is exercised by the property tests, and each equals the reference;
draws cross the sizes where implementations switch, so threshold bugs are found and located."""

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute import fastpath as _fastpath
from shapesafe_mha._compute import kernels as _kernels
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import (
    attention_configs,
    attention_inputs,
    attention_masks,
    boundary_sizes,
    check_attention,
    key_padding_masks,
    projection_weights,
)

F64 = {"atol": 1e-10, "rtol": 1e-8}
PATHS = {
    "separate projections",
    "fused QKV projection",
    "torch's native kernel",
    "SDPA above the native cut-off",
    "cached decoding",
    "need_weights",
    "GQA/MQA by torch's own kernel",
    "GQA/MQA folded",
}


def _paths_of(path: str, query: torch.Tensor, kv_cache: Any, need_weights: bool) -> set[str]:
    taken = {
        _fastpath.SEPARATE: "separate projections",
        _fastpath.FUSED: "fused QKV projection",
        _fastpath.NATIVE: "torch's native kernel",
    }
    found = {taken[path]}
    if path == _fastpath.FUSED and query.shape[1] > _fastpath.NATIVE_MAX_SEQ:
        found.add("SDPA above the native cut-off")
    if kv_cache is not None and query.shape[1] == 1 and len(kv_cache) > 0:
        found.add("cached decoding")
    if need_weights:
        found.add("need_weights")
    return found


def test_the_module_properties_take_every_execution_path(monkeypatch: pytest.MonkeyPatch, patch_kernel: Any) -> None:
    """Module == reference over drawn configs, grad modes, masks, caches and need_weights; every path ran, GQA
    and MQA both on torch's own kernel and folded (need_weights), so the reference checks each."""
    taken: set[str] = set()
    original = ssm.MultiHeadAttention._run

    def recording(self: Any, s: Any, path: str, fused: Any, query: torch.Tensor, *rest: Any) -> Any:
        need_weights, kv_cache = rest[-3:-1]
        taken.update(_paths_of(path, query, kv_cache, need_weights))
        return original(self, s, path, fused, query, *rest)

    monkeypatch.setattr(ssm.MultiHeadAttention, "_run", recording)
    native, fold = _kernels.sdpa_gqa, _kernels.fold_queries

    def recording_native(*args: Any) -> torch.Tensor:
        taken.add("GQA/MQA by torch's own kernel")
        return native(*args)

    def recording_fold(grouped: torch.Tensor) -> torch.Tensor:
        if grouped.shape[2] > 1:
            taken.add("GQA/MQA folded")
        return fold(grouped)

    patch_kernel("sdpa_gqa", recording_native)
    patch_kernel("fold_queries", recording_fold)
    fold_one = _kernels.fold_one_query

    def recording_fold_one(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        if q.shape[1] > num_kv_heads:
            taken.add("GQA/MQA folded")
        return fold_one(q, num_kv_heads)

    patch_kernel("fold_one_query", recording_fold_one)

    @settings(max_examples=80, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        mode = data.draw(st.sampled_from(["plain", "masked", "decode", "weights", "native", "long"]), label="mode")
        if mode in ("native", "long"):  # inference MHA self-attention whose heads tile d_model, with biases
            config = data.draw(attention_configs(kinds=("mha",), cross=False, bias=True, max_seq=128))
            seq = data.draw(st.integers(129, 160), label="seq") if mode == "long" else config.seq
            config = type(config)(**(config.as_dict() | {"d_model": config.num_heads * config.d_head, "seq": seq}))
            config = type(config)(**(config.as_dict() | {"kv_seq": seq}))
        else:
            config = data.draw(attention_configs(cross=False, max_seq=160, thresholds=(_fastpath.NATIVE_MAX_SEQ,)))
        weights = data.draw(projection_weights(config))
        x = data.draw(attention_inputs(config)).query
        module = ssm.MultiHeadAttention.from_weights(
            weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads
        )
        grad = data.draw(st.booleans(), label="grad") and mode not in ("native", "long")
        is_causal = mode == "decode" or (mode not in ("native", "long") and data.draw(st.booleans(), label="causal"))
        mask = data.draw(attention_masks(config)) if mode == "masked" else None
        padding = data.draw(key_padding_masks(config)) if mode == "masked" else None
        expected = per_head_attention(
            x,
            x,
            x,
            weights,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            attn_mask=mask,
            key_padding_mask=padding,
            is_causal=is_causal,
        )
        with torch.set_grad_enabled(grad):
            if mode == "decode":
                cache = module.new_cache(config.batch, config.seq)
                prefill = data.draw(st.integers(0, config.seq - 1), label="prefill")
                steps = [module(x[:, :prefill], is_causal=True, kv_cache=cache)] if prefill else []
                steps += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, config.seq)]
                got = torch.cat(steps, dim=1)
            elif mode == "weights":
                got, probabilities = module(x, is_causal=is_causal, need_weights=True)
                rows = probabilities.sum(-1)
                assert torch.allclose(rows, torch.ones_like(rows)), "every query row sums to 1"
            else:
                got = module(x, attn_mask=mask, key_padding_mask=padding, is_causal=is_causal)
        torch.testing.assert_close(got, expected, **F64)

    prop()
    assert taken == PATHS, f"never taken: {PATHS - taken}"


def _truncating(limit: int) -> Any:
    """Attention that keeps only the first `limit` keys: right shapes, wrong values past `limit`."""

    def attention(x: torch.Tensor, w: Any, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> torch.Tensor:
        q = ssm.split_heads(ssm.project(x, w.w_q, w.b_q), num_heads)
        k = ssm.split_heads(ssm.project(x, w.w_k, w.b_k), num_kv_heads)[:, :, :limit]
        v = ssm.split_heads(ssm.project(x, w.w_v, w.b_v), num_kv_heads)[:, :, :limit]
        return ssm.project(ssm.merge_heads(ssm.scaled_dot_product_attention(q, k, v)), w.w_o, w.b_o)

    return attention


@pytest.mark.parametrize("limit", [8, 128])
def test_keys_truncated_to_a_fixed_length_fail_at_the_smallest_longer_sequence(limit: int) -> None:
    """Shapes are right, so only values at larger sizes can tell: the report names seq = limit + 1."""
    with pytest.raises(AssertionError, match=rf"smallest failing config: seq={limit + 1}, "):
        check_attention(_truncating(limit))


def test_a_correct_implementation_passes_across_the_thresholds() -> None:
    check_attention(_truncating(10**9), thresholds=(300,))


def test_user_thresholds_are_drawn_on_both_sides() -> None:
    sizes = boundary_sizes(512, thresholds=(300, 1000))
    assert {299, 300, 301} <= set(sizes) and max(sizes) <= 512
    assert {127, 128, 129, 255, 256, 257, 511, 512} <= set(sizes)
    seen: list[int] = []

    @settings(max_examples=300, derandomize=True, database=None)
    @given(attention_configs(thresholds=(300,)))
    def collect(config: Any) -> None:
        seen.append(config.seq)

    collect()
    assert sum(s <= 8 for s in seen) > len(seen) / 3, "most draws stay small"
    assert {299, 300, 301} & set(seen) and max(seen) > 256
