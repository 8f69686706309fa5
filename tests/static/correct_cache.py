"""A module with a KV cache, generic over its sizes: attn(x) is (batch, seq, 64); no static error.

The cache holds one earlier position and has room for the sequence; with a cache, key and value are the new
positions (seq) and the mask covers the cached ones too (seq + 1)."""

from typing import reveal_type

import torch
from jaxtyping import Bool, Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(x: Float[Tensor, "batch seq 64"], mask: Bool[Tensor, "seq seq+1"]) -> Float[Tensor, "batch seq 64"]:
    attn = ssm.MultiHeadAttention(64, 8, 2)
    reveal_type(attn)  # static: reveal MultiHeadAttention[64, 8, 2]
    cache = ssm.KVCache(x.shape[0], 2, x.shape[1] + 1, 8, dtype=x.dtype)
    keys, _ = cache.append(torch.zeros(x.shape[0], 2, 1, 8), torch.zeros(x.shape[0], 2, 1, 8))
    reveal_type(keys)  # static: reveal Tensor[[batch, 2, int, 8]]
    out, weights = attn(x, x, x, attn_mask=mask, kv_cache=cache, need_weights=True)
    reveal_type(weights)  # static: reveal Tensor[[batch, 8, seq, seq + 1]]
    return out
