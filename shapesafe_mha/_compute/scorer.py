"""The scorer: which kernel computes `softmax(q @ k.T * scale + mask) @ v` for these heads, and how.

One function for the module's forward and the public `scaled_dot_product_attention` (x-transformers' `Attend`):
torch's SDPA as it is (MHA, nothing to mask but its own causality), torch's own GQA kernel where it copies
nothing, or the query heads of each KV head folded into its query axis, with the scores computed here when
SDPA cannot (softcap, sinks, ALiBi, the probabilities asked for). `s` holds the stages it runs: checked ones
(a session's) or their plain functions.
"""

from typing import Any

from torch import Tensor

from . import kernels as K


def score(
    s: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    window: int | None,
    scale: float | None,
    dropout_p: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    slopes: Tensor | None = None,
    need_weights: bool = False,
    merge: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """`(heads, weights, merged)`: the attended heads `(batch, num_heads, seq, d_head)`, or with `merge` and one
    query a head, those heads merged at once, `(batch, seq, num_heads * d_head)` (a view of the fold); the
    per-head probabilities when `need_weights`.

    Rows with nothing to attend to are zeros; `is_causal` and `window` are lower-right aligned.
    """
    explicit = need_weights or softcap is not None or sinks is not None or slopes is not None
    native = not explicit and K.native_gqa(q, k, dropout_p)  # torch's own kernel, where it copies nothing
    mask = s.combine_masks(q, k, attn_mask, key_padding_mask, is_causal, explicit, window, native)
    shape, key_shape = q.shape, k.shape  # (each `.shape` makes a torch.Size: read once, this runs on every call)
    if mask is None and not explicit and shape[1] == key_shape[1]:
        return s.attend_heads(q, k, v, K.native_causal(is_causal, q, k), dropout_p, scale), None, None
    if native:
        if mask is None:
            causal = K.native_causal(is_causal, q, k, gqa=True)
            return s.attend_native(q, k, v, None, causal, False, dropout_p, scale), None, None
        may_empty = K.may_empty_rows(attn_mask, key_padding_mask, is_causal, shape[2], key_shape[2])
        return s.attend_native(q, k, v, mask, False, may_empty, dropout_p, scale), None, None
    num_heads, num_kv_heads = shape[1], key_shape[1]
    seq, kv_seq = shape[2], key_shape[2]
    single = seq == 1  # decoding: the fold and the merge are one view or reshape each
    folded = s.fold_one_query(q, num_kv_heads) if single else s.fold_queries(s.group_queries(q, num_kv_heads))
    folded_mask, rows = None, None
    if mask is not None:
        may_empty = K.may_empty_rows(attn_mask, key_padding_mask, is_causal, seq, kv_seq)
        may_empty = may_empty and (explicit or not K.zeroes_empty_rows(q, dropout_p))  # SDPA's own zeros
        folded_mask, rows = s.fold_mask(mask, may_empty, num_heads, num_kv_heads)
    if explicit:
        bias = None if slopes is None else s.alibi_bias(slopes, q, k)
        folded_weights = s.folded_weights(folded, k, folded_mask, scale, softcap, sinks, bias)
        weights = s.unfold_weights(folded_weights, num_heads, rows) if need_weights else None
        return s.unfold(s.weigh_values(folded_weights, v, dropout_p), num_heads, rows), weights, None
    out = s.attend_folded(folded, k, v, folded_mask, dropout_p, scale)
    if merge and single and rows is None:
        return None, None, s.merge_one_query(out)
    return s.unfold(out, num_heads, rows), None, None
