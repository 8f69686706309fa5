"""Rotary embeddings on the queries and keys of GQA before attention: no static error."""

from typing import reveal_type

from jaxtyping import Float
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
    cos: Float[Tensor, "seq 8"],
    sin: Float[Tensor, "seq 8"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    k = ssm.split_heads(ssm.project(x, w_k), 2)
    q, k = ssm.apply_rotary(q, k, cos, sin)
    reveal_type(k)  # static: reveal Tensor[[batch, 2, seq, 8]]
    v = ssm.split_heads(ssm.project(x, w_v), 2)
    out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
    return ssm.project(ssm.merge_heads(out), w_o)
