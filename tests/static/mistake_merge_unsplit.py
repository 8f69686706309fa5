"""merge_heads on a projection that was never split into heads."""

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
    q = ssm.project(x, w_q)
    return ssm.project(ssm.merge_heads(q), w_o)  # static: error
