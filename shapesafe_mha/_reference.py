"""The naive per-head reference: written for reading, the oracle of every property test.

No fused projection, no reshapes, no folding: for each head, slice that head's rows out of the
weights, project, score, mask, softmax, weight the values; then concatenate and project out.
"""

import math
from typing import Literal

import torch
from torch import Tensor

from ._weights import AttentionWeights


def _rows(weight: Tensor, bias: Tensor | None, head: int, d_head: int) -> tuple[Tensor, Tensor | None]:
    """The slice of a projection that produces one head."""
    rows = slice(head * d_head, (head + 1) * d_head)
    return weight[rows], None if bias is None else bias[rows]


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = x @ weight.T
    return out if bias is None else out + bias


def _softmax_or_zeros(scores: Tensor) -> Tensor:
    """Softmax over the last axis; a row whose scores are all -inf becomes zeros."""
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    exp = torch.exp(scores - top)
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total == 0, torch.ones_like(total), total)


KVHeads = Literal["grouped", "interleaved"]
RopeStyle = Literal["half", "interleaved"]


def _rotate_pairs(x: Tensor, positions: Tensor, theta: float, style: RopeStyle = "half") -> Tensor:
    """One head's features, each pair turned by the angle `position * theta**(-2i/d_head)`.

    Pair `i` is features `(i, i + d_head/2)` in the "half" style (Llama, Mistral, Qwen: rotate_half),
    features `(2i, 2i+1)` in the "interleaved" style (GPT-J, the RoFormer paper).
    """
    half = x.shape[-1] // 2
    exponents = torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1]
    frequency = 1.0 / theta**exponents
    angle = positions.to(torch.float32)[..., None] * frequency
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    if style == "interleaved":
        first, second = x[..., 0::2], x[..., 1::2]
        turned = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return turned.flatten(-2)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _head_mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    head: int,
    batch: int,
    seq: int,
    kv_seq: int,
    like: Tensor,
) -> Tensor:
    """An additive `(batch, seq, kv_seq)` mask for one head: 0 where allowed, -inf where not."""
    additive = torch.zeros(batch, seq, kv_seq, dtype=like.dtype, device=like.device)
    blocked = torch.zeros(batch, seq, kv_seq, dtype=torch.bool, device=like.device)
    if is_causal:
        for i in range(seq):
            position = kv_seq - seq + i  # lower-right alignment; negative: sees no key at all
            blocked[:, i, max(position + 1, 0) :] = True  # every key after its own position
    if key_padding_mask is not None:
        blocked |= key_padding_mask[:, None, :]
    if attn_mask is not None:
        mask = attn_mask
        if mask.ndim == 4:
            mask = mask[:, head if mask.shape[1] > 1 else 0]
        mask = mask.expand(batch, seq, kv_seq)
        if mask.dtype == torch.bool:
            blocked |= ~mask
        else:
            additive = additive + mask
    return additive.masked_fill(blocked, -math.inf)


def per_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    weights: AttentionWeights,
    *,
    num_heads: int,
    num_kv_heads: int,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    rope_theta: float | None = None,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    rope_style: RopeStyle = "half",
    kv_heads: KVHeads = "grouped",
    scale: float | None = None,
) -> Tensor:
    """Multi-head attention computed one head at a time from explicit per-head weight slices.

    For head `h` with KV head `g = h // (num_heads // num_kv_heads)` (or `h % num_kv_heads` with
    `kv_heads="interleaved"`):
    `head_h = softmax((x W_Q[h]) (k W_K[g])^T / sqrt(d_head) + mask) (v W_V[g])`, then
    `out = concat(head_0, ..., head_{H-1}) W_O^T + b_O`. Masks follow `MultiHeadAttention`:
    bool `attn_mask` True = may attend, float added; `key_padding_mask` True = padding;
    `is_causal` lower-right aligned; a row with nothing to attend to is zeros.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha.reference import per_head_attention
        >>> m = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
        >>> x = torch.randn(2, 5, 16)
        >>> ref = per_head_attention(x, x, x, m.weights(), num_heads=4, num_kv_heads=2)
        >>> bool(torch.allclose(ref, m(x), atol=1e-5))
        True

    Arguments:
        query: `(batch, seq, d_model)`.
        key, value: `(batch, kv_seq, d_model)`.
        weights: the layer's weights in `nn.Linear` layout.
        num_heads, num_kv_heads: the head counts (`num_kv_heads` divides `num_heads`).
        attn_mask, is_causal, key_padding_mask: as in `MultiHeadAttention.forward`.
        rope_theta: rotate each head's queries and keys (default RoPE with this base); angles in
            float32, as transformers computes them.
        positions: `(batch, seq)` positions of the queries; default `0..seq-1`.
        key_positions: `(batch, kv_seq)` positions of the keys; default the queries' positions when
            `kv_seq == seq`, else `0..kv_seq-1`.
        rope_style: "half" pairs feature `i` with `i + d_head/2` (Llama's rotate_half),
            "interleaved" pairs `2i` with `2i+1` (GPT-J).
        kv_heads: which KV head query head `h` reads: "grouped" `h // group` (transformers'
            repeat_kv, torch's enable_gqa), "interleaved" `h % num_kv_heads` (x-transformers).
        scale: the score scale; default `1/sqrt(d_head)`.

    Returns:
        `(batch, seq, d_model)`.
    """
    d_head = weights.check(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    batch, seq, _ = query.shape
    kv_seq = key.shape[1]
    where = torch.arange(seq).expand(batch, seq) if positions is None else positions
    if key_positions is None:
        key_positions = where if kv_seq == seq else torch.arange(kv_seq).expand(batch, kv_seq)
    heads = []
    for head in range(num_heads):
        kv_head = head % num_kv_heads if kv_heads == "interleaved" else head // group
        q = _linear(query, *_rows(weights.w_q, weights.b_q, head, d_head))
        k = _linear(key, *_rows(weights.w_k, weights.b_k, kv_head, d_head))
        if rope_theta is not None:
            q = _rotate_pairs(q, where, rope_theta, rope_style)
            k = _rotate_pairs(k, key_positions, rope_theta, rope_style)
        v = _linear(value, *_rows(weights.w_v, weights.b_v, kv_head, d_head))
        scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(d_head) if scale is None else scale)
        scores = scores + _head_mask(attn_mask, key_padding_mask, is_causal, head, batch, seq, kv_seq, scores)
        heads.append(_softmax_or_zeros(scores) @ v)
    return _linear(torch.cat(heads, dim=-1), weights.w_o, weights.b_o)
