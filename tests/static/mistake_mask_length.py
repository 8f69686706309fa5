"""A mask built for 12 key positions given to attention over the sequence's own keys."""

from jaxtyping import Bool, Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_o: Float[Tensor, "64 64"],
    mask: Bool[Tensor, "seq 12"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    out = ssm.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # static: error
    return ssm.project(ssm.merge_heads(out), w_o)
