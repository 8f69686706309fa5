"""An integer mask (0/1 as int64): a mask is bool (True = may attend) or float (added to the scores). pyrefly's
tensors carry shapes, not dtypes: an expected miss."""

from jaxtyping import Float, Int
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_o: Float[Tensor, "64 64"],
    mask: Int[Tensor, "seq seq"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    out = ssm.scaled_dot_product_attention(q, q, q, attn_mask=mask)  # static: miss
    return ssm.project(ssm.merge_heads(out), w_o)
