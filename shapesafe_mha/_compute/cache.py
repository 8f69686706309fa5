"""`KVCache`: preallocated keys and values at `num_kv_heads` heads, appended in place."""

from typing import Any

import torch
from torch import Tensor

from .._core.contract import Session, Stage, Verdicts, checks_enabled, signature_key
from .._core.dims import CacheBuffer, KVHeads, NewKVHeads
from .._core.errors import ConfigError, ShapeError
from .._core.messages import dtype_name, mismatch
from .fastpath import batched_tensor as _batched
from .fastpath import refuse_under_vmap

CacheState = tuple[Tensor, Tensor, int, int]


def _precheck_append(arguments: dict[str, Any]) -> None:
    cache = arguments["self"]
    for name in ("k", "v"):
        tensor = arguments[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.dtype != cache.dtype:
            raise mismatch(
                f"{name} has dtype {dtype_name(tensor.dtype)}, but the cache holds {dtype_name(cache.dtype)}; "
                f"cast it with {name}.to({cache.dtype}) or the cache with kv_cache.to({tensor.dtype}).",
                arg=name,
            )
        if tensor.device != cache.device:
            raise mismatch(f"{name} is on {tensor.device}, but the cache is on {cache.device}.", arg=name)


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

    With a sliding `window` (Mistral, Gemma), the cache keeps only the positions the window can
    still see: when the buffer is full, the last `window - 1` positions move to its front (one copy
    of `window - 1` positions every `capacity - window + 1` steps), so a cache of `capacity >=
    window` serves a generation of any length. `len()` still counts every position seen (RoPE
    positions stay right); `keys()` holds the kept ones, contiguous and in order, so attention runs
    on views and the window mask stays lower-right aligned. (A ring buffer would save that copy but
    hand attention keys out of order: a mask every step, and a copy for every chunk anyway.)

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> cache = ssm.KVCache(1, 2, capacity=8, d_head=4, window=4, dtype=torch.float32)
        >>> for _ in range(20):
        ...     keys, _ = cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        >>> len(cache), keys.shape[2]
        (20, 5)

    Arguments:
        batch, num_kv_heads, capacity, d_head: the buffers' shape `(batch, num_kv_heads, capacity, d_head)`.
        dtype, device: the buffers' dtype and device.
        window: keep only the positions a sliding window of this many keys can still see
            (`capacity >= window`); None keeps everything.
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
        window: int | None = None,
    ) -> None:
        for name, size in (
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("capacity", capacity),
            ("d_head", d_head),
        ):
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ConfigError(f"KVCache(): {name} must be a positive int, but got {size!r}.")
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ConfigError(f"KVCache(): window must be a positive int or None, but got {window!r}.")
            if capacity < window:
                raise ConfigError(
                    f"KVCache(): capacity={capacity} is less than window={window}; a decoding step attends to "
                    f"window keys, so capacity must be at least {window} (2 * window copies less often)."
                )
        self.window = window
        self._start = 0  # positions dropped from the front (sliding window)
        shape = (batch, num_kv_heads, capacity, d_head)
        self.keys_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.values_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self._length = 0
        self._verdicts = Verdicts()

    @property
    def window(self) -> int | None:
        """The sliding window the cache keeps positions for (None: every position)."""
        return self._window

    @window.setter
    def window(self, value: int | None) -> None:
        # Which positions the cache kept was decided by its window: set on a built one, it would be half applied.
        if "_verdicts" in self.__dict__ and value != self._window:
            raise ConfigError(
                f"{type(self).__name__}: window cannot be set on a built cache: the positions it kept were chosen by "
                f"it. Build one that has it: KVCache(..., window={value!r}), or module.new_cache(batch, capacity) "
                "from a module of that window."
            )
        self._window = value

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
        """Positions seen: cached, and (with a window) dropped after leaving it."""
        return self._start + self._length

    @property
    def seen(self) -> int:
        """`len(self)`, as a size that may stay symbolic under `torch.export` (`len()` must make it an int)."""
        return self._start + self._length

    @property
    def kept(self) -> int:
        """Positions the buffers hold now (with a window, the last of those seen)."""
        return self._length

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, capacity={self.capacity}, "
            f"d_head={self.d_head}, dtype={self.dtype}, device={self.device}, filled={self._length}"
            + (f", window={self.window}, seen={len(self)})" if self.window is not None else ")")
        )

    def reset(self) -> None:
        """Empty the cache (the buffers are kept; any autograd graph through them is dropped)."""
        self._length = self._start = 0
        if self.keys_buffer.requires_grad or self.values_buffer.requires_grad:
            self.keys_buffer = self.keys_buffer.detach()
            self.values_buffer = self.values_buffer.detach()

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "KVCache":
        """Move the buffers (and what they hold) to `dtype` and/or `device`, in place; return the cache."""
        self.keys_buffer = self.keys_buffer.to(device=device, dtype=dtype)
        self.values_buffer = self.values_buffer.to(device=device, dtype=dtype)
        return self

    def keys(self) -> KVHeads:
        """A view of the cached keys, `(batch, num_kv_heads, kept, d_head)` (`kept == len(self)` without a window)."""
        return self.keys_buffer[:, :, : self._length]

    def values(self) -> KVHeads:
        """A view of the cached values, `(batch, num_kv_heads, kept, d_head)`."""
        return self.values_buffer[:, :, : self._length]

    def check_append(self, k: Any, v: Any) -> None:
        """Raise `ShapeError` unless `append(k, v)` would succeed; changes nothing."""
        key = (*signature_key((k, v), {}), self.keys_buffer.shape, self.dtype, self.device)
        if not self._verdicts.known(key):
            with Session("KVCache.append()") as session:
                session.seed(CacheBuffer, self.keys_buffer, "the cache")
                session.check_arguments(_APPEND, (self, k, v), {})
            self._verdicts.remember(key)
        self._check_room(k.shape[2], None)

    def _check_room(self, new: int, owner: str | None) -> None:
        if self._length + new <= self.capacity or self._window is not None:
            return
        if owner is None:
            raise ShapeError(
                f"KVCache.append(): appending new={new} positions to the {self._length} cached would exceed "
                f"capacity={self.capacity}; make a larger KVCache or reset() this one."
            )
        raise ShapeError(
            f"{owner}: appending new={new} positions to the {self._length} in kv_cache would exceed its "
            f"capacity={self.capacity}; make a larger cache or reset() this one."
        )

    def append(self, k: NewKVHeads, v: NewKVHeads) -> tuple[KVHeads, KVHeads]:
        """Write `k, v` after the cached positions; return views of all cached keys and values.

        A bad append (wrong batch, heads, d_head, dtype or device, `k` and `v` of different
        lengths, or past `capacity`) raises `ShapeError` and leaves the cache as it was. Under
        autograd (`k` or `v` requires grad), and while a buffer is in a graph (grad mode on or
        off), the buffers are updated out of place, so gradients flow through every step and a
        step decoded under `no_grad` leaves earlier steps' backward intact; `reset()` drops the graph.

        Arguments:
            k, v: `(batch, num_kv_heads, new, d_head)`; `new` may be 0.

        Returns:
            `(keys, values)`, views `(batch, num_kv_heads, len(self), d_head)` of the buffers.
        """
        if checks_enabled():
            self.check_append(k, v)
        return self.write(k, v)

    def write(self, k: Tensor, v: Tensor, owner: str | None = None) -> tuple[Tensor, Tensor]:
        """Append without checking shapes (the capacity is always checked); views of all cached."""
        new = k.shape[2]
        if _batched(k):  # (the test of refuse_under_vmap, inlined: this runs on every decoding step)
            refuse_under_vmap(k, owner)
        keys, values = self.keys_buffer, self.values_buffer
        capacity = keys.shape[2]  # (`capacity`, without a property call)
        if self._length + new > capacity:  # (_check_room's own test first, inlined likewise)
            self._check_room(new, owner)
        # out of place also without grad while a buffer is in a graph: an earlier step's backward reads it
        tracked = keys.requires_grad or values.requires_grad or (
            torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        )
        inference = not torch.compiler.is_compiling() and self.keys_buffer.is_inference()  # (dynamo warns on it)
        if inference and not torch.is_inference_mode_enabled():
            # filled under torch.inference_mode, written outside it: torch allows no in-place write of those
            self.keys_buffer, self.values_buffer = self.keys_buffer.clone(), self.values_buffer.clone()
        if self._window is not None and self._length + new > capacity:
            kept = min(self._window - 1, self._length)
            if kept + new > self.capacity:
                return self._pass_through(k, v, kept)
            self._slide(kept)
        start, end = self._length, self._length + new
        if tracked:  # out of place: earlier steps' graphs keep the buffers they saw
            self.keys_buffer = torch.slice_scatter(self.keys_buffer, k, dim=2, start=start, end=end)
            self.values_buffer = torch.slice_scatter(self.values_buffer, v, dim=2, start=start, end=end)
        else:
            self.keys_buffer[:, :, start:end] = k
            self.values_buffer[:, :, start:end] = v
        self._length = end
        return self.keys_buffer[:, :, :end], self.values_buffer[:, :, :end]  # keys() and values(), inlined

    def _slide(self, kept: int) -> None:
        """Move the last `kept` positions to the front, into new buffers (the old stay intact for `restore`)."""
        lo = self._length - kept
        keys, values = torch.empty_like(self.keys_buffer), torch.empty_like(self.values_buffer)
        keys[:, :, :kept] = self.keys_buffer[:, :, lo : self._length]
        values[:, :, :kept] = self.values_buffer[:, :, lo : self._length]
        self.keys_buffer, self.values_buffer = keys, values
        self._start, self._length = self._start + lo, kept

    def _pass_through(self, k: Tensor, v: Tensor, kept: int) -> tuple[Tensor, Tensor]:
        """A chunk longer than the buffer: attend over the kept positions and the chunk, then keep the window."""
        lo = self._length - kept
        keys = torch.cat((self.keys_buffer[:, :, lo : self._length], k), dim=2)
        values = torch.cat((self.values_buffer[:, :, lo : self._length], v), dim=2)
        tail = min(self.window or 1, keys.shape[2]) - 1
        self._start, self._length = self._start + lo + keys.shape[2] - tail, 0
        self.keys_buffer, self.values_buffer = torch.zeros_like(self.keys_buffer), torch.zeros_like(self.values_buffer)
        self.write(keys[:, :, keys.shape[2] - tail :], values[:, :, keys.shape[2] - tail :])
        return keys, values

    def state(self) -> CacheState:
        """What `restore` needs to undo later writes (nothing is copied)."""
        return self.keys_buffer, self.values_buffer, self._length, self._start

    def restore(self, state: CacheState) -> None:
        """Undo the writes since `state()`: the length and the buffers as they were."""
        self.keys_buffer, self.values_buffer, self._length, self._start = state


_APPEND = Stage(
    KVCache.append,
    name="KVCache.append",
    public=("k", "v"),
    trace=(),
    sources={},
    precheck=_precheck_append,
    validate=None,
    explain=None,
)
