"""Keys passed transposed, (batch, heads, d_head, kv_seq), as a hand-written `q @ k` would need them."""

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
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    k = ssm.split_heads(ssm.project(x, w_k), 2)
    v = ssm.split_heads(ssm.project(x, w_v), 2)
    out = ssm.scaled_dot_product_attention(q, k.transpose(-2, -1), v)  # static: error
    return ssm.project(ssm.merge_heads(out), w_o)
