"""Assertions about memory: storage sharing and the absence of K/V expansion (no hypothesis needed)."""

from collections.abc import Callable
from typing import Any

import torch

from .._core.trace import Allocation, AllocationRecorder, storage_id

# Operators that move or replicate data without computing: what a K/V expansion is made by.
COPYING = {
    "clone", "contiguous", "repeat", "repeat_interleave", "index_select", "index", "_unsafe_index", "gather",
    "cat", "stack", "expand_copy", "tile", "_to_copy", "copy", "narrow_copy", "unfold_copy", "take",
}  # fmt: skip


def _replicates(allocation: Allocation) -> bool:
    elements = 1
    for size in allocation.shape:
        elements *= size
    return allocation.op in COPYING and 0 < 2 * allocation.read <= elements


def assert_shares_storage(view: torch.Tensor, base: torch.Tensor) -> None:
    """Raise `AssertionError` unless `view` is a view of `base`'s storage (works on `meta` too).

    Example:
        >>> import torch
        >>> from shapesafe_mha.testing import assert_shares_storage
        >>> x = torch.randn(2, 3, 8)
        >>> assert_shares_storage(x.view(2, 3, 2, 4).transpose(1, 2), x)
    """
    if storage_id(view) != storage_id(base):
        raise AssertionError(
            f"expected a view of the base tensor {tuple(base.shape)}, but the tensor {tuple(view.shape)} "
            f"(strides {view.stride()}) has storage of its own: something copied"
        )


def assert_no_kv_expansion(
    fn: Callable[[], Any],
    *,
    batch: int,
    num_heads: int,
    kv_seq: int,
    d_head: int,
    dtype: torch.dtype,
) -> list[Allocation]:
    """Run `fn()` and fail if it makes K or V expanded to `num_heads` heads: a copy that replicates.

    GQA/MQA exist to keep K and V at `num_kv_heads` heads; a `repeat_kv`/`repeat_interleave`
    inside attention silently undoes that. Every operator output whose storage is new is recorded
    (a `TorchDispatchMode`), so this sees copies made anywhere, in any library. An allocation is an
    expansion by what it was made from, not by its size alone: an operator that computes nothing
    (`repeat`, `repeat_interleave`, `expand(...).reshape`, `index_select`, `cat`, ...) whose output
    is at least as large as K at `num_heads` heads and holds at least twice as many elements as it
    read. So queries, scores and outputs of the same size (`seq == kv_seq`) are never flagged.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha.testing import assert_no_kv_expansion
        >>> attn = ssm.MultiHeadAttention(64, num_heads=8, num_kv_heads=2)
        >>> x, memory = torch.randn(1, 2, 64), torch.randn(1, 32, 64)
        >>> allocations = assert_no_kv_expansion(
        ...     lambda: attn(x, memory), batch=1, num_heads=8, kv_seq=32, d_head=8, dtype=torch.float32)

    Returns:
        Every allocation recorded, for further inspection.
    """
    limit = batch * num_heads * kv_seq * d_head * torch.empty((), dtype=dtype).element_size()
    with AllocationRecorder() as recorder:
        fn()
    offenders = [a for a in recorder.allocations if a.nbytes >= limit and _replicates(a)]
    if offenders:
        listed = "; ".join(f"{a.op} -> {a.shape} {str(a.dtype)[6:]} ({a.nbytes} bytes)" for a in offenders)
        raise AssertionError(
            f"K or V was expanded to num_heads={num_heads} heads: {len(offenders)} copy(ies) of at least "
            f"{limit} bytes (batch*num_heads*kv_seq*d_head), each replicating what it read: {listed}"
        )
    return recorder.allocations
