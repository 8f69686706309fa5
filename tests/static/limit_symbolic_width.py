"""Correct MHA with a symbolic width: pyrefly does not simplify `8 * (d_model // 8)` to `d_model`, so the merged
heads do not match W_O's input width: a known false alarm. Write the widths as numbers to avoid it."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq d_model")
def attention(
    x: Float[Tensor, "batch seq d_model"],
    w_q: Float[Tensor, "d_model d_model"],
    w_o: Float[Tensor, "d_model d_model"],
) -> Float[Tensor, "batch seq d_model"]:
    q = ssm.split_heads(ssm.project(x, w_q), 8)
    out = ssm.scaled_dot_product_attention(q, q, q, is_causal=True)
    return ssm.project(ssm.merge_heads(out), w_o)  # static: false-alarm
