"""A module with 8 query heads and 3 KV heads: 3 does not divide 8. A constructor has no result for pyrefly to
check, so the mistake shows where the module is called."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(x: Float[Tensor, "batch seq 64"]) -> Float[Tensor, "batch seq 64"]:
    attn = ssm.MultiHeadAttention(64, 8, 3)
    return attn(x, is_causal=True)  # static: error
