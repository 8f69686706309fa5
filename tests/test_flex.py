"""ssm.flex_attention: torch's FlexAttention with checked shapes, BlockMask sizes as dimensions, GQA without copies."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import shapesafe_mha as ssm
from shapesafe_mha.testing import assert_no_kv_expansion


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def per_head_sliding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal, each query head with its own window (h + 1 keys): wrong heads would show."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= h)


def temperature_and_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score / (1.0 + 0.5 * h) + 0.1 * (kv_idx - q_idx) + 0.01 * b


def block_mask(mask_mod: Callable[..., Tensor], batch: int | None, heads: int | None, seq: int, kv: int) -> BlockMask:
    """A BlockMask on the CPU (create_block_mask's default device is cuda)."""
    return create_block_mask(mask_mod, batch, heads, seq, kv, device="cpu")


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no mask", "block mask"])
def test_equals_torch_flex_attention_with_enable_gqa(num_heads: int, num_kv_heads: int, with_mask: bool) -> None:
    """Same values as torch's flex_attention(enable_gqa=True), score_mod and a per-head BlockMask included
    (the eager GQA path folds query heads and re-indexes the mods; a wrong query head would differ)."""
    torch.manual_seed(0)
    q = torch.randn(2, num_heads, 40, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, num_kv_heads, 40, 8, dtype=torch.float64).unbind(0)
    mask = block_mask(per_head_sliding, 2, num_heads, 40, 40) if with_mask else None
    got = ssm.flex_attention(q, k, v, temperature_and_bias, mask)
    expected = torch_flex(q, k, v, temperature_and_bias, mask, enable_gqa=num_heads != num_kv_heads)
    assert got.shape == (2, num_heads, 40, 8)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_cross_attention_lengths_and_scale() -> None:
    """seq != kv_seq and an explicit scale pass through unchanged."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8)
    mask = block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 4, None, None, 5, 9)
    got = ssm.flex_attention(q, k, k, block_mask=mask, scale=0.3)
    torch.testing.assert_close(got, torch_flex(q, k, k, block_mask=mask, scale=0.3, enable_gqa=True))


def test_a_block_mask_built_for_32_positions_used_at_64_is_a_shape_error() -> None:
    """The most reported FlexAttention mistake: the message names block_mask, seq and both sizes (torch: ValueError)."""
    q, k = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 64, 8)
    mask = block_mask(causal, None, None, 32, 32)
    with pytest.raises((ValueError, RuntimeError), match="block_mask was created for"):  # 2.14: RuntimeError
        torch_flex(q, k, k, block_mask=mask, enable_gqa=True)  # torch today, deep inside the call
    with pytest.raises(
        ssm.ShapeError,
        match=r"^flex_attention\(\): block_mask was built for seq=32 query positions, but q has seq=64 \(axis 2\)",
    ):
        ssm.flex_attention(q, k, k, block_mask=mask)


def test_a_block_mask_built_for_more_positions_than_used_is_a_shape_error_too() -> None:
    """Built for 64, used at 32: torch would crop it to the upper left corner only if asked (`_adjust`); refused."""
    q, k = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8)
    with pytest.raises(ssm.ShapeError, match=r"block_mask was built for seq=64 query positions, but q has seq=32"):
        ssm.flex_attention(q, k, k, block_mask=block_mask(causal, None, None, 64, 64))


def test_a_block_mask_built_for_other_key_lengths_names_kv_seq() -> None:
    """Queries right, keys wrong: the message names kv_seq and both sizes, and the call that would fit."""
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 48, 8)
    with pytest.raises(ssm.ShapeError, match=r"built for kv_seq=16 key positions, but k has kv_seq=48 .*16, 48"):
        ssm.flex_attention(q, k, k, block_mask=block_mask(causal, None, None, 16, 16))


def test_a_block_mask_for_the_kv_heads_or_another_batch_is_a_shape_error() -> None:
    """A BlockMask's heads are query heads (or 1) and its batch the call's (or 1)."""
    q, k = torch.randn(2, 8, 16, 4), torch.randn(2, 2, 16, 4)
    with pytest.raises(ssm.ShapeError, match=r"block_mask has num_heads=2 \(axis 1\), but q set num_heads=8"):
        ssm.flex_attention(q, k, k, block_mask=block_mask(causal, None, 2, 16, 16))
    with pytest.raises(ssm.ShapeError, match=r"block_mask has batch=3 \(axis 0\), but q set batch=2"):
        ssm.flex_attention(q, k, k, block_mask=block_mask(causal, 3, None, 16, 16))
    ssm.flex_attention(q, k, k, block_mask=block_mask(causal, 2, 8, 16, 16))  # full sizes are fine too


def test_shapes_and_arguments_are_checked_like_the_other_stages() -> None:
    """Heads that do not divide, a wrong d_head, a mask that is no BlockMask: one-line ShapeErrors."""
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ssm.ShapeError, match=r"num_heads=6 \(axis 1\), which is not a multiple of k's num_kv_heads=4"):
        ssm.flex_attention(q, torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8))
    with pytest.raises(ssm.ShapeError, match=r"k has d_head=4 \(axis 3\), but q set d_head=8"):
        ssm.flex_attention(q, torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    with pytest.raises(ssm.ShapeError, match=r"block_mask must be a torch\.nn\.attention\.flex_attention\.BlockMask"):
        ssm.flex_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), block_mask=torch.ones(4, 4).bool())  # type: ignore[arg-type]


def test_gqa_makes_no_copy_of_k_or_v_at_num_heads() -> None:
    """Eager torch FlexAttention repeats K and V to num_heads heads (the recorder sees it); ours does not."""
    q, k = torch.randn(1, 8, 64, 8), torch.randn(1, 2, 64, 8)
    mask = block_mask(causal, None, None, 64, 64)
    sizes = {"batch": 1, "num_heads": 8, "kv_seq": 64, "d_head": 8, "dtype": torch.float32}
    with pytest.raises(AssertionError, match="repeat_interleave"):
        assert_no_kv_expansion(lambda: torch_flex(q, k, k, temperature_and_bias, mask, enable_gqa=True), **sizes)
    assert_no_kv_expansion(lambda: ssm.flex_attention(q, k, k, temperature_and_bias, mask), **sizes)


def test_unchecked_computes_the_same() -> None:
    """With checks off the stage is torch's call (or the fold) alone, with the same values."""
    q, k = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4)
    checked = ssm.flex_attention(q, k, k, temperature_and_bias)
    with ssm.unchecked():
        torch.testing.assert_close(ssm.flex_attention(q, k, k, temperature_and_bias), checked, rtol=0, atol=0)


def test_a_query_with_no_key_to_attend_gets_zeros() -> None:
    """A row the mask empties is zeros, as torch's FlexAttention (and the library's SDPA) give it."""
    q, k = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4)
    mask = block_mask(lambda b, h, q_idx, kv_idx: q_idx != 3, None, None, 8, 8)
    out = ssm.flex_attention(q, k, k, block_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros(1, 4, 4)) and not out.isnan().any()


def test_compiles_with_no_graph_break_and_the_same_values() -> None:
    """Under torch.compile(fullgraph=True) the stage is torch's call with enable_gqa=True, traced whole.

    (Dynamo with the eager backend: it proves the trace; inductor's kernel is torch's concern.)
    """
    q, k = torch.randn(1, 8, 16, 4), torch.randn(1, 2, 16, 4)
    mask = block_mask(causal, None, None, 16, 16)

    def fn(q: Tensor, k: Tensor) -> Tensor:
        return ssm.flex_attention(q, k, k, temperature_and_bias, mask)

    assert torch._dynamo.explain(fn)(q, k).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k), torch_flex(q, k, k, temperature_and_bias, mask, enable_gqa=True))
