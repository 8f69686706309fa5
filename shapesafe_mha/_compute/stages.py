"""The typed stages of multi-head attention: each one's annotations are its contract.

The public stages (`project`, `split_heads`, `merge_heads`, `group_queries`,
`scaled_dot_product_attention`, `attention_weights`) are checked when called on their own. The
module's stages below them (`project_query`, `split_query`, ..., `project_output`) are what
`MultiHeadAttention.forward` is made of: in a checked forward each runs in one session, against one
memo, with its result checked and reported to the trace.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.contract import raw, stage
from .._core.dims import (
    AlibiSlopes,
    AttnMask,
    Bias,
    CacheBuffer,
    FoldedBias,
    FoldedMask,
    FoldedProbabilities,
    FoldedQueries,
    FullMask,
    FusedInner,
    GatedQueryInner,
    GroupedQueries,
    Heads,
    Inner,
    KVHeads,
    KVTokens,
    Lambda,
    LinearIn,
    LinearOut,
    NewKVHeads,
    NewKVInner,
    OutputGate,
    PaddingMask,
    Probabilities,
    QueryInner,
    RowsWithAKey,
    SeenAttnMask,
    SeenPaddingMask,
    Sinks,
    Tokens,
    Weight,
)
from .._core.errors import ConfigError
from .._core.messages import ExplainedError, divisors, dtype_name, mismatch, shown
from . import kernels as K
from .cache import KVCache
from .fastpath import project as call_projection
from .norms import HeadNorm, OffsetRMSNorm
from .scorer import score

# --- what annotations cannot say --------------------------------------------------------------------


def positive_count(owner: str, name: str, value: Any) -> None:
    """Raise `ConfigError` unless `value` is a positive int (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}{name} must be a positive int, but got {value!r}.")


def check_float_dtype(owner: str, dtype: Any) -> None:
    """A module's `dtype=`: None or a floating-point torch.dtype."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(
            f"{owner}: dtype={dtype!r} is not a floating-point torch.dtype, but the weights are learned and "
            "softmax needs fractions; pass torch.float32, torch.bfloat16, torch.float16 or torch.float64."
        )


def same_device_and_dtype(arguments: dict[str, Any], names: tuple[str, ...]) -> None:
    """All tensors among `names` on one device, and of one dtype (masks may be bool)."""
    tensors = [(n, arguments[n]) for n in names if isinstance(arguments.get(n), Tensor)]
    if not tensors:
        return
    first_name, first = tensors[0]
    for name, tensor in tensors[1:]:
        if tensor.device != first.device:
            raise mismatch(
                f"{name} is on {tensor.device}, but {first_name} is on {first.device}; "
                f"move them to one device (for example {name}.to({first_name}.device)).",
                arg=name,
            )
        if tensor.dtype == first.dtype or (name.endswith("mask") and tensor.dtype == torch.bool):
            continue
        if name.endswith("mask") and tensor.is_floating_point():
            raise mismatch(
                f"{name} has dtype {dtype_name(tensor.dtype)}, but {first_name} has {dtype_name(first.dtype)}; "
                f"a float mask is added to the scores, so cast it ({name}.to({first_name}.dtype)).",
                arg=name,
            )
        if tensor.is_floating_point() and first.is_floating_point():
            raise mismatch(
                f"{name} has dtype {dtype_name(tensor.dtype)}, but {first_name} has {dtype_name(first.dtype)}; "
                f"cast one of them (for example {name}.to({first_name}.dtype)).",
                arg=name,
            )


MASK_MEANING = "bool (True = may attend) or floating point (added to the scores)"


def explain_mask(arguments: dict[str, Any], failure: ExplainedError) -> str | None:
    """The usual causes of a mask mistake."""
    mask = arguments.get(failure.arg or "")
    if failure.arg == "attn_mask" and failure.dim is None and isinstance(mask, Tensor):
        if not (mask.dtype == torch.bool or mask.is_floating_point()):
            return f"A mask is {MASK_MEANING}: convert with attn_mask.bool()."
        if mask.ndim == 3:
            return "From (batch*num_heads, seq, kv_seq): attn_mask.unflatten(0, (batch, -1))."
    if failure.arg == "attn_mask" and failure.dim in ("seq", "kv_seq") and failure.size == 1:
        return "Masks broadcast only over batch and heads; for a per-key mask use key_padding_mask."
    if failure.arg == "key_padding_mask" and failure.dim is None:
        return "key_padding_mask is (batch, kv_seq) bool, True = padding."
    return None


def _explain_attention(arguments: dict[str, Any], failure: ExplainedError) -> str | None:
    q, k = arguments.get("q"), arguments.get("k")
    if failure.arg == "k" and failure.dim == "d_head" and isinstance(q, Tensor) and isinstance(k, Tensor):
        if k.ndim == 4 and k.shape[2] == q.shape[3]:
            return "k looks transposed: pass it as (batch, num_kv_heads, kv_seq, d_head); attention transposes it."
    if failure.arg == "v" and failure.dim == "kv_seq" and isinstance(q, Tensor) and q.ndim == 4:
        if q.shape[2] == failure.size:
            return "Are q and k swapped? q has as many positions as v."
    return explain_mask(arguments, failure)


def _precheck_attention(arguments: dict[str, Any]) -> None:
    same_device_and_dtype(arguments, ("q", "k", "v", "attn_mask"))


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
    check_variants("", arguments.get("window"), arguments.get("softcap"))


def check_variants(owner: str, window: Any, softcap: Any) -> None:
    """Raise `ConfigError` unless a sliding window is a positive int and a softcap a finite positive number."""
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ConfigError(
                f"{owner}window must be a positive int (the keys a query sees, itself included), but got {window!r}."
            )
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0 < softcap < math.inf
    ):
        raise ConfigError(f"{owner}logit softcap must be a finite positive number, but got {softcap!r}.")


def _validate_split(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    positive_count("", "num_heads", arguments["num_heads"])
    width, num_heads = dims["d_inner"], arguments["num_heads"]
    if width % num_heads:
        raise mismatch(
            f"x has width {width} (axis 2), which does not split into num_heads={num_heads} equal heads; "
            f"num_heads must divide it (one of {shown(divisors(width))})."
        )


def _validate_group(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    positive_count("", "num_kv_heads", arguments["num_kv_heads"])
    if dims["num_heads"] % arguments["num_kv_heads"]:
        raise mismatch(
            f"q has num_heads={dims['num_heads']} (axis 1), which num_kv_heads={arguments['num_kv_heads']} "
            "does not divide; each KV head must serve a whole group of query heads."
        )


def _precheck_project(arguments: dict[str, Any]) -> None:
    same_device_and_dtype(arguments, ("x", "weight", "bias"))


# --- public stages --------------------------------------------------------------------------------------


@stage(precheck=_precheck_project)
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
    return F.linear(x, weight, bias)


@stage(validate=_validate_split, raw=K.split_heads)
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
        ConfigError: `num_heads` is not a positive int.
    """
    return K.split_heads(x, num_heads)


@stage(raw=K.merge_heads)
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
    return K.merge_heads(x)


@stage(validate=_validate_group, raw=K.group_queries)
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
        ShapeError: `num_kv_heads` does not divide `num_heads`.
        ConfigError: `num_kv_heads` is not a positive int.
    """
    return K.group_queries(q, num_kv_heads)


def _as_torch(
    q_shape: torch.Size, k_shape: torch.Size, attn_mask: Any, is_causal: bool, window: Any, softcap: Any
) -> bool:
    """Whether torch's own SDPA computes this attention as it is: no mask, window or softcap, and causal only with
    as many queries as keys (where torch's top-left alignment is our lower-right one)."""
    return softcap is None and attn_mask is None and window is None and (not is_causal or q_shape[2] == k_shape[2])


def _plan_attention(arguments: dict[str, Any]) -> Callable[..., Tensor] | None:
    """A remembered `scaled_dot_product_attention` whose body would be one call of torch's: that call, its flags
    bound (they are in the call's key), without the body's decisions (`Stage.remembered_call`). The kernel is
    looked up in `K` at each call, as the body does."""
    q, k, is_causal, scale, dropout_p = (arguments[n] for n in ("q", "k", "is_causal", "scale", "dropout_p"))
    if not _as_torch(q.shape, k.shape, arguments["attn_mask"], is_causal, arguments["window"], arguments["softcap"]):
        return None
    if q.shape[1] == k.shape[1]:
        return lambda q, k, v, **_: K.sdpa(q, k, v, None, is_causal, scale, dropout_p)
    if K.native_gqa(q, k, dropout_p):
        return lambda q, k, v, **_: K.sdpa_gqa(q, k, v, None, is_causal, scale, dropout_p)
    return None


@stage(precheck=_precheck_attention, validate=_validate_attention, explain=_explain_attention, plan=_plan_attention)
def scaled_dot_product_attention(
    q: Heads,
    k: KVHeads,
    v: KVHeads,
    *,
    attn_mask: AttnMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
) -> Heads:
    """Attention per head: `softmax(q @ k.T * scale + mask) @ v`, for MHA, GQA and MQA alike.

    The number of KV heads is read from `k`: equal to `q`'s heads is MHA, one is MQA, anything
    dividing it is GQA, where query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
    K and V are never expanded to `num_heads` heads: torch's own GQA kernel runs where it copies
    nothing (`enable_gqa=True`, on CPU), and elsewhere the query heads of a group are folded into
    the query axis. Equals `torch.nn.functional.scaled_dot_product_attention(...,
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
        window: sliding-window attention: query `i` sees only keys fewer than `window` positions
            before it (itself included), lower-right aligned like `is_causal`, as Mistral and
            Gemma do.
        softcap: cap the scores smoothly at `±softcap` before the mask, `softcap * tanh(s / softcap)`
            (Gemma 2's `attn_logit_softcapping`).

    Returns:
        `(batch, num_heads, seq, d_head)`.

    Raises:
        ShapeError: shapes, dtypes or devices disagree, or `num_kv_heads` does not divide `num_heads`.
        ConfigError: `window` is not a positive int, or `softcap` not a positive number.
    """
    q_shape, k_shape = q.shape, k.shape
    if _as_torch(q_shape, k_shape, attn_mask, is_causal, window, softcap):
        if q_shape[1] == k_shape[1]:  # torch's own call, nothing around it
            return K.sdpa(q, k, v, None, is_causal, scale, dropout_p)
        if K.native_gqa(q, k, dropout_p):
            return K.sdpa_gqa(q, k, v, None, is_causal, scale, dropout_p)
    out, _, _ = score(_SCORING, q, k, v, attn_mask, None, is_causal, window, scale, dropout_p, softcap)
    return out  # pyright: ignore[reportReturnType]  (heads: `merge` was not asked for)


@stage(precheck=_precheck_attention, validate=_validate_attention, explain=_explain_attention)
def attention_weights(
    q: Heads,
    k: KVHeads,
    *,
    attn_mask: AttnMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
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
        attn_mask, is_causal, scale, window, softcap: as in `scaled_dot_product_attention`.

    Returns:
        `(batch, num_heads, seq, kv_seq)`; each row sums to 1 (or is all zeros).

    Raises:
        ShapeError: shapes, dtypes or devices disagree.
    """
    mask = K.combine_masks(attn_mask, None, is_causal, q, k, explicit=True, window=window)
    may_empty = K.may_empty_rows(attn_mask, None, is_causal, q.shape[2], k.shape[2])
    return K.head_weights(q, k, mask, may_empty, scale, softcap)


# --- the module's stages --------------------------------------------------------------------------------


def _linear_fits(name: str, given: str, what: str) -> Callable[[dict[str, Any], dict[str, int]], None]:
    """A projection's `validate`: an `nn.Linear`'s weight and bias fit each other and the tensor it projects (the
    argument `given`, `what` to the user), so torch's own error, or its silent broadcast of a bias of one feature,
    never stands for ours."""

    def validate(arguments: dict[str, Any], dims: dict[str, int]) -> None:
        proj, x = arguments["proj"], arguments[given]
        if not isinstance(proj, nn.Linear) or not isinstance(x, Tensor):
            return  # an adapter, a quantized layer: its own call decides, and the result is checked
        weight, bias = proj.weight, proj.bias
        if not isinstance(weight, Tensor) or weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise mismatch(
                f"{name}.weight has shape {shape}, but {name} reads {what}'s {x.shape[-1]} features, so it must be "
                f"(out_features, {x.shape[-1]}) in nn.Linear's layout; load a weight of that shape.",
                arg=f"{name}.weight",
            )
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
            shape = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise mismatch(
                f"{name}.bias has shape {shape}, but {name}.weight has {weight.shape[0]} output features, so it "
                f"must be ({weight.shape[0]},); load a bias of that shape (or set {name}.bias = None).",
                arg=f"{name}.bias",
            )
        casts = autocast_dtype(x.device) is not None  # autocast casts the weights to the input's dtype
        for part, tensor in (("weight", weight), ("bias", bias)):
            if isinstance(tensor, Tensor) and ((tensor.dtype != x.dtype and not casts) or tensor.device != x.device):
                have = f"{dtype_name(tensor.dtype)} on {tensor.device}"
                want = f"{dtype_name(x.dtype)} on {x.device}"
                raise mismatch(
                    f"{name}.{part} is {have}, but {what} is {want}; keep the module's parameters in one dtype and "
                    f"on one device (module.to({x.dtype}) or module.to('{x.device}')).",
                    arg=f"{name}.{part}",
                )

    return validate


# What MultiHeadAttention.forward is made of. Names are the trace's; dimension names are the
# forward's, so one memo spans them all.


@stage(name="q_proj", public=("query",), raw=call_projection, validate=_linear_fits("q_proj", "query", "query"))
def project_query(proj: nn.Module, query: Tokens) -> QueryInner:
    return call_projection(proj, query)


@stage(name="q_proj", public=("query",), validate=_linear_fits("q_proj", "query", "query"))
def project_gated_query(proj: nn.Module, query: Tokens) -> GatedQueryInner:
    """Queries with an output gate (Qwen3-Next): each head's `d_head` query features, then its `d_head` gate."""
    return call_projection(proj, query)


@stage(name="split_q", trace=("split_q", "gate"))
def split_gated_query(x: GatedQueryInner, num_heads: int) -> tuple[Heads, OutputGate]:
    """Each head's queries and its gate, views of the projection: `(batch, num_heads, seq, d_head)` and
    `(batch, seq, num_heads, d_head)`, as the merged heads are laid out."""
    both = x.unflatten(-1, (num_heads, 2, -1))
    return both[..., 0, :].transpose(1, 2), both[..., 1, :]


@stage(name="output_gate")
def gate_output(x: QueryInner, gate: OutputGate) -> QueryInner:
    """The merged heads times `sigmoid(gate)`, feature by feature, before the output projection (Qwen3-Next)."""
    return (x.unflatten(-1, gate.shape[-2:]) * torch.sigmoid(gate)).flatten(-2)


def _project_kv(proj: nn.Module, x: KVTokens) -> NewKVInner:
    return call_projection(proj, x)


project_key = stage(name="k_proj", raw=call_projection, validate=_linear_fits("k_proj", "x", "key"))(_project_kv)
project_value = stage(name="v_proj", raw=call_projection, validate=_linear_fits("v_proj", "x", "value"))(_project_kv)


@stage(name="qkv_proj", public=("query",), raw=F.linear)
def project_qkv(query: Tokens, weight: Tensor, bias: Tensor | None) -> FusedInner:
    """Q, K and V of self-attention in one matrix multiply (the weights concatenated, see `fastpath`)."""
    return F.linear(query, weight, bias)


@stage(name="unfuse", trace=("q_proj", "k_proj", "v_proj"))
def unfuse(qkv: FusedInner, q_width: int, kv_width: int) -> tuple[QueryInner, NewKVInner, NewKVInner]:
    q, k, v = qkv.split_with_sizes([q_width, kv_width, kv_width], dim=-1)  # Tensor.split is a Python wrapper
    return q, k, v


@stage(name="split_qkv", trace=("split_q", "split_k", "split_v"), raw=K.split_fused)
def split_fused(qkv: FusedInner, num_heads: int, num_kv_heads: int) -> tuple[Heads, NewKVHeads, NewKVHeads]:
    return K.split_fused(qkv, num_heads, num_kv_heads)


@stage(name="split_q", raw=K.split_heads)
def split_query(x: QueryInner, num_heads: int) -> Heads:
    return K.split_heads(x, num_heads)


def _split_kv(x: NewKVInner, num_kv_heads: int) -> NewKVHeads:
    return K.split_heads(x, num_kv_heads)


split_key = stage(name="split_k", raw=K.split_heads)(_split_kv)
split_value = stage(name="split_v", raw=K.split_heads)(_split_kv)


_NORM_KINDS = (nn.RMSNorm, nn.LayerNorm, OffsetRMSNorm, HeadNorm)  # the norms whose weights' layouts are known


def torch_norm_agrees(norm: Any, name: str) -> None:
    """torch's `RMSNorm` and `LayerNorm` normalise over their `normalized_shape` and scale by their `weight`: where
    the two disagree (one of them set alone), a `ShapeError` naming `name`, not torch's `RuntimeError`."""
    weight = getattr(norm, "weight", None)
    if not isinstance(norm, nn.RMSNorm | nn.LayerNorm) or not isinstance(weight, Tensor):
        return
    shape = tuple(norm.normalized_shape)
    if shape != tuple(weight.shape):
        raise mismatch(
            f"{name}.normalized_shape is {shape}, but {name}.weight has shape {tuple(weight.shape)}: torch normalises "
            "over normalized_shape and scales by the weight, so they must agree. Set a norm built for the sizes you "
            "want (its weight of that shape) rather than normalized_shape alone.",
            arg=f"{name}.normalized_shape",
        )


def _norms_fit(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    """A QK-norm's `validate`: a norm of a kind the library builds has a weight that fits what it normalises (a
    `HeadNorm`'s `(heads, d_head)` the heads, another's the trailing features), so torch's broadcast error never
    stands for ours; a norm of the user's own kind decides itself."""
    for name, given in (("q_norm", "q"), ("k_norm", "k")):
        norm, x = arguments[name], arguments[given]
        weight = getattr(norm, "weight", None)
        if not isinstance(norm, _NORM_KINDS) or not isinstance(weight, Tensor) or not isinstance(x, Tensor):
            continue
        torch_norm_agrees(norm, name)
        per_head = isinstance(norm, HeadNorm) and weight.ndim == 2
        wanted = (x.shape[1], x.shape[-1]) if per_head else tuple(x.shape[x.ndim - weight.ndim :])
        if tuple(weight.shape) != wanted:
            raise mismatch(
                f"{name}.weight has shape {tuple(weight.shape)}, but {given} {tuple(x.shape)} needs {wanted}: the norm "
                "was built for other sizes. Pruning heads? Set num_heads and num_kv_heads first, then norms of the "
                "new sizes (their rows of the old weights).",
                arg=f"{name}.weight",
            )


@stage(name="qk_norm", trace=("q_norm", "k_norm"), validate=_norms_fit)
def normalize_qk(q_norm: nn.Module, k_norm: nn.Module, q: Heads, k: NewKVHeads) -> tuple[Heads, NewKVHeads]:
    """QK-norm (Qwen3, Gemma 3): each head's query and key RMS-normalised over `d_head`, before RoPE
    (HunYuan: after it)."""
    return q_norm(q), k_norm(k)


@stage(name="qk_norm", trace=("q_norm", "k_norm"), validate=_norms_fit)
def normalize_qk_inner(
    q_norm: nn.Module, k_norm: nn.Module, q: QueryInner, k: NewKVInner
) -> tuple[QueryInner, NewKVInner]:
    """QK-norm over every head at once (OLMo-2): the projected queries RMS-normalised over `num_heads * d_head`
    features, the keys over `num_kv_heads * d_head`, before the head split (so before RoPE)."""
    return q_norm(q), k_norm(k)


@stage(name="clip_qkv", trace=("clip_q", "clip_k", "clip_v"))
def clip_projections(
    q: QueryInner, k: NewKVInner, v: NewKVInner, bound: float
) -> tuple[QueryInner, NewKVInner, NewKVInner]:
    """OLMo's `clip_qkv`: the projected queries, keys and values clamped to `[-bound, bound]`, before the head
    split (after OLMoE's QK-norm over every head)."""
    return q.clamp(-bound, bound), k.clamp(-bound, bound), v.clamp(-bound, bound)


@stage(name="temperature", trace=("q_tuned",))
def tune_query_temperature(q: Heads, start: int, floor_scale: int, attn_scale: float) -> Heads:
    """Llama 4's temperature tuning of its NoPE layers: the queries at cache index `start + i` scaled by
    `1 + attn_scale * log(1 + floor((start + i + 1) / floor_scale))`, so far positions' scores sharpen."""
    return K.tune_temperature(q, start, floor_scale, attn_scale)


@stage(name="keys", trace=("", ""), sources={"result": "key"})
def attend_to_new(k: NewKVHeads, v: NewKVHeads) -> tuple[KVHeads, KVHeads]:
    """Without a cache the keys attended over are the new ones (`kv_seq` is `new`)."""
    return k, v


def check_cache(cache: Any, kind: type, computed: Any = None, fix: str = "") -> None:
    """Raise unless `cache` is a `kind` (KVCache, LatentCache) holding what the module computes (`computed`'s
    dtype and device); `fix` adds a way out to the message."""
    if cache is None:
        return
    if not isinstance(cache, kind):
        raise mismatch(
            f"kv_cache must be a shapesafe_mha.{kind.__name__}, but got {type(cache).__name__}; "
            "make one with module.new_cache(batch, capacity).",
            arg="kv_cache",
        )
    held = cache.dtype, cache.device
    if isinstance(computed, Tensor) and held != (computed.dtype, computed.device):
        autocast = autocast_dtype(computed.device)
        if cache.device == computed.device and autocast is not None and cache.dtype in (autocast, torch.float32):
            return  # autocast computes in its dtype from a cache of the parameters' (float32) or its own
        where = "" if autocast is None else f" (autocast computes in {dtype_name(autocast)})"
        raise mismatch(
            f"kv_cache holds {dtype_name(cache.dtype)} on {cache.device}, but the module computes "
            f"{dtype_name(computed.dtype)} on {computed.device}{where}; use module.new_cache(batch, capacity){fix}.",
            arg="kv_cache",
        )


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype `torch.autocast` computes in on `device` now, or None where it is off."""
    kind = device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def autocast_on() -> bool:
    """Whether `torch.autocast` is on for any device (cheaper than asking for a device's dtype).

    torch's own test, `torch._C._is_any_autocast_enabled` (what `torch.autocast` itself reads; no public name):
    one call, where asking `torch.is_autocast_enabled` of each device type parses its name each time
    (`tests/test_verdicts.py` pins that the two agree)."""
    return _any_autocast()


_any_autocast = torch._C._is_any_autocast_enabled  # pyright: ignore[reportAttributeAccessIssue, reportPrivateUsage]


def _precheck_cache(arguments: dict[str, Any]) -> None:
    k = arguments["k"]
    fix = f" or kv_cache.to({k.dtype}, '{k.device}')" if isinstance(k, Tensor) else ""
    check_cache(arguments["cache"], KVCache, k, fix)


@stage(
    name="cache",
    public=("kv_cache",),
    trace=("cache_k", "cache_v"),
    sources={"result": "the cache plus key"},
    precheck=_precheck_cache,
)
def append_to_cache(cache: KVCache, kv_cache: CacheBuffer, k: NewKVHeads, v: NewKVHeads) -> tuple[KVHeads, KVHeads]:
    """Write the new positions into the cache; attend over everything it holds."""
    return cache.write(k, v, "MultiHeadAttention.forward()")


def precheck_masks(arguments: dict[str, Any]) -> None:
    """Masks on the queries' device; a float `attn_mask` in their dtype (any, under autocast)."""
    q = arguments["q"]
    for name in ("attn_mask", "key_padding_mask"):
        mask = arguments[name]
        if isinstance(mask, Tensor) and mask.device != q.device:
            raise mismatch(f"{name} is on {mask.device}, but the module's parameters are on {q.device}.", arg=name)
        if isinstance(mask, Tensor) and mask.is_floating_point() and mask.dtype != q.dtype and name == "attn_mask":
            if autocast_dtype(q.device) is not None:
                continue  # autocast casts what it adds the mask to; a mask in the parameters' dtype is fine
            raise mismatch(
                f"attn_mask has dtype {dtype_name(mask.dtype)}; a float mask is added to the scores, so it must be "
                f"{dtype_name(q.dtype)} like the module (or bool: True = may attend).",
                arg=name,
            )


def _validate_seen(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    seen = arguments["seen"]
    if "seen" in dims and dims["seen"] != seen:
        name = "attn_mask" if isinstance(arguments["attn_mask"], Tensor) else "key_padding_mask"
        raise mismatch(
            f"{name} covers {dims['seen']} key positions, but the sliding-window kv_cache has seen {seen} "
            f"(cached and new); with a window, masks cover every position seen (the cache keeps the last "
            f"{arguments['kept']}).",
            arg=name,
            dim="seen",
        )


@stage(name="window_masks", trace=("", ""), public=("attn_mask", "key_padding_mask"), validate=_validate_seen)
def visible_masks(
    attn_mask: SeenAttnMask | None, key_padding_mask: SeenPaddingMask | None, seen: int, kept: int
) -> tuple[AttnMask | None, PaddingMask | None]:
    """Masks over every position a sliding-window cache has seen, cut to the positions it kept (the last)."""
    return (
        None if attn_mask is None else attn_mask[..., seen - kept :],
        None if key_padding_mask is None else key_padding_mask[:, seen - kept :],
    )


@stage(name="chunk_mask", public=("attn_mask", "key_padding_mask"), precheck=precheck_masks, explain=explain_mask)
def chunk_masks(
    q: Heads, k: KVHeads, attn_mask: AttnMask | None, key_padding_mask: PaddingMask | None, chunk: int
) -> AttnMask:
    """Llama 4's chunked attention: `attn_mask` restricted to the keys of each query's own chunk of `chunk`
    positions, counted from each sequence's first real key."""
    return K.chunk_mask(attn_mask, key_padding_mask, q, k, chunk)


@stage(name="mask", public=("attn_mask", "key_padding_mask"), precheck=precheck_masks, explain=explain_mask)
def combine_masks(
    q: Heads,
    k: KVHeads,
    attn_mask: AttnMask | None,
    key_padding_mask: PaddingMask | None,
    is_causal: bool,
    explicit: bool,
    window: int | None,
    native: bool,
) -> FullMask | None:
    return K.combine_masks(attn_mask, key_padding_mask, is_causal, q, k, explicit, window, gqa=native)


@stage(name="attention")
def attend_heads(q: Heads, k: KVHeads, v: KVHeads, causal: bool, dropout_p: float, scale: float | None) -> Heads:
    """MHA with nothing to mask but torch's own causality: SDPA as it is."""
    return K.sdpa(q, k, v, None, causal, scale, dropout_p)


@stage(name="attention")
def attend_native(
    q: Heads,
    k: KVHeads,
    v: KVHeads,
    mask: FullMask | None,
    causal: bool,
    may_empty: bool,
    dropout_p: float,
    scale: float | None,
) -> Heads:
    """GQA/MQA (or masked MHA) by torch's own kernel where it copies nothing (`K.native_gqa`); K/V at
    `num_kv_heads` heads, the mask at its own heads; rows with nothing to attend to are zeros."""
    return K.attend_native(q, k, v, mask, causal, may_empty, scale, dropout_p)


@stage(name="fold_queries", raw=K.fold_queries)
def fold_queries(grouped: GroupedQueries) -> FoldedQueries:
    return K.fold_queries(grouped)


@stage(name="fold_queries", raw=K.fold_one_query)
def fold_one_query(q: Heads, num_kv_heads: int) -> FoldedQueries:
    """One query a head (decoding): each KV head's group of query heads as its rows, by one view."""
    return K.fold_one_query(q, num_kv_heads)


@stage(name="fold_mask", trace=("", ""), raw=K.fold_mask_rows)
def fold_mask(
    mask: FullMask, may_empty: bool, num_heads: int, num_kv_heads: int
) -> tuple[FoldedMask, RowsWithAKey | None]:
    """The mask laid out as the folded queries; rows with no key opened (and noted, to zero them after)."""
    return K.fold_mask_rows(mask, may_empty, num_heads, num_kv_heads)


@stage(name="attention_folded", trace=("",))
def attend_folded(
    q: FoldedQueries, k: KVHeads, v: KVHeads, mask: FoldedMask | None, dropout_p: float, scale: float | None
) -> FoldedQueries:
    return K.sdpa(q, k, v, mask, False, scale, dropout_p)


@stage(name="attention")
def unfold(out: FoldedQueries, num_heads: int, rows: RowsWithAKey | None) -> Heads:
    return K.zero_rows(K.unfold(out, num_heads), rows)


@stage(name="alibi")
def alibi_bias(slopes: AlibiSlopes, q: Heads, k: KVHeads) -> FoldedBias:
    """ALiBi (Bloom, MPT): `slopes[h] * (kv_pos - q_pos)` for each query head's row and key, laid out as the
    folded queries, the queries at their lower-right aligned positions."""
    return K.alibi_bias(slopes, k.shape[1], q.shape[2], k.shape[2])


@stage(name="weights_folded", trace=("",))
def folded_weights(
    q: FoldedQueries,
    k: KVHeads,
    mask: FoldedMask | None,
    scale: float | None,
    softcap: float | None,
    sinks: Sinks | None = None,
    bias: FoldedBias | None = None,
) -> FoldedProbabilities:
    """The probabilities of the folded queries; with `sinks` (gpt-oss) one more logit per query head takes part
    in each row's softmax and is dropped after it; `bias` (ALiBi's) is added to the scores after the softcap."""
    rows = None if sinks is None else K.folded_sinks(sinks, k.shape[1], q.shape[2] * k.shape[1] // sinks.shape[0])
    return K.probabilities(q, k, mask, scale, softcap, rows, bias)


@stage(name="weights")
def unfold_weights(weights: FoldedProbabilities, num_heads: int, rows: RowsWithAKey | None) -> Probabilities:
    return K.zero_rows(K.unfold(weights, num_heads), rows)


@stage(name="attention_folded", trace=("",), raw=K.weighted_values)
def weigh_values(weights: FoldedProbabilities, v: KVHeads, dropout_p: float) -> FoldedQueries:
    return K.weighted_values(weights, v, dropout_p)


@stage(name="differential_values", trace=("v_first", "v_second"), raw=K.differential_values)
def differential_values(v: KVHeads) -> tuple[KVHeads, KVHeads]:
    """Differential attention (DiffLlama): the values of the first half of the KV heads and of the second, each
    repeated over every KV head, so that each query head's map attends to both."""
    return K.differential_values(v)


@stage(name="differential")
def differential_heads(
    first: Heads,
    second: Heads,
    lambda_q1: Lambda,
    lambda_k1: Lambda,
    lambda_q2: Lambda,
    lambda_k2: Lambda,
    lambda_init: float,
    eps: float,
) -> Heads:
    """Differential attention (DiffLlama): heads `p` and `p + num_heads/2` subtracted,
    `(1 - lambda_init) * rms_norm(out_p - lambda * out_{p + num_heads/2})` over both halves of the values,
    `lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init`; each pair's `2 * d_head`
    features laid out as two heads, side by side once merged."""
    lam = K.differential_lambda(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init, first.dtype)
    return K.differential_heads(first, second, lam, lambda_init, eps)


@stage(name="merge", raw=K.merge_heads)
def merge(x: Heads) -> QueryInner:
    return K.merge_heads(x)


@stage(name="merge", raw=K.merge_one_query)
def merge_one_query_heads(x: Heads) -> QueryInner:
    """One query a head (decoding on torch's kernel): its heads merged at once, by one reshape (no transpose)."""
    return K.merge_one_query(x)


@stage(name="merge", raw=K.merge_one_query)
def merge_one_query(out: FoldedQueries) -> QueryInner:
    """One query a head (decoding): the folded attention's output merged at once (unfolding it is a view)."""
    return K.merge_one_query(out)


@stage(name="o_proj", raw=call_projection, validate=_linear_fits("o_proj", "x", "the merged heads"))
def project_output(proj: nn.Module, x: QueryInner) -> Tokens:
    return call_projection(proj, x)


@stage(name="attention", public=("query",))
def native_attention(
    query: Tokens, in_weight: Tensor, in_bias: Tensor, out_weight: Tensor, out_bias: Tensor, num_heads: int
) -> Tokens:
    """Exactly what nn.MultiheadAttention's inference fast path runs: torch's fused MHA kernel."""
    from .fastpath import native_kernel

    return native_kernel(query, in_weight, in_bias, out_weight, out_bias, num_heads)


# The scorer's stages, unchecked: what the public scaled_dot_product_attention runs inside its own check.
_SCORING = raw(
    combine_masks=combine_masks, attend_heads=attend_heads, attend_native=attend_native, group_queries=group_queries,
    fold_queries=fold_queries, fold_one_query=fold_one_query, fold_mask=fold_mask, attend_folded=attend_folded,
    unfold=unfold, alibi_bias=alibi_bias, folded_weights=folded_weights, unfold_weights=unfold_weights,
    weigh_values=weigh_values, merge_one_query=merge_one_query,
)  # fmt: skip

# The stages MultiHeadAttention.forward composes, by the names it calls them.
FORWARD_STAGES: dict[str, Any] = {
    "project_query": project_query,
    "project_key": project_key,
    "project_value": project_value,
    "project_qkv": project_qkv,
    "project_gated_query": project_gated_query,
    "split_gated_query": split_gated_query,
    "gate_output": gate_output,
    "unfuse": unfuse,
    "split_fused": split_fused,
    "split_query": split_query,
    "split_key": split_key,
    "split_value": split_value,
    "normalize_qk": normalize_qk,
    "normalize_qk_inner": normalize_qk_inner,
    "clip_projections": clip_projections,
    "tune_query_temperature": tune_query_temperature,
    "attend_to_new": attend_to_new,
    "append_to_cache": append_to_cache,
    "visible_masks": visible_masks,
    "chunk_masks": chunk_masks,
    "combine_masks": combine_masks,
    "attend_heads": attend_heads,
    "attend_native": attend_native,
    "group_queries": group_queries,
    "fold_queries": fold_queries,
    "fold_one_query": fold_one_query,
    "fold_mask": fold_mask,
    "attend_folded": attend_folded,
    "unfold": unfold,
    "alibi_bias": alibi_bias,
    "folded_weights": folded_weights,
    "unfold_weights": unfold_weights,
    "weigh_values": weigh_values,
    "differential_values": differential_values,
    "differential_heads": differential_heads,
    "merge": merge,
    "merge_one_query": merge_one_query,
    "merge_one_query_heads": merge_one_query_heads,
    "project_output": project_output,
    "native_attention": native_attention,
}
