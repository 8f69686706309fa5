"""Grouped-query attention (8 query heads, 2 KV heads), every shape right: no static error."""

from typing import reveal_type

from jaxtyping import Bool, Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_k: Float[Tensor, "16 64"],
    w_v: Float[Tensor, "16 64"],
    w_o: Float[Tensor, "64 64"],
    mask: Bool[Tensor, "seq seq"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    reveal_type(q)  # static: reveal Tensor[[batch, 8, seq, 8]]
    k = ssm.split_heads(ssm.project(x, w_k), 2)
    reveal_type(k)  # static: reveal Tensor[[batch, 2, seq, 8]]
    v = ssm.split_heads(ssm.project(x, w_v), 2)
    reveal_type(ssm.group_queries(q, 2))  # static: reveal Tensor[[batch, 2, 4, seq, 8]]
    out = ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    reveal_type(out)  # static: reveal Tensor[[batch, 8, seq, 8]]
    merged = ssm.merge_heads(out)
    reveal_type(merged)  # static: reveal Tensor[[batch, seq, 64]]
    return ssm.project(merged, w_o)
