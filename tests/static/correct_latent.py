"""Multi-head latent attention (DeepSeek), generic over its sizes: no static error."""

from typing import reveal_type

from jaxtyping import Float
from shape_extensions import static_jaxtyping
from torch import Tensor

import shapesafe_mha as ssm


@static_jaxtyping("batch seq")
def attention(x: Float[Tensor, "batch seq 64"]) -> Float[Tensor, "batch seq 64"]:
    mla = ssm.LatentAttention(64, 8, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
    out = mla(x, is_causal=True)
    reveal_type(out)  # static: reveal Tensor[[batch, seq, 64]]
    return out
