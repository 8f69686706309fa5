"""User attention modules for tests/test_prove.py: one correct, four with a size-specific bug each."""

import torch
import torch.nn.functional as F
from torch import nn


class UserAttention(nn.Module):
    """A user's MHA as commonly written: fused qkv, reshape, transpose, torch's SDPA, causal."""

    def __init__(self, d_model: int = 64, num_heads: int = 8, bug: str | None = None) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.bug = d_model, num_heads, bug
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.register_buffer("causal", torch.ones(256, 256, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        if self.bug == "view_seq":
            q = q.view(b, 16, self.num_heads, -1)  # the sequence length written in by hand
        elif self.bug == "view_batch":
            q = q.reshape(2, s, self.num_heads, -1)  # the batch written in by hand
        else:
            q = q.reshape(b, s, self.num_heads, -1)
        q, k, v = q.transpose(1, 2), *(t.reshape(b, s, self.num_heads, -1).transpose(1, 2) for t in (k, v))
        if self.bug == "buffer_mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[:s, :s])  # type: ignore[index]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.bug == "truncate" and s > 512:
            out = out[:, :, :512]  # a branch that keeps only the first 512 positions
        return self.out(out.transpose(1, 2).reshape(b, out.shape[2], d))


def correct(d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> nn.Module:
    """The factory `--module` calls: `check_module`'s signature (this module is MHA of d_model // num_heads)."""
    return UserAttention(d_model, num_heads)


def view_seq(d_model: int, num_heads: int, num_kv_heads: int, d_head: int, bias: bool) -> nn.Module:
    return UserAttention(d_model, num_heads, bug="view_seq")
