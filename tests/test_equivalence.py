"""The fused MHA/GQA/MQA paths equal the naive per-head reference, torch's SDPA and torch's module."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import (
    AttentionConfig,
    attention_configs,
    attention_inputs,
    attention_masks,
    key_padding_masks,
    projection_weights,
)

F64 = {"atol": 1e-10, "rtol": 1e-8}


def _repeat_kv_heads(weight: torch.Tensor | None, config: AttentionConfig) -> torch.Tensor | None:
    """K/V weights of an equivalent MHA: each KV head's rows repeated for every query head of its group."""
    if weight is None:
        return None
    blocks = weight.unflatten(0, (config.num_kv_heads, config.d_head))
    return blocks.repeat_interleave(config.group, dim=0).flatten(0, 1)


@given(data=st.data())
def test_module_equals_per_head_reference(data: st.DataObject, device: str) -> None:
    """Module == reference for MHA/GQA/MQA, self/cross, bias or not, masks, key padding, causal."""
    cross = data.draw(st.booleans(), label="cross")
    config = data.draw(attention_configs(cross=cross), label="config")
    weights = data.draw(projection_weights(config, device=device))
    inputs = data.draw(attention_inputs(config, device=device))
    key, value = (inputs.key, inputs.value) if cross else (inputs.query, inputs.query)
    attn_mask = data.draw(attention_masks(config, device=device), label="attn_mask")
    padding = data.draw(key_padding_masks(config, device=device), label="key_padding_mask")
    is_causal = data.draw(st.booleans(), label="is_causal")
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)

    ours = module(inputs.query, key, value, attn_mask=attn_mask, key_padding_mask=padding, is_causal=is_causal)
    expected = per_head_attention(
        inputs.query,
        key,
        value,
        weights,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        attn_mask=attn_mask,
        key_padding_mask=padding,
        is_causal=is_causal,
    )
    torch.testing.assert_close(ours, expected, **F64)
    with_weights, _ = module(
        inputs.query, key, value, attn_mask=attn_mask, key_padding_mask=padding, is_causal=is_causal, need_weights=True
    )
    torch.testing.assert_close(with_weights, expected, **F64)


@given(data=st.data())
def test_gqa_equals_mha_with_repeated_kv_heads(data: st.DataObject, device: str) -> None:
    """GQA/MQA == MHA whose K/V weights repeat each KV head over its group (repeat_interleave)."""
    config = data.draw(attention_configs(kinds=("gqa", "mqa")), label="config")
    weights = data.draw(projection_weights(config, device=device))
    inputs = data.draw(attention_inputs(config, device=device))
    is_causal = data.draw(st.booleans(), label="is_causal")
    grouped = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    expanded = ssm.AttentionWeights(
        weights.w_q,
        _repeat_kv_heads(weights.w_k, config),  # type: ignore[arg-type]
        _repeat_kv_heads(weights.w_v, config),  # type: ignore[arg-type]
        weights.w_o,
        weights.b_q,
        _repeat_kv_heads(weights.b_k, config),
        _repeat_kv_heads(weights.b_v, config),
        weights.b_o,
    )
    mha = ssm.MultiHeadAttention.from_weights(expanded, num_heads=config.num_heads)
    torch.testing.assert_close(
        grouped(inputs.query, inputs.key, inputs.value, is_causal=is_causal),
        mha(inputs.query, inputs.key, inputs.value, is_causal=is_causal),
        **F64,
    )


@given(data=st.data())
def test_mha_is_gqa_with_all_kv_heads_and_mqa_is_gqa_with_one(data: st.DataObject, device: str) -> None:
    """num_kv_heads=None, =num_heads (MHA) and =1 (MQA) are the same code path: the same weights, the same output."""
    config = data.draw(attention_configs(kinds=("mha", "mqa")), label="config")
    weights = data.draw(projection_weights(config, device=device))
    inputs = data.draw(attention_inputs(config, device=device))
    explicit = ssm.MultiHeadAttention.from_weights(
        weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads
    )
    torch.testing.assert_close(
        explicit(inputs.query, inputs.key, inputs.value),
        per_head_attention(
            inputs.query,
            inputs.key,
            inputs.value,
            weights,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
        ),
        **F64,
    )
    if config.kind == "mha":
        default = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads)
        assert default.num_kv_heads == config.num_heads
        torch.testing.assert_close(default(inputs.query), explicit(inputs.query), **F64)


@given(data=st.data())
def test_fused_projection_then_split_equals_per_head_projections(data: st.DataObject, device: str) -> None:
    """One big projection plus a free reshape == num_heads small projections, head by head."""
    config = data.draw(attention_configs(), label="config")
    weights = data.draw(projection_weights(config, device=device))
    x = data.draw(attention_inputs(config, device=device)).query
    for weight, bias, heads in (
        (weights.w_q, weights.b_q, config.num_heads),
        (weights.w_k, weights.b_k, config.num_kv_heads),
    ):
        fused = ssm.split_heads(ssm.project(x, weight, bias), heads)
        for h in range(heads):
            rows = slice(h * config.d_head, (h + 1) * config.d_head)
            alone = ssm.project(x, weight[rows], None if bias is None else bias[rows])
            torch.testing.assert_close(fused[:, h], alone, **F64)


@given(
    num_heads=st.integers(2, 6),
    d_head=st.integers(1, 8),
    kv_seq=st.integers(2, 6),
    seq=st.integers(1, 4),
)
def test_multi_head_is_not_one_wide_head(num_heads: int, d_head: int, kv_seq: int, seq: int) -> None:
    """Each head has its own softmax budget: H heads can each attend fully to a different key; one wide head cannot.

    Head h's query matches only key h % kv_seq (score gap 40). Multi-head attention copies key h's values
    into head h in full; a single d_model-wide head sums the per-head scores, ties those keys, and
    averages their values instead.
    """
    torch.manual_seed(0)
    q = torch.zeros(1, num_heads, seq, d_head, dtype=torch.float64)
    k = torch.zeros(1, num_heads, kv_seq, d_head, dtype=torch.float64)
    for h in range(num_heads):
        q[0, h, :, 0] = 40.0 * math.sqrt(d_head)
        k[0, h, h % kv_seq, 0] = 1.0
    v = torch.randn(1, num_heads, kv_seq, d_head, dtype=torch.float64)

    weights = ssm.attention_weights(q, k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, num_heads, seq, dtype=torch.float64))
    multi = ssm.scaled_dot_product_attention(q, k, v)
    for h in range(num_heads):
        torch.testing.assert_close(multi[0, h], v[0, h, h % kv_seq].expand(seq, d_head), atol=1e-12, rtol=0)

    wide_q, wide_k, wide_v = (ssm.merge_heads(t)[:, None] for t in (q, k, v))
    wide = ssm.split_heads(ssm.merge_heads(ssm.scaled_dot_product_attention(wide_q, wide_k, wide_v)), num_heads)
    assert not torch.allclose(wide, multi, atol=1e-3)


@given(data=st.data())
def test_sdpa_equals_torch_sdpa_with_enable_gqa(data: st.DataObject, device: str) -> None:
    """ssm.scaled_dot_product_attention == F.scaled_dot_product_attention(enable_gqa=True) where both are defined."""
    config = data.draw(attention_configs(), label="config")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device)

    b, h, hkv, s, kv, d = config.batch, config.num_heads, config.num_kv_heads, config.seq, config.kv_seq, config.d_head
    q, k, v = randn(b, h, s, d), randn(b, hkv, kv, d), randn(b, hkv, kv, d)
    mask = data.draw(attention_masks(config, device=device), label="attn_mask")
    if mask is not None:
        mask[..., 0] = True  # torch's SDPA is defined on rows with at least one key
    is_causal = s == kv and mask is None and data.draw(st.booleans(), label="is_causal")
    scale = data.draw(st.one_of(st.none(), st.floats(0.1, 2.0)), label="scale")

    ours = ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, **F64)


@given(data=st.data())
def test_from_torch_equals_nn_multihead_attention(data: st.DataObject, device: str) -> None:
    """from_torch(m) computes what m does, key padding and masks (torch: True = masked) included.

    A seq-first module (torch's default) is refused with the conversion to use, never silently
    read as batch-first; following that advice gives the same answers, transposed.
    """
    config = data.draw(attention_configs(kinds=("mha",)), label="config")
    d_model = config.num_heads * config.d_head
    batch_first = data.draw(st.booleans(), label="batch_first")
    bias = data.draw(st.booleans(), label="bias")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    theirs = torch.nn.MultiheadAttention(
        d_model, config.num_heads, bias=bias, batch_first=batch_first, dtype=torch.float64, device=device
    ).eval()
    if batch_first:
        ours = ssm.MultiHeadAttention.from_torch(theirs)
    else:
        with pytest.raises(ssm.ConfigError, match=r"batch_first=False.*Set module\.batch_first = True"):
            ssm.MultiHeadAttention.from_torch(theirs)
        converted = copy.deepcopy(theirs)
        converted.batch_first = True
        ours = ssm.MultiHeadAttention.from_torch(converted)
    assert ours.num_heads == config.num_heads and ours.bias == bias

    x = torch.randn(config.batch, config.seq, d_model, dtype=torch.float64, device=device)
    mem = torch.randn(config.batch, config.kv_seq, d_model, dtype=torch.float64, device=device)
    allowed = data.draw(attention_masks(config, device=device), label="attn_mask")
    if allowed is not None:
        allowed[..., 0] = True  # nn.MultiheadAttention returns NaN for rows with nothing to attend to
    padding = data.draw(key_padding_masks(config, device=device), label="key_padding_mask")
    if padding is not None:
        padding[:, 0] = False
    their_mask = None
    if allowed is not None:
        full = allowed if allowed.ndim == 2 else allowed.expand(config.batch, config.num_heads, -1, -1)
        their_mask = ~(full if full.ndim == 2 else full.flatten(0, 1))

    def to_theirs(t: torch.Tensor) -> torch.Tensor:
        return t if batch_first else t.transpose(0, 1)

    expected, _ = theirs(to_theirs(x), to_theirs(mem), to_theirs(mem), key_padding_mask=padding, attn_mask=their_mask)
    got = ours(x, mem, mem, key_padding_mask=padding, attn_mask=allowed)
    torch.testing.assert_close(got, to_theirs(expected), **F64)


def test_to_torch_round_trips(device: str) -> None:
    """to_torch() gives an nn.MultiheadAttention computing the same function."""
    torch.manual_seed(0)
    ours = ssm.MultiHeadAttention(24, 4, dtype=torch.float64, device=device)
    theirs = ours.to_torch().eval()
    x = torch.randn(2, 5, 24, dtype=torch.float64, device=device)
    torch.testing.assert_close(theirs(x, x, x, need_weights=False)[0], ours(x), **F64)
    with pytest.raises(ssm.ConfigError, match="no GQA/MQA"):
        ssm.MultiHeadAttention(24, 4, 2).to_torch()


@given(data=st.data())
def test_rows_with_nothing_to_attend_to_are_zero_without_nan(data: st.DataObject, device: str) -> None:
    """All keys padded or masked: zeros in the output, finite gradients, and the reference agrees."""
    config = data.draw(attention_configs(), label="config")
    weights = data.draw(projection_weights(config, device=device))
    inputs = data.draw(attention_inputs(config, device=device))
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    padding = torch.zeros(config.batch, config.kv_seq, dtype=torch.bool, device=device)
    padding[0] = True  # the first sequence is all padding
    query = inputs.query.clone().requires_grad_()
    out, probs = module(query, inputs.key, inputs.value, key_padding_mask=padding, need_weights=True)
    expected_first = module.o_proj.bias if config.bias else torch.zeros(config.d_model, dtype=torch.float64)
    torch.testing.assert_close(out[0], expected_first.to(device).expand_as(out[0]).detach(), **F64)
    assert torch.all(probs[0] == 0)
    out.sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
    expected = per_head_attention(
        inputs.query,
        inputs.key,
        inputs.value,
        weights,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        key_padding_mask=padding,
    )
    torch.testing.assert_close(out.detach(), expected, **F64)


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-5), (torch.float64, 1e-10), (torch.bfloat16, 5e-2), (torch.float16, 5e-3)],
)
def test_every_float_dtype_matches_the_reference(dtype: torch.dtype, tolerance: float, device: str) -> None:
    """float32, float64, bfloat16 and float16 all run, and agree with the float64 reference to dtype precision."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 8, 2, device=device, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64, device=device)
    expected = per_head_attention(x, x, x, module.weights(), num_heads=8, num_kv_heads=2, is_causal=True)
    got = module.to(dtype)(x.to(dtype), is_causal=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, atol=tolerance * 10, rtol=tolerance * 10)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_causal_with_more_queries_than_keys_is_lower_right_aligned(num_kv_heads: int) -> None:
    """seq > kv_seq with is_causal: the first seq - kv_seq queries precede every key and get zeros."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, num_kv_heads, dtype=torch.float64, bias=False)
    x, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 2, 16, dtype=torch.float64)
    out = module(x, memory, is_causal=True)
    assert torch.all(out[:, :3] == 0) and torch.all(out[:, 3:] != 0)
    expected = per_head_attention(
        x, memory, memory, module.weights(), num_heads=4, num_kv_heads=num_kv_heads, is_causal=True
    )
    torch.testing.assert_close(out, expected, **F64)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("kv_seq", [6, 9])
def test_causal_weights_put_exactly_zero_on_every_future_key(num_kv_heads: int, kv_seq: int) -> None:
    """is_causal: query i, at position kv_seq - seq + i, gives weight exactly 0 to every later key and some
    weight to every other, square MHA (seq == kv_seq, the case torch's own causal mask covers) included."""
    torch.manual_seed(0)
    seq = 6
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64)
    k = torch.randn(2, num_kv_heads, kv_seq, 8, dtype=torch.float64)
    weights = ssm.attention_weights(q, k, is_causal=True)
    query_position = torch.arange(kv_seq - seq, kv_seq)[:, None]
    future = torch.arange(kv_seq)[None, :] > query_position
    assert torch.all(weights[..., future] == 0)
    assert torch.all(weights[..., ~future] > 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, seq, dtype=torch.float64), **F64)


def _weights_head_by_head(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float | None, softcap: float | None
) -> torch.Tensor:
    """Head by head: softmax of `softcap * tanh(q_h k_g^T * scale / softcap)` plus a float mask, over the keys a bool
    mask allows; zeros for a query allowed no key."""
    batch, heads, seq, d_head = q.shape
    group = heads // k.shape[1]
    weights = torch.zeros(batch, heads, seq, k.shape[2], dtype=q.dtype)
    for b in range(batch):
        for h in range(heads):
            scores = q[b, h] @ k[b, h // group].T * (1 / math.sqrt(d_head) if scale is None else scale)
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if mask is not None and mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -math.inf)
            elif mask is not None:
                scores = scores + mask
            weights[b, h] = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize(("scale", "softcap"), [(None, None), (0.3, None), (None, 2.0), (0.3, 2.0)])
def test_weights_and_attention_are_a_softmax_head_by_head(
    num_kv_heads: int, mask_kind: str | None, scale: float | None, softcap: float | None
) -> None:
    """attention_weights and scaled_dot_product_attention, MHA/GQA/MQA, unmasked or with a bool or float mask
    (-inf = masked; query 1 allowed no key), a scale and a softcap: per head, the softmax computed head by head,
    and the output those weights applied to the values; query 1's row is zeros."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, num_kv_heads, 7, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(5, 7, generator=generator) > 0.4
    allowed[:, 0], allowed[1] = True, False
    mask = {
        None: None,
        "bool": allowed,
        "float": torch.randn(5, 7, generator=generator, dtype=torch.float64).masked_fill(~allowed, -math.inf),
    }[mask_kind]

    weights = ssm.attention_weights(q, k, attn_mask=mask, scale=scale, softcap=softcap)
    out = ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, softcap=softcap)
    expected = _weights_head_by_head(q, k, mask, scale, softcap)
    torch.testing.assert_close(weights, expected, **F64)
    torch.testing.assert_close(out, expected @ v.repeat_interleave(4 // num_kv_heads, 1), **F64)
    if mask is not None:
        assert torch.all(weights[:, :, 1] == 0) and torch.all(out[:, :, 1] == 0)
