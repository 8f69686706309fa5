"""The RMSNorm of Gemma's QK-norm: weights stored as offsets, the scale `offset + weight`."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class OffsetRMSNorm(nn.Module):
    """`x / sqrt(mean(x**2) + eps) * (offset + weight)` over the last axis (Gemma 3: `offset=1.0`).

    Gemma's checkpoints store each norm's scale as its offset from 1, so its weights start at zeros; the
    weights here start at `1 - offset`, a scale of 1, as `nn.RMSNorm`'s do.

    Example:
        >>> import torch
        >>> from shapesafe_mha._compute.norms import OffsetRMSNorm
        >>> norm = OffsetRMSNorm(8, eps=1e-6, offset=1.0)
        >>> norm.weight.detach().sum().item(), norm(torch.randn(2, 8)).shape
        (0.0, torch.Size([2, 8]))
    """

    def __init__(
        self,
        width: int,
        eps: float,
        offset: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((width,), 1.0 - offset, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"({self.weight.shape[0]},), eps={self.eps}, offset={self.offset}"

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * (self.offset + self.weight)
