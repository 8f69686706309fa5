"""A user's own grouped-query attention, checked by shapesafe_mha: the decorator, `expect` and the aliases.

    python examples/checked_attention.py
"""

import torch
from jaxtyping import Float
from torch import Tensor, nn

import shapesafe_mha as ssm
from shapesafe_mha.dims import Heads, KVHeads, Probabilities, Tokens


@ssm.shapecheck
def temperature_scores(q: Heads, k: KVHeads, log_temp: Float[Tensor, " num_heads"]) -> Probabilities:
    """Scores with a learned temperature per query head; K stays at num_kv_heads heads (folded, not repeated)."""
    grouped = q.unflatten(1, (k.shape[1], -1))
    scores = ssm.expect((grouped @ k[:, :, None].mT).flatten(1, 2), "batch num_heads seq kv_seq", name="scores")
    return (scores * log_temp.exp()[:, None, None] * q.shape[-1] ** -0.5).softmax(-1)


class TemperatureAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.d_head = d_model // num_heads
        self.q_proj = nn.Linear(d_model, num_heads * self.d_head)
        self.k_proj = nn.Linear(d_model, num_kv_heads * self.d_head)
        self.v_proj = nn.Linear(d_model, num_kv_heads * self.d_head)
        self.o_proj = nn.Linear(num_heads * self.d_head, d_model)
        self.log_temp = nn.Parameter(torch.zeros(num_heads))

    @ssm.shapecheck
    def forward(self, x: Tokens) -> Tokens:
        q = ssm.split_heads(self.q_proj(x), self.num_heads)
        k = ssm.split_heads(self.k_proj(x), self.num_kv_heads)
        v = ssm.split_heads(self.v_proj(x), self.num_kv_heads)
        weights = temperature_scores(q, k, self.log_temp)
        grouped = weights.unflatten(1, (self.num_kv_heads, -1)) @ v[:, :, None]
        return self.o_proj(ssm.merge_heads(grouped.flatten(1, 2)))


if __name__ == "__main__":
    attention = TemperatureAttention(64, num_heads=8, num_kv_heads=2)
    out: Tensor = attention(torch.randn(2, 10, 64))
    print(out.shape)
