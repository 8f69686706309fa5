"""The typed stages of multi-head attention: project, split, group, attend, merge.

Each public stage is the `checked` form of a private implementation; the module calls the private
ones after checking its own inputs once, so a forward pays for one check, not nine.
"""

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._check import Mismatch, checked, mismatch
from ._dims import (
    AttnMask,
    Bias,
    GroupedQueries,
    Heads,
    Inner,
    KVHeads,
    LinearIn,
    LinearOut,
    Probabilities,
    Weight,
)
from ._errors import ConfigError
from ._trace import record

# --- implementations ---------------------------------------------------------------------------------


def _project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def _split_heads(x: Tensor, num_heads: int) -> Tensor:
    # Splitting one axis in two is always expressible as a view, whatever x's strides are.
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    # After attention the heads axis sits before seq; bringing it back beside d_head and merging
    # the two is a view only if the data is already laid out (batch, seq, heads, d_head).
    return x.transpose(1, 2).flatten(2)


def _group_queries(q: Tensor, num_kv_heads: int) -> Tensor:
    # Query head h reads KV head h // group, so consecutive query heads form a group.
    return q.unflatten(1, (num_kv_heads, -1))


class Masking(NamedTuple):
    """Every masking argument of a call, combined."""

    mask: Tensor | None  # 4-D, bool (True = may attend) or float (added); None: nothing to mask
    may_empty_rows: bool  # whether some query may have no key left to attend to
    native_causal: bool  # the mask is exactly torch's is_causal (seq == kv_seq, MHA): let SDPA do it


def _masking(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    q: Tensor,
    k: Tensor,
    *,
    explicit: bool = False,
) -> Masking:
    """Combine `attn_mask`, `key_padding_mask` and `is_causal` into one mask (see `Masking`).

    `explicit` asks for a mask tensor even where torch's SDPA could apply causality itself.
    """
    seq, kv_seq = q.shape[2], k.shape[2]
    causal = is_causal and seq > 1  # a single query, lower-right aligned, sees every key
    if causal and attn_mask is None and key_padding_mask is None:
        if not explicit and seq == kv_seq and q.shape[1] == k.shape[1]:
            return Masking(None, False, True)
    allowed: Tensor | None = None
    if causal:
        # Lower-right alignment: query i sits at absolute position kv_seq - seq + i.
        allowed = torch.ones(seq, kv_seq, dtype=torch.bool, device=q.device).tril(kv_seq - seq)[None, None]
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    may_empty = (causal and seq > kv_seq) or key_padding_mask is not None or attn_mask is not None
    if attn_mask is not None:
        mask4 = attn_mask if attn_mask.ndim == 4 else attn_mask[None, None]
        if mask4.dtype == torch.bool:
            allowed = mask4 if allowed is None else allowed & mask4
        else:
            return Masking(mask4 if allowed is None else mask4.masked_fill(~allowed, -math.inf), True, False)
    return Masking(allowed, may_empty, False)


def _rows_with_a_key(mask: Tensor) -> Tensor:
    allowed = mask if mask.dtype == torch.bool else mask != -math.inf
    return allowed.any(-1, keepdim=True)


def _fold_mask(mask: Tensor, num_heads: int, num_kv_heads: int, seq: int) -> Tensor:
    """A `(#batch, #heads, #seq, kv_seq)` mask laid out for queries folded to `(num_kv_heads, group*seq)`."""
    group = num_heads // num_kv_heads
    if group == 1:
        return mask
    mb, mh, ms, kv = mask.shape
    m5 = mask.unsqueeze(1) if mh == 1 else mask.unflatten(1, (num_kv_heads, group))
    if ms == 1 and m5.shape[2] == 1:
        return m5.squeeze(2)
    return m5.expand(mb, m5.shape[1], group, seq, kv).reshape(mb, m5.shape[1], group * seq, kv)


def _prepare(q: Tensor, k: Tensor, masking: Masking) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Fold query groups into the query axis; make fully masked rows safe to softmax.

    GQA without copying K/V: the `group` query heads that share a KV head are laid end to end
    along the query axis, so every matmul sees K and V at `num_kv_heads` heads, as stored.
    Returns the folded queries, the folded mask and, if some row may have nothing to attend to,
    the `(…, 1)` indicator of rows that do (those without are zeroed by the caller).
    """
    num_heads, seq = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    grouped = _group_queries(q, num_kv_heads)
    record("group_queries", "batch num_kv_heads group seq d_head", grouped)
    folded = grouped.flatten(2, 3)
    record("fold_queries", "batch num_kv_heads group*seq d_head", folded)
    mask = masking.mask
    if mask is None:
        return folded, None, None
    if not masking.may_empty_rows:
        return folded, _fold_mask(mask, num_heads, num_kv_heads, seq), None
    rows = _rows_with_a_key(mask)
    # A row with nothing to attend to gets every key (finite softmax, finite gradients)
    # and is zeroed afterwards: zeros, never NaN, on every backend.
    if mask.dtype == torch.bool:
        mask = mask | ~rows
    else:
        mask = mask.masked_fill(~rows, 0.0)
    return folded, _fold_mask(mask, num_heads, num_kv_heads, seq), rows


def _unfold(out: Tensor, num_heads: int) -> Tensor:
    return out.unflatten(2, (num_heads // out.shape[1], -1)).flatten(1, 2)


def _attend(q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float | None, dropout_p: float) -> Tensor:
    num_heads = q.shape[1]
    if masking.mask is None and k.shape[1] == num_heads:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=masking.native_causal, scale=scale)
        record("attention", "batch num_heads seq d_head", out)
        return out
    folded, folded_mask, rows = _prepare(q, k, masking)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask, dropout_p=dropout_p, scale=scale)
    out = _unfold(out, num_heads)
    if rows is not None:
        out = out.masked_fill(~rows, 0.0)
    record("attention", "batch num_heads seq d_head", out)
    return out


def _head_weights(q: Tensor, k: Tensor, masking: Masking, scale: float | None) -> Tensor:
    """Per-head probabilities `(batch, num_heads, seq, kv_seq)`; rows with nothing to attend to are zeros."""
    folded, folded_mask, rows = _prepare(q, k, masking)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(folded, k.transpose(-1, -2)) * scale
    if folded_mask is not None:
        scores = (
            scores.masked_fill(~folded_mask, -math.inf) if folded_mask.dtype == torch.bool else scores + folded_mask
        )
    weights = torch.softmax(scores, dim=-1).unflatten(2, (-1, q.shape[2])).flatten(1, 2)
    return weights if rows is None else weights.masked_fill(~rows, 0.0)


def _attend_with_weights(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, scale: float | None, dropout_p: float
) -> tuple[Tensor, Tensor]:
    weights = _head_weights(q, k, masking, scale)
    record("weights", "batch num_heads seq kv_seq", weights)
    probs = weights.unflatten(1, (k.shape[1], -1)).flatten(2, 3)  # folded again, as the values are laid out
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    out = _unfold(torch.matmul(probs, v), q.shape[1])
    record("attention", "batch num_heads seq d_head", out)
    return out, weights


# --- validation of what annotations cannot say --------------------------------------------------------


def _same_device_and_dtype(arguments: dict[str, Any], names: tuple[str, ...]) -> None:
    """All tensors among `names` on one device, and of one dtype (masks may be bool)."""
    tensors = [(n, arguments[n]) for n in names if isinstance(arguments.get(n), Tensor)]
    if not tensors:
        return
    first_name, first = tensors[0]
    for name, tensor in tensors[1:]:
        if tensor.device != first.device:
            raise mismatch(
                f"{name} is on {tensor.device}, but {first_name} is on {first.device}; "
                f"move them to one device (for example {name}.to({first_name}.device))."
            )
        if tensor.dtype != first.dtype and not (name.endswith("mask") and tensor.dtype == torch.bool):
            if name.endswith("mask") and tensor.is_floating_point():
                raise mismatch(
                    f"{name} has dtype {str(tensor.dtype)[6:]}, but {first_name} has {str(first.dtype)[6:]}; "
                    f"a float mask is added to the scores, so cast it ({name}.to({first_name}.dtype))."
                )
            if tensor.is_floating_point() and first.is_floating_point():
                raise mismatch(
                    f"{name} has dtype {str(tensor.dtype)[6:]}, but {first_name} has {str(first.dtype)[6:]}; "
                    f"cast one of them (for example {name}.to({first_name}.dtype))."
                )


MASK_MEANING = "bool (True = may attend) or floating point (added to the scores)"


def explain_mask(arguments: dict[str, Any], failure: Mismatch) -> str | None:
    """The usual causes of a mask mistake."""
    mask = arguments.get(failure.arg or "")
    if failure.arg == "attn_mask" and failure.dim is None and isinstance(mask, Tensor):
        if not (mask.dtype == torch.bool or mask.is_floating_point()):
            return f"A mask is {MASK_MEANING}: convert with attn_mask.bool()."
        if mask.ndim == 3:
            return "From (batch*num_heads, seq, kv_seq): attn_mask.unflatten(0, (batch, -1))."
    if failure.arg == "attn_mask" and failure.dim in ("seq", "kv_seq") and failure.size == 1:
        return "Masks broadcast only over batch and heads; for a per-key mask use key_padding_mask."
    return None


def _explain_attention(arguments: dict[str, Any], failure: Mismatch) -> str | None:
    q, k = arguments.get("q"), arguments.get("k")
    if failure.arg == "k" and failure.dim == "d_head" and isinstance(q, Tensor) and isinstance(k, Tensor):
        if k.ndim == 4 and k.shape[2] == q.shape[3]:
            return "k looks transposed: pass it as (batch, num_kv_heads, kv_seq, d_head); attention transposes it."
    if failure.arg == "v" and failure.dim == "kv_seq" and isinstance(q, Tensor) and q.ndim == 4:
        if q.shape[2] == failure.size:
            return "Are q and k swapped? q has as many positions as v."
    return explain_mask(arguments, failure)


def check_groups(num_heads: int, num_kv_heads: int, owner: str) -> None:
    """Raise `ConfigError` unless `num_kv_heads` divides `num_heads`."""
    if num_heads % num_kv_heads == 0:
        return
    working = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
    raise ConfigError(
        f"{owner}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; each KV head serves "
        f"a group of query heads, so num_kv_heads must be one of {working}."
    )


def _precheck_attention(arguments: dict[str, Any]) -> None:
    _same_device_and_dtype(arguments, ("q", "k", "v", "attn_mask"))


def _validate_attention(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    if dims["num_heads"] % dims["num_kv_heads"] != 0:
        raise mismatch(
            f"q has num_heads={dims['num_heads']} (axis 1), which is not a multiple of k's "
            f"num_kv_heads={dims['num_kv_heads']}; each KV head must serve a whole group of query heads"
            + ("; are q and k swapped?" if dims["num_kv_heads"] > dims["num_heads"] else ".")
        )
    dropout_p = arguments.get("dropout_p", 0.0)
    if not 0.0 <= dropout_p < 1.0:
        raise ConfigError(f"dropout_p must be in [0, 1), but got {dropout_p}.")


def _validate_split(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    width, num_heads = dims["d_inner"], arguments["num_heads"]
    if width % num_heads:
        divisors = [n for n in range(1, width + 1) if width % n == 0]
        shown = ", ".join(map(str, divisors[:8])) + (", ..." if len(divisors) > 8 else "")
        raise mismatch(
            f"x has width {width} (axis 2), which does not split into num_heads={num_heads} equal heads; "
            f"num_heads must divide it (one of {{{shown}}})."
        )


def _precheck_project(arguments: dict[str, Any]) -> None:
    _same_device_and_dtype(arguments, ("x", "weight", "bias"))


# --- public, checked stages ----------------------------------------------------------------------------


@checked(precheck=_precheck_project)
def project(x: LinearIn, weight: Weight, bias: Bias | None = None) -> LinearOut:
    """Apply a linear map in `nn.Linear` layout: `x @ weight.T + bias`.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> ssm.project(torch.randn(2, 5, 16), torch.randn(8, 16)).shape
        torch.Size([2, 5, 8])

    Arguments:
        x: activations, `(batch, seq, d_in)`.
        weight: `(d_out, d_in)`, as `nn.Linear.weight`.
        bias: `(d_out,)` or None.

    Returns:
        `(batch, seq, d_out)`.

    Raises:
        ShapeError: widths, dtypes or devices disagree.
    """
    return _project(x, weight, bias)


@checked(validate=_validate_split)
def split_heads(x: Inner, num_heads: int) -> Heads:
    """Relabel `(batch, seq, num_heads*d_head)` as `(batch, num_heads, seq, d_head)`, as a view.

    `x.view(batch, seq, num_heads, d_head).transpose(1, 2)`: no data moves, and writing through
    the result writes `x`. Splitting one axis in two is possible as a view for every stride
    pattern, so this never copies (for K and V, pass `num_kv_heads` as `num_heads`).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> x = torch.randn(2, 5, 32)
        >>> heads = ssm.split_heads(x, 4)
        >>> heads.shape, heads.data_ptr() == x.data_ptr()
        (torch.Size([2, 4, 5, 8]), True)

    Arguments:
        x: `(batch, seq, d_inner)`, the output of a projection.
        num_heads: how many heads `d_inner` holds; it must divide `d_inner`.

    Returns:
        A view of `x`, `(batch, num_heads, seq, d_inner // num_heads)`.

    Raises:
        ShapeError: `x` is not 3-D or its width does not divide into `num_heads` heads.
    """
    return _split_heads(x, num_heads)


@checked
def merge_heads(x: Heads) -> Inner:
    """The inverse of `split_heads`: `(batch, num_heads, seq, d_head)` to `(batch, seq, num_heads*d_head)`.

    `x.transpose(1, 2).reshape(batch, seq, num_heads * d_head)`: a view when `x`'s data is laid
    out `(batch, seq, num_heads, d_head)` (as `split_heads` leaves it), otherwise one copy
    (as after attention, whose output is laid out head by head).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> x = torch.randn(2, 5, 32)
        >>> torch.equal(ssm.merge_heads(ssm.split_heads(x, 4)), x)
        True

    Arguments:
        x: `(batch, num_heads, seq, d_head)`.

    Returns:
        `(batch, seq, num_heads * d_head)`.

    Raises:
        ShapeError: `x` is not 4-D.
    """
    return _merge_heads(x)


def _validate_group(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    if dims["num_heads"] % arguments["num_kv_heads"]:
        raise mismatch(
            f"q has num_heads={dims['num_heads']} (axis 1), which num_kv_heads={arguments['num_kv_heads']} "
            "does not divide; each KV head must serve a whole group of query heads."
        )


@checked(validate=_validate_group)
def group_queries(q: Heads, num_kv_heads: int) -> GroupedQueries:
    """View query heads as `(batch, num_kv_heads, group, seq, d_head)`: the GQA grouping, no copy.

    Query head `h` reads KV head `h // group`, where `group = num_heads // num_kv_heads`.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> ssm.group_queries(torch.randn(2, 8, 5, 16), num_kv_heads=2).shape
        torch.Size([2, 2, 4, 5, 16])

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        num_kv_heads: how many KV heads the query heads share; it must divide `num_heads`.

    Returns:
        A view of `q`, `(batch, num_kv_heads, group, seq, d_head)`.

    Raises:
        ConfigError: `num_kv_heads` does not divide `num_heads`.
    """
    return _group_queries(q, num_kv_heads)


@checked(precheck=_precheck_attention, validate=_validate_attention, explain=_explain_attention)
def scaled_dot_product_attention(
    q: Heads,
    k: KVHeads,
    v: KVHeads,
    *,
    attn_mask: AttnMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Heads:
    """Attention per head: `softmax(q @ k.T * scale + mask) @ v`, for MHA, GQA and MQA alike.

    The number of KV heads is read from `k`: equal to `q`'s heads is MHA, one is MQA, anything
    dividing it is GQA, where query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
    K and V are never expanded to `num_heads` heads: the query heads of a group are folded
    into the query axis instead. Equals `torch.nn.functional.scaled_dot_product_attention(...,
    enable_gqa=True)` wherever that is defined, with two deliberate differences:

    - `is_causal` is **lower-right aligned**: when `seq < kv_seq`, query `i` sits at absolute
      position `kv_seq - seq + i` and sees keys `0..kv_seq - seq + i`, as decoding with a KV cache
      needs. (torch aligns top-left, so a single decoding query would see only the first key.)
      `is_causal` and `attn_mask` combine: a key must be allowed by both.
    - A query row with nothing to attend to yields zeros, never NaN, in outputs and gradients.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> q, k = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16)
        >>> ssm.scaled_dot_product_attention(q, k, k, is_causal=True).shape
        torch.Size([2, 8, 5, 16])

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        k, v: `(batch, num_kv_heads, kv_seq, d_head)`; `num_kv_heads` must divide `num_heads`.
        attn_mask: `(seq, kv_seq)` or `(#batch, #num_heads, seq, kv_seq)`; bool (True = may
            attend, torch's SDPA convention) or float (added to the scores, `q`'s dtype). Only the
            batch and heads axes may be 1 to broadcast; `seq` and `kv_seq` must be given in full.
        is_causal: mask future keys, lower-right aligned.
        scale: score scale; default `1 / sqrt(d_head)`.
        dropout_p: dropout on the probabilities (apply only in training).

    Returns:
        `(batch, num_heads, seq, d_head)`.

    Raises:
        ShapeError: shapes, dtypes or devices disagree, or `num_kv_heads` does not divide `num_heads`.
    """
    return _attend(q, k, v, _masking(attn_mask, None, is_causal, q, k), scale, dropout_p)


@checked(precheck=_precheck_attention, validate=_validate_attention, explain=_explain_attention)
def attention_weights(
    q: Heads,
    k: KVHeads,
    *,
    attn_mask: AttnMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Probabilities:
    """The per-head attention probabilities `softmax(q @ k.T * scale + mask)`.

    Same conventions as `scaled_dot_product_attention` (GQA by shape, lower-right causal, rows
    with nothing to attend to are zeros).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> w = ssm.attention_weights(torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16))
        >>> w.shape, bool(torch.allclose(w.sum(-1), torch.ones(2, 8, 5)))
        (torch.Size([2, 8, 5, 7]), True)

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        k: `(batch, num_kv_heads, kv_seq, d_head)`.
        attn_mask, is_causal, scale: as in `scaled_dot_product_attention`.

    Returns:
        `(batch, num_heads, seq, kv_seq)`; each row sums to 1 (or is all zeros).

    Raises:
        ShapeError: shapes, dtypes or devices disagree.
    """
    return _head_weights(q, k, _masking(attn_mask, None, is_causal, q, k, explicit=True), scale)
