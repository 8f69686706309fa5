"""The same code runs on every device; `meta` checks a huge config's shapes without memory."""

import pytest
import torch

import shapesafe_mha as ssm


@pytest.mark.parametrize("num_kv_heads", [128, 8, 1])
def test_huge_config_on_meta_costs_no_memory(num_kv_heads: int) -> None:
    """128 heads, d_model 16384, 128k tokens: shapes verified on meta, output shape right, with weights too."""
    module = ssm.MultiHeadAttention(16384, 128, num_kv_heads, device="meta", dtype=torch.bfloat16)
    x = torch.empty(1, 131072, 16384, device="meta", dtype=torch.bfloat16)
    out = module(x, is_causal=True)
    assert out.shape == (1, 131072, 16384) and out.device.type == "meta"


def test_meta_decoding_step_with_a_long_cache() -> None:
    """One decoding step against a 128k-position GQA cache, on meta."""
    module = ssm.MultiHeadAttention(8192, 64, 8, device="meta", dtype=torch.bfloat16)
    cache = module.new_cache(batch=2, capacity=131072)
    out = module(torch.empty(2, 1, 8192, device="meta", dtype=torch.bfloat16), is_causal=True, kv_cache=cache)
    assert out.shape == (2, 1, 8192) and len(cache) == 1


def test_meta_errors_like_any_device() -> None:
    """Shape mistakes are caught on meta exactly as on real devices."""
    module = ssm.MultiHeadAttention(64, 8, 2, device="meta")
    with pytest.raises(ssm.ShapeError, match="query has d_model=32"):
        module(torch.empty(1, 4, 32, device="meta"))
