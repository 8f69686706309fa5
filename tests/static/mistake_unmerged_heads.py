"""Attention's output sent to W_O with its heads still split: (batch, heads, seq, d_head), not (batch, seq, d_model)."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_o: Float[Tensor, "64 64"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    out = ssm.scaled_dot_product_attention(q, q, q, is_causal=True)
    return ssm.project(out, w_o)  # static: error
