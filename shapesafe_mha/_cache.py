"""`KVCache`: preallocated keys and values at `num_kv_heads` heads, appended in place."""

from typing import Any

import torch
from torch import Tensor

from ._check import checked, mismatch
from ._dims import CacheBuffer, KVHeads, NewKVHeads
from ._errors import ConfigError, ShapeError


def _precheck_append(arguments: dict[str, Any]) -> None:
    for name in ("k", "v"):
        tensor = arguments[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.dtype != arguments["dtype"]:
            raise mismatch(
                f"{name} has dtype {str(tensor.dtype)[6:]}, but the cache holds {str(arguments['dtype'])[6:]}; "
                f"cast it with {name}.to({arguments['dtype']})."
            )
        if tensor.device != arguments["device"]:
            raise mismatch(f"{name} is on {tensor.device}, but the cache is on {arguments['device']}.")


@checked(
    precheck=_precheck_append,
    name="KVCache.append()",
    sources=dict.fromkeys(("batch", "num_kv_heads", "d_head"), "the cache"),
)
def _append_contract(
    batch: int,
    num_kv_heads: int,
    d_head: int,
    k: NewKVHeads,
    v: NewKVHeads,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """What `KVCache.append` checks (once per signature)."""


class KVCache:
    """Keys and values of past positions, preallocated at `num_kv_heads` heads.

    `append(k, v)` writes the new positions in place and returns views of everything cached so
    far: nothing is copied but the new positions, and nothing is ever expanded to `num_heads`.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> cache = ssm.KVCache(batch=1, num_kv_heads=2, capacity=16, d_head=8, dtype=torch.float32)
        >>> keys, values = cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        >>> len(cache), keys.shape, cache.nbytes
        (3, torch.Size([1, 2, 3, 8]), 2048)

    Arguments:
        batch, num_kv_heads, capacity, d_head: the buffers' shape `(batch, num_kv_heads, capacity, d_head)`.
        dtype, device: the buffers' dtype and device.
    """

    keys_buffer: CacheBuffer
    values_buffer: CacheBuffer

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        capacity: int,
        d_head: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        for name, size in (
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("capacity", capacity),
            ("d_head", d_head),
        ):
            if not isinstance(size, int) or size <= 0:
                raise ConfigError(f"KVCache(): {name} must be a positive int, but got {size!r}.")
        shape = (batch, num_kv_heads, capacity, d_head)
        self.keys_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.values_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self._length = 0

    @property
    def batch(self) -> int:
        return self.keys_buffer.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys_buffer.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys_buffer.shape[2]

    @property
    def d_head(self) -> int:
        return self.keys_buffer.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys_buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.keys_buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers (what the cache holds, filled or not)."""
        return 2 * self.keys_buffer.numel() * self.keys_buffer.element_size()

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, capacity={self.capacity}, "
            f"d_head={self.d_head}, dtype={self.dtype}, device={self.device}, filled={self._length})"
        )

    def reset(self) -> None:
        """Empty the cache (the buffers are kept)."""
        self._length = 0

    def keys(self) -> KVHeads:
        """A view of the cached keys, `(batch, num_kv_heads, len(self), d_head)`."""
        return self.keys_buffer[:, :, : self._length]

    def values(self) -> KVHeads:
        """A view of the cached values, `(batch, num_kv_heads, len(self), d_head)`."""
        return self.values_buffer[:, :, : self._length]

    def check_append(self, k: Any, v: Any) -> None:
        """Raise `ShapeError` unless `append(k, v)` would succeed; changes nothing."""
        _append_contract(self.batch, self.num_kv_heads, self.d_head, k, v, self.dtype, self.device)
        new = k.shape[2]
        if self._length + new > self.capacity:
            raise ShapeError(
                f"KVCache.append(): appending new={new} positions to the {self._length} cached would exceed "
                f"capacity={self.capacity}; make a larger KVCache or reset() this one."
            )

    def append(self, k: NewKVHeads, v: NewKVHeads) -> tuple[KVHeads, KVHeads]:
        """Write `k, v` after the cached positions; return views of all cached keys and values.

        A bad append (wrong batch, heads, d_head, dtype or device, `k` and `v` of different
        lengths, or past `capacity`) raises `ShapeError` and leaves the cache as it was.

        Arguments:
            k, v: `(batch, num_kv_heads, new, d_head)`; `new` may be 0.

        Returns:
            `(keys, values)`, views `(batch, num_kv_heads, len(self), d_head)` of the buffers.
        """
        self.check_append(k, v)
        return self._append(k, v)

    def _append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start, end = self._length, self._length + k.shape[2]
        self.keys_buffer[:, :, start:end] = k
        self.values_buffer[:, :, start:end] = v
        self._length = end
        return self.keys(), self.values()
