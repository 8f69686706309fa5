"""The norms of QK-norm: Gemma's RMSNorm with weights stored as offsets (the scale `offset + weight`), and
Cohere's norm of each head with weights of its own."""


from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.errors import ConfigError


class _Fixed(nn.Module):
    """A norm whose `_FIXED` attributes are refused once built: the module holding it describes them in its config,
    so one set on the norm alone would be half applied. `eps` may be set: the holder's config reads it back."""

    _FIXED: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FIXED and "weight" in self.__dict__.get("_parameters", {}) and value != getattr(self, name):
            raise ConfigError(
                f"{type(self).__name__}: {name} cannot be set on a built norm: the module holding it describes it. "
                f"Build the module you want: from_config(dataclasses.replace(module.config, ...)), then load its "
                "state_dict."
            )
        super().__setattr__(name, value)


class OffsetRMSNorm(_Fixed):
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

    _FIXED = ("offset",)

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


class HeadNorm(_Fixed):
    """A norm of each head's `d_head` features with weights of its own for every head (Cohere's QK-norm):
    `(x - mean(x)) / sqrt(var(x) + eps) * weight[h]` (`centred`, a LayerNorm without bias), or
    `x / sqrt(mean(x**2) + eps) * weight[h]`, for the features of head `h`.

    It takes heads on axis 1, `(batch, heads, seq, d_head)`, as the split queries and keys hold them; its
    weights are `(heads, d_head)`, ones at first (`heads=None`: one `(d_head,)` weight for every head).

    Example:
        >>> import torch
        >>> from shapesafe_mha._compute.norms import HeadNorm
        >>> norm = HeadNorm(4, 8, eps=1e-5, centred=True)
        >>> norm.weight.shape, norm(torch.randn(2, 4, 3, 8)).shape
        (torch.Size([4, 8]), torch.Size([2, 4, 3, 8]))
    """

    _FIXED = ("centred",)

    def __init__(
        self,
        heads: int | None,
        width: int,
        eps: float,
        centred: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps, self.centred = eps, centred
        shape = (width,) if heads is None else (heads, width)
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, centred={self.centred}"

    def forward(self, x: Tensor) -> Tensor:
        if self.centred:
            x = x - x.mean(dim=-1, keepdim=True)
            normed = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.eps)
        else:
            normed = F.rms_norm(x, (x.shape[-1],), None, self.eps)
        weight = self.weight if self.weight.dim() == 1 else self.weight[:, None, :]  # head h's, at its every position
        return normed * weight


