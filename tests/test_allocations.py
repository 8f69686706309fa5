"""Zero-copy GQA/MQA: no forward ever materialises K or V at num_heads heads."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.testing import assert_no_kv_expansion


@st.composite
def expansion_revealing_configs(draw: st.DrawFn) -> dict[str, int]:
    """GQA/MQA sizes where every legitimate tensor is smaller than K expanded to num_heads heads."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.integers(2, 4))
    seq = draw(st.integers(1, 3))
    return {
        "batch": draw(st.integers(1, 2)),
        "num_heads": num_kv_heads * group,
        "num_kv_heads": num_kv_heads,
        "d_head": draw(st.integers(4 * seq, 16)),
        "seq": seq,
        "kv_seq": draw(st.integers(4 * seq + 4, 40)),
    }


@given(
    config=expansion_revealing_configs(),
    use_cache=st.booleans(),
    need_weights=st.booleans(),
    masked=st.booleans(),
)
def test_forward_never_expands_kv(
    config: dict[str, int], use_cache: bool, need_weights: bool, masked: bool, any_device: str
) -> None:
    """GQA and MQA, with and without a cache, with and without weights and masks: no K/V-at-num_heads allocation."""
    b, h, hkv, d, s, kv = (config[k] for k in ("batch", "num_heads", "num_kv_heads", "d_head", "seq", "kv_seq"))
    module = ssm.MultiHeadAttention(h * d, h, hkv, device=any_device)
    x = torch.randn(b, s, h * d, device=any_device)
    padding = torch.zeros(b, kv, dtype=torch.bool, device=any_device) if masked else None
    if use_cache:
        cache = module.new_cache(b, kv)
        past = torch.randn(b, hkv, kv - s, d, device=any_device)
        cache.append(past, past)

        def run() -> object:
            return module(x, is_causal=True, kv_cache=cache, need_weights=need_weights, key_padding_mask=padding)
    else:
        memory = torch.randn(b, kv, h * d, device=any_device)

        def run() -> object:
            return module(x, memory, need_weights=need_weights, key_padding_mask=padding)

    with torch.no_grad():
        module(x)  # the first no-grad self-attention views the fused Q/K/V weight (and remembers its verdict)
        assert_no_kv_expansion(run, batch=b, num_heads=h, kv_seq=kv, d_head=d, dtype=torch.float32)


def _repeat_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The common GQA implementation: expand K/V to num_heads heads, then plain attention."""
    group = q.shape[1] // k.shape[1]
    k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(q.shape[0], q.shape[1], k.shape[2], k.shape[3])
    v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(q.shape[0], q.shape[1], v.shape[2], v.shape[3])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_the_check_catches_repeat_kv() -> None:
    """Control: the check fails on expand+reshape GQA, so its silence above means something."""
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 2, 32, 16)
    with pytest.raises(AssertionError, match="expanded to num_heads=8"):
        assert_no_kv_expansion(
            lambda: _repeat_kv_attention(q, k, k), batch=1, num_heads=8, kv_seq=32, d_head=16, dtype=torch.float32
        )
    ours = ssm.scaled_dot_product_attention(q, k, k)
    torch.testing.assert_close(ours, _repeat_kv_attention(q, k, k))


@pytest.mark.parametrize("how", ["expand+reshape", "repeat", "repeat_interleave", "cat"])
def test_an_expansion_is_told_by_what_it_was_made_from(how: str) -> None:
    """seq == kv_seq: queries and outputs are as large as K at num_heads heads, yet only the replicating copy fails."""
    attn = ssm.MultiHeadAttention(64, num_heads=8, num_kv_heads=2)
    x = torch.randn(1, 32, 64)
    assert_no_kv_expansion(
        lambda: attn(x, is_causal=True), batch=1, num_heads=8, kv_seq=32, d_head=8, dtype=torch.float32
    )
    q, k = torch.randn(1, 8, 32, 16), torch.randn(1, 2, 32, 16)
    expand = {
        "expand+reshape": lambda: k[:, :, None].expand(-1, -1, 4, -1, -1).reshape(1, 8, 32, 16),
        "repeat": lambda: k.repeat(1, 4, 1, 1),
        "repeat_interleave": lambda: k.repeat_interleave(4, dim=1),
        "cat": lambda: torch.cat([k] * 4, dim=1),
    }[how]

    def run() -> torch.Tensor:
        full = expand()
        return torch.nn.functional.scaled_dot_product_attention(q, full, full)

    with pytest.raises(AssertionError, match="each replicating what it read"):
        assert_no_kv_expansion(run, batch=1, num_heads=8, kv_seq=32, d_head=16, dtype=torch.float32)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_a_training_step_never_expands_kv(num_kv_heads: int, masked: bool) -> None:
    """GQA and MQA forward and backward (torch's own kernel on CPU, its backward too): no K/V at num_heads heads."""
    module = ssm.MultiHeadAttention(64, 8, num_kv_heads)
    x, memory = torch.randn(2, 3, 64), torch.randn(2, 32, 64)
    padding = torch.zeros(2, 32, dtype=torch.bool) if masked else None
    padding = None if padding is None else padding.index_fill(1, torch.tensor([0, 5]), True)

    def step() -> None:
        module(x, memory, key_padding_mask=padding, is_causal=True).square().mean().backward()

    assert_no_kv_expansion(step, batch=2, num_heads=8, kv_seq=32, d_head=8, dtype=torch.float32)
