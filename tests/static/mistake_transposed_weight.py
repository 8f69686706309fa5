"""The output projection's weight passed as (d_in, d_out): nn.Linear's layout is (d_out, d_in)."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(
    x: Float[Tensor, "batch seq 64"],
    w_q: Float[Tensor, "32 64"],
    w_k: Float[Tensor, "32 64"],
    w_v: Float[Tensor, "32 64"],
    w_o_transposed: Float[Tensor, "32 64"],
) -> Float[Tensor, "batch seq 64"]:
    q = ssm.split_heads(ssm.project(x, w_q), 4)
    k = ssm.split_heads(ssm.project(x, w_k), 4)
    v = ssm.split_heads(ssm.project(x, w_v), 4)
    out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
    return ssm.project(ssm.merge_heads(out), w_o_transposed)  # static: error
