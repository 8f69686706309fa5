"""A width of 64 split into 6 heads: 64 is not a multiple of 6."""

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
    q = ssm.split_heads(ssm.project(x, w_q), 6)  # static: error
    out = ssm.scaled_dot_product_attention(q, q, q)
    return ssm.project(ssm.merge_heads(out), w_o)
