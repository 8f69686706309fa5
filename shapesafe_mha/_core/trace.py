"""Observing the real tensors of a forward: which stage aliases which, and what each allocates.

Nothing here is a table of expectations. Aliasing is read from storage identity (the storage
object every view shares; on `meta`, where every data pointer is 0, it still tells views from
copies), and allocations from a `TorchDispatchMode` that notes every operator output whose
storage is new.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _flex_module() -> Any:
    from torch.nn.attention import flex_attention

    return flex_attention


def storage_id(tensor: torch.Tensor) -> int:
    """An identity of `tensor`'s storage, equal for all views of it, on every device (`meta` too)."""
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class Allocation:
    """One operator output whose storage did not exist before the operator ran."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    read: int = 0  # distinct elements of the operator's tensor inputs: less than the output's = replicated


def distinct_elements(tensor: torch.Tensor) -> int:
    """How many memory locations a tensor reads: an `expand`ed axis (stride 0) counts once."""
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        count *= size if stride else min(size, 1)
    return count


class AllocationRecorder(TorchDispatchMode):
    """Record every new storage that an operator creates inside the `with` block.

    Example:
        >>> import torch
        >>> with AllocationRecorder() as rec:
        ...     _ = torch.ones(4).view(2, 2) + 1
        >>> [a.shape for a in rec.allocations]
        [(4,), (2, 2)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[Allocation] = []
        self._alive: list[Any] = []  # keep storages alive so no identity is reused mid-record

    # Higher-order operators (FlexAttention's) come here too: their eager kernel runs under the recorder, so
    # what they allocate inside (torch's eager FlexAttention repeats K and V for GQA) is recorded like the rest.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            kernel = func.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
            if kernel is None:  # no eager kernel to look into: run it unrecorded
                return func(*args, **(kwargs or {}))
            with self:
                return kernel(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {storage_id(t) for t in tensors}
        read: dict[int, int] = {}  # per input storage, the most any input view of it reads
        for t in tensors:
            read[storage_id(t)] = max(read.get(storage_id(t), 0), distinct_elements(t))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_id(t) not in inputs:
                storage = t.untyped_storage()
                inputs.add(storage_id(t))
                self._alive.append(storage)
                self.allocations.append(
                    Allocation(
                        str(func.overloadpacket.__name__), tuple(t.shape), t.dtype, storage.nbytes(), sum(read.values())
                    )
                )
        return out

    def __enter__(self) -> "AllocationRecorder":
        # Eager FlexAttention wraps its operator in torch.compile, which refuses to run under a recording
        # mode; torch's debug switch runs the operator as it is, so its eager kernel is recorded.
        self._flex_debug = getattr(_flex_module(), "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
        if self._flex_debug is not None:
            _flex_module()._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if getattr(self, "_flex_debug", None) is not None:
            _flex_module()._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex_debug

    def take(self) -> list[Allocation]:
        """The allocations recorded since the last `take`."""
        taken, self.allocations = self.allocations, []
        return taken


@dataclass
class Stage:
    """One recorded stage of a forward."""

    name: str
    named_shape: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    aliases: str | None
    allocated_bytes: int
    allocations: list[Allocation] = field(default_factory=list)
    is_input: bool = False  # there before the forward allocated anything (the query, a cache's buffers)

    @property
    def storage(self) -> str:
        """ "view of <stage>", "new allocation" (by this stage, or with an earlier output of it), or "input"."""
        if self.aliases:
            return f"view of {self.aliases}"
        return "input" if self.is_input else "new allocation"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "named_shape": self.named_shape,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes": self.nbytes,
            "aliases": self.aliases,
            "allocated_bytes": self.allocated_bytes,
        }


class Tracer:
    """Collect the `Stage`s that report themselves while it is active (see `tracing`)."""

    def __init__(self, recorder: AllocationRecorder) -> None:
        self.stages: list[Stage] = []
        self._recorder = recorder
        self._storages: list[tuple[int, str, torch.Tensor]] = []
        self._allocated = False

    def add(self, name: str, named_shape: str, tensor: torch.Tensor, group: Any = None, seed: Any = None) -> None:
        sid, (start, end) = storage_id(tensor), _span(tensor)
        # The earlier stage this one was taken from: the latest on the same storage whose memory covers it.
        aliases = next(
            (stage for s, stage, other in reversed(self._storages) if s == sid and _covers(_span(other), start, end)),
            None,
        )
        self._storages.append((sid, name, tensor))  # holding the tensor keeps its identity unique
        allocations = self._recorder.take()
        # A stage with several outputs has its allocations counted at the first: an unaliased tensor with none
        # is new all the same, unless nothing has been allocated yet (then it was given to the forward).
        is_input = aliases is None and not allocations and not self._allocated
        self._allocated = self._allocated or bool(allocations)
        self.stages.append(
            Stage(
                name=name,
                named_shape=named_shape,
                shape=tuple(tensor.shape),
                strides=tuple(tensor.stride()),
                dtype=tensor.dtype,
                nbytes=tensor.numel() * tensor.element_size(),
                aliases=aliases,
                allocated_bytes=sum(a.nbytes for a in allocations),
                allocations=allocations,
                is_input=is_input,
            )
        )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The range of storage elements a tensor can touch: [offset, offset + extent)."""
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    offset = int(tensor.storage_offset())
    return offset, offset + (int(extent) if tensor.numel() else 0)


def _covers(span: tuple[int, int], start: int, end: int) -> bool:
    return span[0] <= start and end <= span[1]


_active: list[Tracer] = []


def current_observer() -> Callable[[str, str, torch.Tensor], None] | None:
    """Where stages report themselves while a `tracing` block is active (None otherwise)."""
    return _active[-1].add if _active else None


def guards_so_far(values: Any) -> int | None:
    """How many guards torch's symbolic shapes hold now, read from the first symbolic size among `values`
    (None outside `torch.export`). torch has no public API for a shape environment's guards: here only."""
    for value in values:
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    return len(size.node.shape_env.guards)
    return None


def note_guards(owner: str, before: int, after: int) -> None:
    """Tell the active observer that guards `before..after` were made inside `owner`'s call (for `prove`)."""
    if _active and after > before and hasattr(_active[-1], "guarded"):
        _active[-1].guarded(owner, before, after)  # pyright: ignore[reportAttributeAccessIssue]


@contextmanager
def tracing() -> Iterator[Tracer]:
    """Record every stage of the forwards run inside the block (not thread-safe: for tools and tests)."""
    with AllocationRecorder() as recorder:
        tracer = Tracer(recorder)
        _active.append(tracer)
        try:
            yield tracer
        finally:
            _active.remove(tracer)
