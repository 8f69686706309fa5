"""A module of width 64 built with 6 heads: 64 is not a multiple of 6. A constructor has no result shape for a
shape function to check, so pyrefly cannot see it: an expected miss (the constructor raises ConfigError)."""

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(x: Float[Tensor, "batch seq 64"]) -> Float[Tensor, "batch seq 64"]:
    attn = ssm.MultiHeadAttention(64, 6)  # static: miss
    return attn(x, is_causal=True)
