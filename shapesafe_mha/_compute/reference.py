"""The naive per-head reference: written for reading, the oracle of every property test.

No fused projection, no reshapes, no folding: for each head, slice that head's rows out of the
weights, project, score, mask, softmax, weight the values; then concatenate and project out.
"""

import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal, TypeVar, cast

import torch
from torch import Tensor

from .._core.weights import AttentionWeights

if TYPE_CHECKING:  # (the reference reads a config's fields; it builds none)
    from .._modules.config import AttentionConfig


def _rows(weight: Tensor, bias: Tensor | None, head: int, d_head: int) -> tuple[Tensor, Tensor | None]:
    """The slice of a projection that produces one head."""
    rows = slice(head * d_head, (head + 1) * d_head)
    return weight[rows], None if bias is None else bias[rows]


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = x @ weight.T
    return out if bias is None else out + bias


def _softmax_or_zeros(scores: Tensor) -> Tensor:
    """Softmax over the last axis; a row whose scores are all -inf becomes zeros."""
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    exp = torch.exp(scores - top)
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total == 0, torch.ones_like(total), total)


T = TypeVar("T")
KVHeads = Literal["grouped", "interleaved"]
RopeStyle = Literal["half", "interleaved"]
NormOver = Literal["head", "all", "per_head"]
# (inv_freq, attention_factor) of scaled RoPE; inv_freq `(d_rope/2,)`, or `(#batch, seq, d_rope/2)`: each position's own
RopeFrequencies = tuple[Tensor, float] | None
NormKind = Literal["rms", "layer", "centred"]  # "centred": a LayerNorm without bias (Cohere)
# FlexAttention's signatures (torch.nn.attention.flex_attention): `score_mod(score, b, h, q_idx, kv_idx)`
# returns the modified score; `mask_mod(b, h, q_idx, kv_idx)` returns True where the query may attend.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _indices(batch: int, head: int, seq: int, kv_seq: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`b (batch, 1, 1)`, `h ()`, `q_idx (1, seq, 1)`, `kv_idx (1, 1, kv_seq)`: int32, as FlexAttention passes them,
    laid out to broadcast against one head's `(batch, seq, kv_seq)` scores."""

    def arange(n: int) -> Tensor:
        return torch.arange(n, dtype=torch.int32, device=like.device)

    h = torch.tensor(head, dtype=torch.int32, device=like.device)
    return arange(batch)[:, None, None], h, arange(seq)[None, :, None], arange(kv_seq)[None, None, :]


def _score_mod(scores: Tensor, score_mod: ScoreMod | None, head: int) -> Tensor:
    """One head's scores with `score_mod` applied elementwise (h is the query head)."""
    if score_mod is None:
        return scores
    batch, seq, kv_seq = scores.shape
    return score_mod(scores, *_indices(batch, head, seq, kv_seq, scores)).expand_as(scores)


def _rotate_pairs(
    x: Tensor, positions: Tensor, theta: float, style: RopeStyle = "half", frequencies: RopeFrequencies = None
) -> Tensor:
    """One head's features, each pair turned by the angle `position * theta**(-2i/d_head)`.

    With `frequencies=(inv_freq, factor)` (scaled RoPE), pair `i` turns by `position * inv_freq[i]` instead,
    and cos and sin are multiplied by `factor` (YaRN's attention factor) before the cast; an `inv_freq` of
    `(#batch, seq, d_rope/2)` gives each position its own frequencies (RoPE scaled by the length of the call that
    rotated it).

    Pair `i` is features `(i, i + d_head/2)` in the "half" style (Llama, Mistral, Qwen: rotate_half),
    features `(2i, 2i+1)` in the "interleaved" style (GPT-J, the RoFormer paper).
    """
    half = x.shape[-1] // 2
    exponents = torch.arange(half, dtype=torch.float32) * 2 / x.shape[-1]
    frequency, factor = (1.0 / theta**exponents, 1.0) if frequencies is None else frequencies
    angle = positions.to(torch.float32)[..., None] * frequency.to(torch.float32)
    cos, sin = (angle.cos() * factor).to(x.dtype), (angle.sin() * factor).to(x.dtype)
    if style == "interleaved":
        first, second = x[..., 0::2], x[..., 1::2]
        turned = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return turned.flatten(-2)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rotate_part(
    x: Tensor,
    positions: Tensor,
    theta: float,
    style: RopeStyle,
    rotary_dim: int | None,
    frequencies: RopeFrequencies = None,
) -> Tensor:
    """RoPE on the first `rotary_dim` features of one head (all of them where None); the rest pass unrotated."""
    if rotary_dim is None or rotary_dim == x.shape[-1]:
        return _rotate_pairs(x, positions, theta, style, frequencies)
    turned = _rotate_pairs(x[..., :rotary_dim], positions, theta, style, frequencies)
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`x / sqrt(mean(x**2) + eps) * weight` over each row's features."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """`(x - mean(x)) / sqrt(var(x) + eps) * weight + bias` over each row's features."""
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred / torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps) * weight + bias


def _softcap(scores: Tensor, cap: float | None) -> Tensor:
    return scores if cap is None else cap * torch.tanh(scores / cap)


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's slopes (Press et al.), float64: for `n` heads a power of two, head `h = 1..n` gets `2 ** (-8 h / n)`;
    otherwise the largest power of two `n` below gives its `n` slopes, and the rest are every other slope of `2n`
    heads, `2 ** (-4 h / n)` for `h = 1, 3, 5, ...` (as Bloom's and MPT's models build them).

    Example:
        >>> from shapesafe_mha.reference import alibi_slopes
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    power = 2 ** int(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * h / power) for h in range(1, power + 1)]
    extra = [2.0 ** (-4.0 * h / power) for h in range(1, 2 * power + 1, 2)]
    return torch.tensor(slopes + extra[: num_heads - power], dtype=torch.float64)


_press_slopes = alibi_slopes  # (per_head_attention's keyword of that name hides it there)


def _head_mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    head: int,
    batch: int,
    seq: int,
    kv_seq: int,
    like: Tensor,
    window: int | None = None,
    mask_mod: MaskMod | None = None,
    chunk: int | None = None,
) -> Tensor:
    """An additive `(batch, seq, kv_seq)` mask for one head: 0 where allowed, -inf where not."""
    additive = torch.zeros(batch, seq, kv_seq, dtype=like.dtype, device=like.device)
    blocked = torch.zeros(batch, seq, kv_seq, dtype=torch.bool, device=like.device)
    for i in range(seq):
        position = kv_seq - seq + i  # lower-right alignment; negative: sees no key at all
        if is_causal:
            blocked[:, i, max(position + 1, 0) :] = True  # every key after its own position
        if window is not None:
            blocked[:, i, : max(position - window + 1, 0)] = True  # every key window or more positions back
    if chunk is not None:  # Llama 4: only the keys of the query's own chunk, counted from the first real key
        for b in range(batch):
            start = 0
            while key_padding_mask is not None and start < kv_seq and bool(key_padding_mask[b, start]):
                start += 1
            for i in range(seq):
                first = start + (kv_seq - seq + i - start) // chunk * chunk  # the query's chunk begins here
                blocked[b, i, : max(first, 0)] = True
                blocked[b, i, max(first + chunk, 0) :] = True
    if key_padding_mask is not None:
        blocked |= key_padding_mask[:, None, :]
    if mask_mod is not None:
        blocked |= ~mask_mod(*_indices(batch, head, seq, kv_seq, like)).to(torch.bool).expand(batch, seq, kv_seq)
    if attn_mask is not None:
        mask = attn_mask
        if mask.ndim == 4:
            mask = mask[:, head if mask.shape[1] > 1 else 0]
        mask = mask.expand(batch, seq, kv_seq)
        if mask.dtype == torch.bool:
            blocked |= ~mask
        else:
            additive = additive + mask
    return additive.masked_fill(blocked, -math.inf)


def _differential_pairs(
    maps: list[Tensor], values: list[Tensor], differential: tuple[Tensor, Tensor, Tensor, Tensor, float], eps: float
) -> list[Tensor]:
    """Differential attention's outputs, one per pair of heads `p` and `p + num_heads/2`, each `2 * d_head` wide."""
    q1, k1, q2, k2, lambda_init = differential
    # each exponential in float32, as DiffLlama computes it (the float64 comparison needs the same rounding)
    first, second = torch.exp((q1 * k1).sum(dtype=torch.float32)), torch.exp((q2 * k2).sum(dtype=torch.float32))
    lam = first.to(maps[0].dtype) - second.to(maps[0].dtype) + lambda_init
    half = len(maps) // 2
    pairs = []
    for p in range(half):
        both = torch.cat((values[p], values[p + half]), dim=-1)  # the values the pair's two heads read
        out = (maps[p] - lam * maps[p + half]) @ both
        pairs.append((1 - lambda_init) * _rms_norm(out, torch.ones_like(out[0, 0]), eps))
    return pairs


def per_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    weights: AttentionWeights,
    config: "AttentionConfig | None" = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    rope_theta: float | None = None,
    positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    rope_style: RopeStyle = "half",
    rotary_dim: int | None = None,
    rope_frequencies: RopeFrequencies = None,
    key_rope_frequencies: RopeFrequencies = None,
    kv_heads: KVHeads = "grouped",
    qk_norm: tuple[Tensor, Tensor] | None = None,
    norm_eps: float = 1e-6,
    qk_norm_over: NormOver = "head",
    qk_norm_after_rope: bool = False,
    qk_norm_bias: tuple[Tensor, Tensor] | None = None,
    qk_norm_centred: bool = False,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    clip_qkv: float | None = None,
    temperature_tuning: tuple[int, float] | None = None,
    chunk_size: int | None = None,
    output_gate: tuple[Tensor, Tensor | None] | None = None,
    differential: tuple[Tensor, Tensor, Tensor, Tensor, float] | None = None,
    out_norm: tuple[Tensor, float] | None = None,
    window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
) -> Tensor:
    """Multi-head attention computed one head at a time from explicit per-head weight slices.

    For head `h` with KV head `g = h // (num_heads // num_kv_heads)` (or `h % num_kv_heads` with
    `kv_heads="interleaved"`):
    `head_h = softmax(softcap(score_mod((x W_Q[h]) (k W_K[g])^T * scale)) + alibi_h + mask) (v W_V[g])`, then
    `out = concat(head_0, ..., head_{H-1}) W_O^T + b_O`. Masks follow `MultiHeadAttention`:
    bool `attn_mask` True = may attend, float added; `key_padding_mask` True = padding;
    `is_causal` lower-right aligned; `mask_mod` True = may attend; a key must be allowed by every
    mask given, and a row with nothing to attend to is zeros.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha.reference import per_head_attention
        >>> m = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
        >>> x = torch.randn(2, 5, 16)
        >>> ref = per_head_attention(x, x, x, m.weights(), num_heads=4, num_kv_heads=2)
        >>> bool(torch.allclose(ref, m(x), atol=1e-5))
        True
        >>> w = ssm.MultiHeadAttention(16, 4, 2, rope_theta=10000.0, window=3, alibi=True)
        >>> ref = per_head_attention(x, x, x, w.weights(), w.config, is_causal=True)
        >>> bool(torch.allclose(ref, w(x, is_causal=True), atol=1e-5))
        True

    Arguments:
        query: `(batch, seq, d_model)`.
        key, value: `(batch, kv_seq, d_model)`.
        weights: the layer's weights in `nn.Linear` layout.
        config: the layer's description (`module.config`): the sizes and every option it describes are read from
            it (the head counts, RoPE's theta, part and pairs, the QK-norm's kind and epsilon, the window, the
            softcap, the scale, clip_qkv, temperature tuning, the chunks), each keyword below that names one of
            them then refused (a `TypeError`; `scale`, where given, replaces the config's); its options that hold
            tensors take them from the keywords below (`qk_norm`: the module's norm weights, to which the
            reference adds `qk_norm_offset`; `sinks`; `alibi_slopes`; `output_gate`; `differential`), and where
            one is not passed, the value a module starts with (weights of ones, zero sinks, Press's slopes); the
            gate's rows and the lambdas, which start random, must be passed. Its other fields (biases, dropout,
            scaled RoPE: pass `rope_frequencies`) are not read. Default: the keywords describe the layer.
        num_heads, num_kv_heads: the head counts (`num_kv_heads` divides `num_heads`); without `config`, needed.
        attn_mask, is_causal, key_padding_mask: as in `MultiHeadAttention.forward`.
        rope_theta: rotate each head's queries and keys (default RoPE with this base); angles in
            float32, as transformers computes them.
        positions: `(batch, seq)` positions of the queries; default `0..seq-1`.
        key_positions: `(batch, kv_seq)` positions of the keys; default the queries' positions when
            `kv_seq == seq`, else `0..kv_seq-1`.
        rope_style: "half" pairs feature `i` with `i + d_head/2` (Llama's rotate_half),
            "interleaved" pairs `2i` with `2i+1` (GPT-J).
        rotary_dim: rotate only each head's first `rotary_dim` features (partial rotary: Phi,
            StableLM, GPT-NeoX), pairing them within that part; default all `d_head`.
        rope_frequencies: `(inv_freq, attention_factor)` of scaled RoPE (llama3, YaRN, dynamic, LongRoPE; transformers'
            `ROPE_INIT_FUNCTIONS` return them): pair `i` turns by `position * inv_freq[i]`, and cos and sin
            are multiplied by `attention_factor`; default `theta`'s frequencies, factor 1. `inv_freq` may be
            `(#batch, seq, d_rope/2)`, each query position's own: RoPE scaled by length ("dynamic",
            "longrope") turns each call by the frequencies of its length, `max(positions) + 1`.
        key_rope_frequencies: the keys' `(inv_freq, attention_factor)`, `inv_freq` `(d_rope/2,)` or
            `(#batch, kv_seq, d_rope/2)`; default `rope_frequencies`. Decoding with RoPE scaled by length keeps
            each cached key as the call that wrote it turned it: its frequencies, not the query's.
        kv_heads: which KV head query head `h` reads: "grouped" `h // group` (transformers'
            repeat_kv, torch's enable_gqa), "interleaved" `h % num_kv_heads` (x-transformers).
        qk_norm: `(q_weight, k_weight)`, each `(d_head,)`: RMS-normalise every head's query and
            key with these weights (and `norm_eps`) before RoPE.
        qk_norm_over: "head" normalises each head's `d_head` features (Qwen3); "all" normalises
            every head's features together (OLMo-2: weights `(num_heads * d_head,)` and
            `(num_kv_heads * d_head,)`), each head then taking its slice; "per_head" normalises each head's
            features with that head's row of the weights (Cohere: `(num_heads, d_head)` and
            `(num_kv_heads, d_head)`).
        qk_norm_after_rope: normalise after RoPE instead of before (HunYuan).
        qk_norm_bias: `(q_bias, k_bias)`, each `(d_head,)`: the QK-norm is a LayerNorm of each head
            (`(x - mean) / sqrt(var + eps) * weight + bias`, Persimmon) instead of an RMSNorm.
        qk_norm_centred: the per-head QK-norm is a LayerNorm without bias (Cohere): each head's mean
            subtracted first.
        out_norm: `(weight, eps)`: RMS-normalise the merged heads before `W_O` (BitNet's attn_sub_norm).
        sinks: `(num_heads,)`: attention sinks (gpt-oss's `s_aux`), one extra logit per head that takes
            part in the softmax and is dropped after it, so the weights of the keys sum to less than 1.
        alibi_slopes: `(num_heads,)`: ALiBi (Bloom, MPT): head `h`'s score of query `i` for key `j` gets
            `alibi_slopes[h] * (j - (kv_seq - seq + i))`, the query at its lower-right aligned position, after the
            softcap.
        window: a query sees only keys fewer than `window` positions before it (lower-right aligned).
        logit_softcap: scores become `c * tanh(scores / c)` before the mask.
        output_gate: `(w_gate (num_heads * d_head, d_model), b_gate or None)`: each head's output times
            `sigmoid(x W_gate[h] + b_gate[h])` before the output projection (Qwen3-Next).
        differential: `(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init)`, differential attention
            (DiffLlama): head `p` and head `p + num_heads/2` make a pair, whose values are the two heads' values side
            by side; its output is `(1 - lambda_init) * rms_norm((A_p - lambda * A_{p + num_heads/2}) [v_p; v_p'])`
            (`norm_eps`, no weight), `2 * d_head` wide, each `A` a head's probabilities, and
            `lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init`.
        chunk_size: a query sees only the keys of its own chunk of `chunk_size` positions (Llama 4), counted
            from each sequence's first key that `key_padding_mask` does not hide.
        temperature_tuning: `(floor_scale, attn_scale)`: the query at index `i` times
            `1 + attn_scale * log(1 + floor((i + 1) / floor_scale))` after RoPE and QK-norm (Llama 4's NoPE layers).
        clip_qkv: each projected query, key and value feature clamped to `[-clip_qkv, clip_qkv]` (OLMo),
            after a QK-norm over every head (OLMoE) and before a per-head one.
        scale: the score scale; default the config's `score_scale`, else `1/sqrt(d_head)`.
        score_mod: FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)`, applied to each head's
            scaled scores (before the softcap and the masks); `h` is the *query* head. It is called
            once per head on int32 index tensors laid out to broadcast against that head's scores
            (`b (batch, 1, 1)`, `h` 0-D, `q_idx (1, seq, 1)`, `kv_idx (1, 1, kv_seq)`), so the
            elementwise tensor code FlexAttention takes works as written.
        mask_mod: FlexAttention's `mask_mod(b, h, q_idx, kv_idx)`, True = may attend, combined with
            the other masks; called as `score_mod` is.

    Returns:
        `(batch, seq, d_model)`.
    """
    if config is not None:  # the options the config describes, read from it; the tensors from the arguments
        _refuse_both(config, {name: value for name, value in locals().items() if name in DESCRIBED})
        num_heads, num_kv_heads, rope_theta = config.num_heads, config.kv_heads, config.rope_theta
        rotary_dim, rope_style = config.rope_dim, "interleaved" if config.rope_interleaved else "half"
        norm_eps, qk_norm_over = config.norm_eps, cast(NormOver, config.qk_norm_over)
        qk_norm_centred, qk_norm_after_rope = config.qk_norm_centred, config.qk_norm_after_rope
        window, logit_softcap = config.window, config.logit_softcap
        scale = config.score_scale if scale is None else scale
        clip_qkv, temperature_tuning, chunk_size = config.clip_qkv, config.temperature_tuning, config.chunk_size
        qk_norm = _norm_weights(config, qk_norm, query) if config.qk_norm else None
        qk_norm_bias = qk_norm_bias if config.qk_norm else None
        sinks = None if not config.attention_sinks else query.new_zeros(num_heads) if sinks is None else sinks
        alibi_slopes = None if not config.alibi else _press_slopes(num_heads) if alibi_slopes is None else alibi_slopes
        output_gate = _given(output_gate, "output_gate", "module.gate_weights()") if config.output_gate else None
        lambda_init = config.differential_lambda_init
        if lambda_init is not None:
            lambdas = _given(differential, "differential", "(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init)")
            differential = (*lambdas[:4], lambda_init)
        else:
            differential = None
    if num_heads is None or num_kv_heads is None:
        raise TypeError("per_head_attention() needs config= (an AttentionConfig), or num_heads= and num_kv_heads=.")
    d_head = weights.check(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    batch, seq, _ = query.shape
    kv_seq = key.shape[1]
    where = torch.arange(seq).expand(batch, seq) if positions is None else positions
    if key_positions is None:
        key_positions = where if kv_seq == seq else torch.arange(kv_seq).expand(batch, kv_seq)
    heads, maps, values = [], [], []
    for head in range(num_heads):
        kv_head = head % num_kv_heads if kv_heads == "interleaved" else head // group
        q = _linear(query, *_rows(weights.w_q, weights.b_q, head, d_head))
        k = _linear(key, *_rows(weights.w_k, weights.b_k, kv_head, d_head))
        if qk_norm is not None and qk_norm_over == "all":  # the statistic of every head's features together
            every_q = _rms_norm(_linear(query, weights.w_q, weights.b_q), qk_norm[0], norm_eps)
            every_k = _rms_norm(_linear(key, weights.w_k, weights.b_k), qk_norm[1], norm_eps)
            q = every_q[..., head * d_head : (head + 1) * d_head]
            k = every_k[..., kv_head * d_head : (kv_head + 1) * d_head]
        if clip_qkv is not None:  # OLMo: each projected feature clamped (after OLMoE's norm over every head)
            q, k = q.clamp(-clip_qkv, clip_qkv), k.clamp(-clip_qkv, clip_qkv)
        per_head = None if qk_norm_over == "all" else qk_norm
        if per_head is not None and qk_norm_over == "per_head":  # Cohere: each head its own row of weights
            per_head = (qk_norm[0][head], qk_norm[1][kv_head]) if qk_norm is not None else None
        if per_head is not None and qk_norm_centred and qk_norm_bias is None:  # LayerNorm without bias (Cohere)
            zeros = torch.zeros_like(per_head[0])
            q, k = _layer_norm(q, per_head[0], zeros, norm_eps), _layer_norm(k, per_head[1], zeros, norm_eps)
        elif per_head is not None and qk_norm_bias is not None:  # LayerNorm of each head (Persimmon)
            q = _layer_norm(q, per_head[0], qk_norm_bias[0], norm_eps)
            k = _layer_norm(k, per_head[1], qk_norm_bias[1], norm_eps)
        elif per_head is not None and not qk_norm_after_rope:
            q, k = _rms_norm(q, per_head[0], norm_eps), _rms_norm(k, per_head[1], norm_eps)
        if rope_theta is not None:
            q = _rotate_part(q, where, rope_theta, rope_style, rotary_dim, rope_frequencies)
            key_frequencies = rope_frequencies if key_rope_frequencies is None else key_rope_frequencies
            k = _rotate_part(k, key_positions, rope_theta, rope_style, rotary_dim, key_frequencies)
        if qk_norm is not None and qk_norm_after_rope:
            q, k = _rms_norm(q, qk_norm[0], norm_eps), _rms_norm(k, qk_norm[1], norm_eps)
        if temperature_tuning is not None:  # Llama 4's NoPE layers: each query sharpened by its index
            floor_scale, attn_scale = temperature_tuning
            index = torch.arange(1, seq + 1, dtype=torch.float32, device=q.device)
            # in float32 as transformers makes it (log1p: the float64 comparison needs the same rounding)
            factor = 1.0 + attn_scale * torch.log1p(torch.div(index, floor_scale, rounding_mode="floor"))
            q = (q * factor[:, None]).to(q.dtype)
        v = _linear(value, *_rows(weights.w_v, weights.b_v, kv_head, d_head))
        if clip_qkv is not None:
            v = v.clamp(-clip_qkv, clip_qkv)
        scaled = q @ k.transpose(-1, -2) * (1 / math.sqrt(d_head) if scale is None else scale)
        scores = _softcap(_score_mod(scaled, score_mod, head), logit_softcap)
        if alibi_slopes is not None:  # key j's distance from query i at its position kv_seq - seq + i, times the slope
            distance = torch.arange(kv_seq)[None, :] - (kv_seq - seq + torch.arange(seq))[:, None]
            scores = scores + alibi_slopes[head].to(scores) * distance.to(scores)
        scores = scores + _head_mask(
            attn_mask, key_padding_mask, is_causal, head, batch, seq, kv_seq, scores, window, mask_mod, chunk_size
        )
        if sinks is not None:  # one more logit per head, in the softmax's sum and dropped after it
            sink = sinks[head].to(scores.dtype).expand(*scores.shape[:-1], 1)
            probabilities = _softmax_or_zeros(torch.cat((scores, sink), dim=-1))[..., :-1]
        else:
            probabilities = _softmax_or_zeros(scores)
        out = probabilities @ v
        if output_gate is not None:  # Qwen3-Next: the head's output gated by its own projection of the query
            out = out * torch.sigmoid(_linear(query, *_rows(output_gate[0], output_gate[1], head, d_head)))
        heads.append(out)
        maps.append(probabilities)
        values.append(v)
    if differential is not None:
        heads = _differential_pairs(maps, values, differential, norm_eps)
    merged = torch.cat(heads, dim=-1)
    if out_norm is not None:  # BitNet: the merged heads RMS-normalised before the output projection
        merged = _rms_norm(merged, *out_norm)
    return _linear(merged, weights.w_o, weights.b_o)


# The keywords whose option an `AttentionConfig` describes: with `config=` they are read from it.
DESCRIBED = (
    "num_heads", "num_kv_heads", "rope_theta", "rope_style", "rotary_dim", "norm_eps", "qk_norm_over",
    "qk_norm_after_rope", "qk_norm_centred", "clip_qkv", "temperature_tuning", "chunk_size", "window",
    "logit_softcap",
)  # fmt: skip


def _refuse_both(config: "AttentionConfig", given: dict[str, object]) -> None:
    """`TypeError` naming the keywords given beside `config` that it describes (each keyword at its default is not
    given)."""
    defaults = inspect.signature(per_head_attention).parameters
    both = [name for name in DESCRIBED if given[name] != defaults[name].default]
    if both:
        raise TypeError(
            f"per_head_attention(): {', '.join(both)} given with config=, which describes them; pass them in the "
            f"config (dataclasses.replace(config, ...)) or drop config=."
        )


def _given(value: T | None, name: str, example: str) -> T:
    """`value`, or a `TypeError` naming the keyword (`name`) that the config's option needs."""
    if value is None:
        raise TypeError(f"per_head_attention(): the config's {name} needs its tensors: pass {name}={example}.")
    return value


def _norm_weights(
    config: "AttentionConfig", given: tuple[Tensor, Tensor] | None, like: Tensor
) -> tuple[Tensor, Tensor]:
    """The QK-norm's scales of a config: `qk_norm_offset + weight` of the weights given (the module's `q_norm` and
    `k_norm` weights), or of the ones a module starts with."""
    if given is None:
        width, kv_width = config.num_heads * config.head_width, config.kv_heads * config.head_width
        shapes = {"head": ((config.head_width,),) * 2, "all": ((width,), (kv_width,))}
        per_head = ((config.num_heads, config.head_width), (config.kv_heads, config.head_width))
        q_shape, k_shape = shapes.get(config.qk_norm_over, per_head)
        given = (like.new_ones(q_shape), like.new_ones(k_shape))
    return given[0] + config.qk_norm_offset, given[1] + config.qk_norm_offset


def per_head_latent_attention(
    query: Tensor,
    parameters: Mapping[str, Tensor],
    *,
    num_heads: int,
    kv_lora_rank: int,
    d_nope: int,
    d_rope: int,
    d_value: int,
    rope_theta: float = 10000.0,
    interleaved: bool = False,
    norm_eps: float = 1e-6,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3) one head at a time, from explicit weight slices.

    For head `h`: `q_h = norm(x W_qa) W_qb[h]` (or `x W_q[h]`), split into `(q_nope, q_rope)`;
    `latent, k_rope = norm(x W_kva[:r]), x W_kva[r:]`; `k_nope_h = latent W_kvb[h, :d_nope]`,
    `v_h = latent W_kvb[h, d_nope:]`; `head_h = softmax((q_nope k_nope_h^T + rope(q_rope) rope(k_rope)^T)
    / sqrt(d_nope + d_rope) + mask) v_h`; `out = concat(heads) W_O^T + b_O`.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha.reference import per_head_latent_attention
        >>> mla = ssm.LatentAttention(32, 4, q_lora_rank=8, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=6)
        >>> x = torch.randn(2, 5, 32)
        >>> ref = per_head_latent_attention(x, mla.state_dict(), num_heads=4, kv_lora_rank=8, d_nope=4, d_rope=4,
        ...                                 d_value=6, is_causal=True)
        >>> bool(torch.allclose(ref, mla(x, is_causal=True), atol=1e-5))
        True

    Arguments:
        query: `(batch, seq, d_model)` (self-attention).
        parameters: the layer's weights by transformers' `DeepseekV3Attention` names (`q_proj` or
            `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
            `kv_b_proj`, `o_proj`; `.weight`, `.bias`), as in a state dict.
        num_heads, kv_lora_rank, d_nope, d_rope, d_value: the sizes.
        rope_theta, interleaved: the rotary embedding; `interleaved` pairs features `(2i, 2i+1)`.
        norm_eps: of the RMSNorms.
        is_causal, key_padding_mask: as in `per_head_attention`.
        positions: `(batch, seq)`; default `0..seq-1`.

    Returns:
        `(batch, seq, d_model)`.
    """
    p = parameters
    batch, seq, _ = query.shape
    where = torch.arange(seq).expand(batch, seq) if positions is None else positions

    def rope(x: Tensor) -> Tensor:
        return _rotate_pairs(x, where, rope_theta, "interleaved" if interleaved else "half")

    if "q_proj.weight" in p:
        queries = _linear(query, p["q_proj.weight"], p.get("q_proj.bias"))
    else:
        bottleneck = _linear(query, p["q_a_proj.weight"], p.get("q_a_proj.bias"))
        bottleneck = _rms_norm(bottleneck, p["q_a_layernorm.weight"], norm_eps)
        queries = _linear(bottleneck, p["q_b_proj.weight"], p.get("q_b_proj.bias"))
    compressed = _linear(query, p["kv_a_proj_with_mqa.weight"], p.get("kv_a_proj_with_mqa.bias"))
    latent = _rms_norm(compressed[..., :kv_lora_rank], p["kv_a_layernorm.weight"], norm_eps)
    k_rope = rope(compressed[..., kv_lora_rank:])  # one rotary key, shared by every head
    kv_b = p["kv_b_proj.weight"]
    mask = _head_mask(None, key_padding_mask, is_causal, 0, batch, seq, seq, query)
    heads = []
    for head in range(num_heads):
        q = queries[..., head * (d_nope + d_rope) : (head + 1) * (d_nope + d_rope)]
        q_nope, q_rope = q[..., :d_nope], rope(q[..., d_nope:])
        rows = head * (d_nope + d_value)
        k_nope = latent @ kv_b[rows : rows + d_nope].T
        v = latent @ kv_b[rows + d_nope : rows + d_nope + d_value].T
        scores = (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) / math.sqrt(d_nope + d_rope)
        heads.append(_softmax_or_zeros(scores + mask) @ v)
    return _linear(torch.cat(heads, dim=-1), p["o_proj.weight"], p.get("o_proj.bias"))


def packed_per_head_attention(
    query: Tensor, cu_seqlens: Tensor, weights: AttentionWeights, **options: object
) -> Tensor:
    """`per_head_attention` of a packed batch: each sequence of `query` `(1, total, d_model)`, between the offsets
    `cu_seqlens` `(num_seqs + 1,)`, computed alone (its positions from 0), the outputs end to end.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from shapesafe_mha.reference import packed_per_head_attention
        >>> m = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
        >>> x, cu = torch.randn(1, 5, 16), torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> ref = packed_per_head_attention(x, cu, m.weights(), num_heads=4, num_kv_heads=2, is_causal=True)
        >>> bool(torch.allclose(ref, m(x, cu_seqlens=cu, is_causal=True), atol=1e-5))
        True

    Arguments:
        query: `(1, total, d_model)`, the sequences end to end.
        cu_seqlens: `(num_seqs + 1,)` offsets from 0 to `total`.
        weights, options: as `per_head_attention` takes them (`num_heads`, `num_kv_heads`, `is_causal`, `window`,
            `rope_theta`, ...), applied to each sequence.

    Returns:
        `(1, total, d_model)`.
    """
    bounds = [int(x) for x in cu_seqlens.tolist()]
    pieces = [
        per_head_attention(query[:, a:b], query[:, a:b], query[:, a:b], weights, **options)  # pyright: ignore[reportArgumentType]
        for a, b in itertools.pairwise(bounds)
        if b > a  # an empty sequence computes nothing
    ]
    return torch.cat(pieces, dim=1) if pieces else query.new_zeros(1, 0, weights.w_o.shape[0])
