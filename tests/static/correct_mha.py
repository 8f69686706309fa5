"""Multi-head attention composed from the stages, every shape right: no static error."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_k: Float[Tensor, "64 64"],
    w_v: Float[Tensor, "64 64"],
    w_o: Float[Tensor, "64 64"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    k = ssm.split_heads(ssm.project(x, w_k), 8)
    v = ssm.split_heads(ssm.project(x, w_v), 8)
    out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
    return ssm.project(ssm.merge_heads(out), w_o)
