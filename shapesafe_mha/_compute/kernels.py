"""Kernels: the computations of attention, nothing else (no checks, no tracing).

Stages (`stages.py`) give these their contracts; the module composes the stages.
"""

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    # Splitting one axis in two is always expressible as a view, whatever x's strides are.
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def split_fused(qkv: Tensor, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The query, key and value heads of a fused Q/K/V projection, as views.

    Its features are split into heads once and the heads axis into the three: three views, where splitting
    Q, K and V apart first and each into heads takes seven (about 4 us a call on CPU). The same views either
    way (storage, offset, shape, and the strides of every axis longer than 1)."""
    shape = qkv.shape  # (batch, seq, features): `view`, a call of torch's C API (`unflatten` is Python's)
    heads_total = num_heads + 2 * num_kv_heads
    if shape[1] == 1:  # one position (decoding): heads before it by one view, no transpose to dispatch
        heads = qkv.view(shape[0], heads_total, 1, shape[2] // heads_total)
    else:
        heads = qkv.view(shape[0], shape[1], heads_total, shape[2] // heads_total).transpose(1, 2)
    q, k, v = heads.split_with_sizes([num_heads, num_kv_heads, num_kv_heads], dim=1)  # Tensor.split: a Python wrapper
    return q, k, v


def merge_heads(x: Tensor) -> Tensor:
    # After attention the heads axis sits before seq; bringing it back beside d_head and merging
    # the two is a view only if the data is already laid out (batch, seq, heads, d_head).
    return x.transpose(1, 2).flatten(2)


def group_queries(q: Tensor, num_kv_heads: int) -> Tensor:
    # Query head h reads KV head h // group, so consecutive query heads form a group.
    shape = q.shape  # splitting one axis in two is always a view (`unflatten` is a Python call)
    return q.view(shape[0], num_kv_heads, shape[1] // num_kv_heads, shape[2], shape[3])


def fold_queries(grouped: Tensor) -> Tensor:
    """GQA without copying K/V: the query heads of a group laid end to end along the query axis."""
    return grouped.flatten(2, 3)


def fold_one_query(q: Tensor, num_kv_heads: int) -> Tensor:
    """`fold_queries(group_queries(q, num_kv_heads))` for one query a head (decoding): one view, never a copy
    (splitting the heads axis and dropping the query axis of size 1 fit any strides)."""
    shape = q.shape
    return q.view(shape[0], num_kv_heads, shape[1] // num_kv_heads, shape[3])


def merge_one_query(out: Tensor) -> Tensor:
    """`merge_heads(unfold(out, num_heads))` for one query a head (decoding): the folded rows of a KV head are its
    group's heads in order, so the heads merge as they lie; one reshape (a copy only where SDPA laid them apart).
    Also `merge_heads(x)` of one query a head, `(batch, num_heads, 1, d_head)`: its transpose moves an axis of 1."""
    shape = out.shape  # sizes, not -1: an empty batch has no size to infer
    return out.reshape(shape[0], 1, shape[1] * shape[2] * shape[3])


def unfold(out: Tensor, num_heads: int) -> Tensor:
    shape = out.shape  # a view split then a flatten (`unflatten` is a Python call; one reshape makes export guard)
    group = num_heads // shape[1]
    return out.view(shape[0], shape[1], group, shape[2] // group, shape[3]).flatten(1, 2)


def tune_temperature(q: Tensor, start: int, floor_scale: int, attn_scale: float) -> Tensor:
    """Llama 4's temperature tuning (NoPE layers): the queries at cache index `i` (`start` + their index) times
    `1 + attn_scale * log(1 + floor((i + 1) / floor_scale))`, the factor in float32 as transformers makes it."""
    positions = torch.arange(start, start + q.shape[2], device=q.device, dtype=torch.float32)
    factor = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * factor[:, None]).to(q.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """`(x1, x2) -> (-x2, x1)` over the two halves of the last axis."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """`(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)`: each adjacent pair turned a quarter (interleaved RoPE)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotary embedding of per-head `x` `(batch, heads, seq, d_head)`; tables `(seq, d)` or `(batch, seq, d)`.

    Halves (`rotate_half`, tables `cat(angles, angles)`), or adjacent pairs where `interleaved` (tables with
    each angle twice in a row, as transformers' Cohere makes them)."""
    if cos.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]  # the same rotation for every head
    return x * cos + (rotate_pairs(x) if interleaved else rotate_half(x)) * sin


def rotate_part(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """`rotate` on the first `cos.shape[-1]` features of each head (partial rotary); the rest pass unrotated."""
    width = cos.shape[-1]
    return torch.cat((rotate(x[..., :width], cos, sin, interleaved), x[..., width:]), dim=-1)


def combine_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    q: Tensor,
    k: Tensor,
    explicit: bool,
    window: int | None = None,
    gqa: bool = False,
) -> Tensor | None:
    """`attn_mask`, `key_padding_mask`, `is_causal` and a sliding `window` as one 4-D mask.

    Bool (True = may attend) or float (added to the scores).

    None when there is nothing to mask, or when the only restriction is causality that torch's
    SDPA applies itself (`seq == kv_seq`, MHA, or GQA/MQA by torch's own kernel: `gqa`; see
    `sdpa_causal`), unless `explicit`.
    """
    seq, kv_seq = q.shape[2], k.shape[2]
    causal = is_causal and seq > 1  # a single query, lower-right aligned, sees every key
    windowed = window_matters(window, kv_seq)
    if causal and attn_mask is None and key_padding_mask is None and not explicit and not windowed:
        if sdpa_causal(q, k, gqa):
            return None
    allowed: Tensor | None = None
    if causal or windowed:
        # Lower-right alignment: query i sits at absolute position kv_seq - seq + i.
        ones = torch.ones(seq, kv_seq, dtype=torch.bool, device=q.device)
        allowed = ones.tril(kv_seq - seq) if causal else ones
        if windowed and window is not None:
            allowed = allowed & ~ones.tril(kv_seq - seq - window)  # keys window or more positions back
        allowed = allowed[None, None]
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    if attn_mask is not None:
        mask4 = attn_mask if attn_mask.ndim == 4 else attn_mask[None, None]
        if mask4.dtype == torch.bool:
            return mask4 if allowed is None else allowed & mask4
        return mask4 if allowed is None else mask4.masked_fill(~allowed, -math.inf)
    return allowed


def chunk_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, q: Tensor, k: Tensor, chunk: int) -> Tensor:
    """Llama 4's chunked attention as a mask joined to `attn_mask` (bool: and; float: -inf where hidden): a query
    sees only the keys of its own chunk of `chunk` positions (query i at position kv_seq - seq + i), the chunks
    counted from each sequence's first real key (after its left padding in `key_padding_mask`, as transformers
    counts them)."""
    seq, kv_seq = q.shape[2], k.shape[2]
    queries = torch.arange(kv_seq - seq, kv_seq, device=q.device)[:, None]
    keys = torch.arange(kv_seq, device=q.device)[None, :]
    if key_padding_mask is None:
        same = queries.div(chunk, rounding_mode="floor") == keys.div(chunk, rounding_mode="floor")
    else:
        left = ((~key_padding_mask).cumsum(-1) == 0).sum(-1)[:, None, None]  # leading padding of each sequence
        own = (queries - left).div(chunk, rounding_mode="floor") == (keys - left).div(chunk, rounding_mode="floor")
        same = own[:, None]
    if attn_mask is None:
        return same
    if attn_mask.dtype == torch.bool:
        return attn_mask & same
    return torch.where(same, attn_mask, -math.inf)


def window_matters(window: int | None, kv_seq: int) -> bool:
    """Whether a sliding window hides any key: some query is `window` or more positions after some key.

    Under compile and export the mask is always built (it is right for every size), so the graph holds for
    every `kv_seq` instead of guarding on `kv_seq > window`.
    """
    if window is None:
        return False
    if torch.compiler.is_compiling() or kv_seq > window:  # an `if`: a Python bool under compile and export
        return True
    return False


def sdpa_causal(q: Tensor, k: Tensor, gqa: bool = False) -> bool:
    """Whether torch's own `is_causal` (top-left) is our lower-right causal mask: square, and MHA (or GQA/MQA
    that torch's kernel computes itself, `gqa`; see `native_gqa`)."""
    return q.shape[2] == k.shape[2] and (gqa or q.shape[1] == k.shape[1])


def native_causal(is_causal: bool, q: Tensor, k: Tensor, gqa: bool = False) -> bool:
    """Whether SDPA's own `is_causal` applies our causal mask (see `sdpa_causal`); one query sees every key."""
    if is_causal and q.shape[2] > 1 and sdpa_causal(q, k, gqa):  # an `if`: a Python bool under compile and export
        return True
    return False


# Where torch's `scaled_dot_product_attention(..., enable_gqa=True)` computes GQA/MQA without expanding K/V:
# the device, and the first torch version on which recorded allocations showed it (the flash kernel for CPU
# allocates only the output and the log-sum-exp: prefill, a mask, autograd, one decoding query). Folded
# instead: dropout (torch's math kernel runs, and repeats K and V); one decoding query against many keys (no
# copy either way, but its group folded is a view, one query row per head of the group, measured up to 1.5x
# faster at 4096 cached positions; below NATIVE_DECODE_MAX elements of batch x num_heads x kv_seq x d_head
# torch's kernel is faster, by the fold's few extra calls: see docs/performance.md); unmeasured devices (CUDA,
# MPS), `meta` (the math kernel), older torch, compiled graphs.
# `tests/test_native_gqa.py` pins this table against the allocations of this torch.
NATIVE_GQA_SINCE: dict[str, tuple[int, int]] = {"cpu": (2, 13)}
NATIVE_DECODE_MAX = 1 << 16  # measured ties: (1, 4, 2048, 16) at 1.03, (1, 8, 128, 64) at 1.00
TORCH_RELEASE = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])  # "2.13.0+cpu": (2, 13)
NATIVE_GQA_DEVICES = frozenset(d for d, since in NATIVE_GQA_SINCE.items() if TORCH_RELEASE >= since)
_NATIVE_ON_CPU = "cpu" in NATIVE_GQA_DEVICES


def on_native_device(t: Tensor) -> bool:
    """Whether `t`'s device is one of `NATIVE_GQA_DEVICES`; `is_cpu` first (`device.type` costs 0.2 us a call)."""
    return _NATIVE_ON_CPU if t.is_cpu else t.device.type in NATIVE_GQA_DEVICES


def zeroes_empty_rows(q: Tensor, dropout_p: float) -> bool:
    """Whether torch's kernel itself gives a query with no key to attend to zeros, in outputs and gradients:
    the CPU flash kernel (the devices of `NATIVE_GQA_SINCE`, no dropout), so no row need be opened and zeroed."""
    return dropout_p == 0.0 and on_native_device(q) and not torch.compiler.is_compiling()


def native_gqa(q: Tensor, k: Tensor, dropout_p: float) -> bool:
    """Whether torch's own GQA computes this attention without copying K/V, and faster than the fold (see
    `NATIVE_GQA_SINCE`). MHA: always (there is nothing to expand)."""
    shape, key_shape = q.shape, k.shape  # (each `.shape` makes a torch.Size: read once)
    if shape[1] == key_shape[1]:
        return True
    if torch.compiler.is_compiling() or dropout_p > 0.0 or not on_native_device(q):
        return False  # (compiling asked first: a decode's rule below would guard on the cache's length)
    if shape[2] == 1:  # decoding: the folded group is a view, faster against many keys
        return native_decodes(shape[0], shape[1], key_shape[2], shape[3])
    return True


def native_decodes(batch: int, num_heads: int, kv_seq: int, d_head: int) -> bool:
    """Whether one decoding query goes to torch's own GQA kernel rather than the fold (see `NATIVE_DECODE_MAX`)."""
    return batch * num_heads * kv_seq * d_head <= NATIVE_DECODE_MAX


def may_empty_rows(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool, seq: int, kv_seq: int
) -> bool:
    """Whether some query may have no key left to attend to."""
    return (is_causal and seq > kv_seq) or key_padding_mask is not None or attn_mask is not None


def rows_with_a_key(mask: Tensor) -> Tensor:
    allowed = mask if mask.dtype == torch.bool else mask != -math.inf
    return allowed.any(-1, keepdim=True)


def open_empty_rows(mask: Tensor, rows: Tensor) -> Tensor:
    """Give a row with nothing to attend to every key: a finite softmax; the caller zeroes it after."""
    return mask | ~rows if mask.dtype == torch.bool else mask.masked_fill(~rows, 0.0)


def fold_mask(mask: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """A `(#batch, #heads, #seq, kv_seq)` mask laid out for queries folded to `(num_kv_heads, group*seq)`.

    Row `g*seq + i` of the folded axis is query `i` of the group's `g`-th head. Built with `repeat`
    and `flatten`, never `expand().reshape()`, so symbolic shapes (export) need no guards on `seq`.
    """
    group = num_heads // num_kv_heads
    if group == 1:
        return mask
    heads, seq = mask.shape[1], mask.shape[2]
    if heads == 1:
        return mask if seq == 1 else mask.repeat(1, 1, group, 1)
    return mask.unflatten(1, (num_kv_heads, group)).flatten(2, 3)


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None, dropout_p: float
) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale)


def sdpa_gqa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None, dropout_p: float
) -> Tensor:
    """Torch's own GQA: query head `h` reads KV head `h // group`, as `group_queries` lays them out."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=True
    )


def sdpa_heads(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None, dropout_p: float
) -> Tensor:
    """`sdpa` for MHA, `sdpa_gqa` for fewer KV heads."""
    attention = sdpa if q.shape[1] == k.shape[1] else sdpa_gqa
    return attention(q, k, v, mask, causal, scale, dropout_p)


def open_rows(mask: Tensor | None, may_empty: bool) -> tuple[Tensor | None, Tensor | None]:
    """The mask with rows that have no key opened (a finite softmax), and those rows (to zero after), if any."""
    if mask is None or not may_empty:
        return mask, None
    rows = rows_with_a_key(mask)
    return open_empty_rows(mask, rows), rows


def attend_native(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    may_empty: bool,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    """Attention by torch's own kernel, GQA/MQA included (`native_gqa`); empty rows are zeros."""
    mask, rows = open_rows(mask, may_empty and not zeroes_empty_rows(q, dropout_p))
    return zero_rows(sdpa_heads(q, k, v, mask, causal, scale, dropout_p), rows)


def probabilities(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    scale: float | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """`softmax(softcap(q @ k.T * scale) + bias + mask)` over the last axis; `softcap(s) = c * tanh(s / c)`
    (Gemma 2), `bias` a score bias broadcast against the scores (ALiBi's, `alibi_bias`).

    `sinks` (gpt-oss's attention sinks, one logit per query row, `(..., rows, 1)`) take part in the softmax's
    sum and are dropped after it: each row's probabilities then sum to less than 1."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        with_sinks = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        return torch.softmax(with_sinks, dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)


def folded_sinks(sinks: Tensor, num_kv_heads: int, seq: int) -> Tensor:
    """One sink logit per query head `(num_heads,)` laid out as the folded queries' rows, `(num_kv_heads,
    group * seq, 1)`: a group's heads end to end, each repeated over its `seq` positions."""
    per_group = sinks.unflatten(0, (num_kv_heads, -1))
    return per_group[..., None].expand(*per_group.shape, seq).flatten(1, 2)[..., None]


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's slopes, one per head, float64: `2 ** (-8 * h / n)` for heads `h = 1..n` where `n = num_heads` is a
    power of two (Press et al.); otherwise those of the largest power of two `n` below, then every other slope of
    `2 * n` heads (`2 ** (-4 * h / n)`, `h = 1, 3, 5, ...`) for the rest, as Bloom's `build_alibi_tensor` does."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * h / closest) for h in range(1, closest + 1)]
    slopes += [2.0 ** (-4.0 * h / closest) for h in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(slopes: Tensor, num_kv_heads: int, seq: int, kv_seq: int) -> Tensor:
    """ALiBi's score bias laid out as the folded queries' rows, `(num_kv_heads, group * seq, kv_seq)`: query head
    `h`'s row for query `i` is `slopes[h] * (j - (kv_seq - seq + i))` for key `j`, the query at its lower-right
    aligned position (as `is_causal` places it), so a key `d` positions back is biased by `-d * slopes[h]`."""
    keys = torch.arange(kv_seq, device=slopes.device)
    queries = torch.arange(seq, device=slopes.device) + (kv_seq - seq)
    per_group = slopes.unflatten(0, (num_kv_heads, -1))
    # a row's slope and its distances, each laid out as the folded rows by expand/repeat and flatten (as
    # `folded_sinks`, `fold_mask`), so that export's symbolic shapes need no guard on seq
    per_row = per_group[..., None].expand(*per_group.shape, seq).flatten(1, 2)
    distance = (keys - queries[:, None]).to(slopes.dtype).repeat(per_group.shape[1], 1)
    return per_row[..., None] * distance


# Differential attention's four learned vectors, under DiffLlama's names: lambda = exp(q1 . k1) - exp(q2 . k2) + init.
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
LAMBDA_STD = 0.1  # their initialisation's spread (the paper's, DiffLlama's lambda_std_dev)


def differential_values(v: Tensor) -> tuple[Tensor, Tensor]:
    """Differential attention's values, each `(batch, num_kv_heads, kv_seq, d_head)`: those of the first half of
    the KV heads and those of the second, each repeated to fill every KV head (`j` and `j + num_kv_heads/2` read
    the same), so that every query head attends to both halves, `[v_j; v_{j + num_kv_heads/2}]` side by side."""
    first, second = v.chunk(2, dim=1)
    return first.repeat(1, 2, 1, 1), second.repeat(1, 2, 1, 1)


def differential_lambda(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, lambda_init: float, dtype: torch.dtype
) -> Tensor:
    """`exp(q1 . k1) - exp(q2 . k2) + lambda_init` in `dtype`, each exponential of a dot product computed in float32
    as DiffLlama computes it (the same number in every dtype: bfloat16 weights do not round lambda further)."""
    first = torch.exp(torch.sum(q1 * k1, dim=-1, dtype=torch.float32)).to(dtype)
    second = torch.exp(torch.sum(q2 * k2, dim=-1, dtype=torch.float32)).to(dtype)
    return first - second + lambda_init


def differential_heads(first: Tensor, second: Tensor, lam: Tensor, lambda_init: float, eps: float) -> Tensor:
    """Differential attention's heads from each head's output over the first half of the values (`first`) and over
    the second (`second`): head `p`'s and head `p + num_heads/2`'s, `2 * d_head` wide each, subtracted
    (`p`'s minus `lam` times the other's), RMS-normalised over those features and scaled by `1 - lambda_init`; the
    pair's `2 * d_head` features laid out as heads `2p` and `2p + 1`, so that merging the heads puts them side by
    side, pair after pair."""
    both = torch.cat((first, second), dim=-1)
    mine, paired = both.chunk(2, dim=1)
    out = F.rms_norm(mine - lam * paired, (both.shape[-1],), eps=eps) * (1 - lambda_init)
    return out.unflatten(-1, (2, -1)).transpose(2, 3).flatten(1, 2)


def zero_rows(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x.masked_fill(~rows, 0.0)


def fold_mask_rows(mask: Tensor, may_empty: bool, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor | None]:
    """The mask laid out for folded queries, rows with no key opened; and those rows (to zero after), if any."""
    rows = None
    if may_empty:
        rows = rows_with_a_key(mask)
        mask = open_empty_rows(mask, rows)
    return fold_mask(mask, num_heads, num_kv_heads), rows


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    native_causal: bool,
    may_empty: bool,
    scale: float | None,
    dropout_p: float,
    softcap: float | None = None,
) -> Tensor:
    """Attention for MHA/GQA/MQA with our conventions (lower-right causal, empty rows are zeros)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if mask is None and num_heads == num_kv_heads and softcap is None:
        return sdpa(q, k, v, None, native_causal, scale, dropout_p)
    may_empty = may_empty and (softcap is not None or not zeroes_empty_rows(q, dropout_p))  # SDPA's own zeros
    folded_mask, rows = (None, None) if mask is None else fold_mask_rows(mask, may_empty, num_heads, num_kv_heads)
    folded = fold_queries(group_queries(q, num_kv_heads))
    if softcap is None:
        out = sdpa(folded, k, v, folded_mask, False, scale, dropout_p)
    else:  # SDPA has no softcap: the scores are computed here
        out = weighted_values(probabilities(folded, k, folded_mask, scale, softcap), v, dropout_p)
    return zero_rows(unfold(out, num_heads), rows)


def head_weights(
    q: Tensor, k: Tensor, mask: Tensor | None, may_empty: bool, scale: float | None, softcap: float | None = None
) -> Tensor:
    """Per-head probabilities `(batch, num_heads, seq, kv_seq)`; rows with nothing to attend to are zeros."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    folded_mask, rows = (None, None) if mask is None else fold_mask_rows(mask, may_empty, num_heads, num_kv_heads)
    folded = fold_queries(group_queries(q, num_kv_heads))
    return zero_rows(unfold(probabilities(folded, k, folded_mask, scale, softcap), num_heads), rows)


def deinterleave(x: Tensor) -> Tensor:
    """Features `(x0, x1, x2, x3, ...)` laid out as `(x0, x2, ..., x1, x3, ...)`: pairs `(2i, 2i+1)` become
    `(i, i + d/2)`, the pairing `rotate_half` turns (DeepSeek's interleaved RoPE, as transformers computes it)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def weighted_values(probabilities: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    """`probabilities @ v` with queries folded as the values are laid out (dropout on the probabilities)."""
    if dropout_p > 0.0:
        probabilities = F.dropout(probabilities, dropout_p)
    return torch.matmul(probabilities, v)
