"""Multi-query attention (8 query heads, one KV head), every shape right: no static error."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "64 64"],
    w_kv: Float[Tensor, "8 64"],
    w_o: Float[Tensor, "64 64"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    kv = ssm.split_heads(ssm.project(x, w_kv), 1)
    out = ssm.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    return ssm.project(ssm.merge_heads(out), w_o)
