"""`MultiHeadAttention`: the module, for MHA, GQA and MQA, composed of checked stages."""

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.cache import KVCache
from .._compute.fastpath import FUSED, NATIVE, FusedQKV, call_restoring, choose_path, module_state, pack_qkv
from .._compute.norms import HeadNorm, OffsetRMSNorm
from .._compute.packed import serving_forward
from .._compute.paged import PagedKVCache
from .._compute.rotary import (
    RotaryEmbedding,
    apply_partial_rotary,
    apply_rotary,
    check_rotary_width,
    default_positions,
    partial_rotary_tables,
    rotary_tables,
)
from .._compute.stages import (
    FORWARD_STAGES,
    autocast_dtype,
    autocast_on,
    check_cache,
    check_temperature_tuning,
    explain_mask,
)
from .._core.contract import CallKey, Session, Stage, Verdicts, raw, remembered_forward, witness
from .._core.dims import (
    AttnMask,
    CuSeqlens,
    KVTokens,
    Memory,
    ModuleSizes,
    PaddingMask,
    Positions,
    Probabilities,
    RotarySizes,
    Tokens,
)
from .._core.errors import ConfigError
from .._core.messages import ExplainedError, dtype_name, mismatch, not_dense
from .._core.trace import current_observer
from .._core.weights import AttentionWeights
from .config import OPTIONS, SIZES, AttentionConfig

# The options held as attributes of the module under their own names (`config` reads them back).
_HELD = tuple(name for name in OPTIONS if name not in ("bias", "rope_scaling", "rope_dim", "attention_sinks", "alibi"))
# What each option that submodules or parameters were built from fixed: set on a built module, it is refused.
_BUILT_FROM = {
    "bias": "projections",
    "rope_theta": "rotary tables",
    "rope_scaling": "rotary tables",
    "rope_dim": "rotary tables",
    "rope_interleaved": "rotary tables",
    "qk_norm": "QK-norm modules",
    "qk_norm_over": "QK-norm modules",
    "qk_norm_centred": "QK-norm modules",
    "qk_norm_offset": "QK-norm modules",
    "qk_norm_after_rope": "QK-norm modules",
    "norm_eps": "QK-norm modules",
    "attention_sinks": "sinks parameter",
    "alibi": "ALiBi slopes",
    "output_gate": "q_proj",
}



def _scalar(module: Any, scalar: float | None) -> float | None:
    module.__dict__["scale"] = None if scalar is None else float(scalar) ** -0.5  # the scores' scale it fixes
    return scalar


def _bound(module: Any, clip: float | None) -> float | None:
    return None if clip is None else float(clip)


def _same(module: Any, value: Any) -> Any:
    return value


# An option set on a built module, validated, as it is held (and what it fixes besides, re-derived).
_DERIVED = {"query_pre_attn_scalar": _scalar, "clip_qkv": _bound, "temperature_tuning": lambda m, t: _tuning(t)}


def _tuning(tuning: Any) -> tuple[int, float] | None:
    return check_temperature_tuning("", tuning)


_STAGES = FORWARD_STAGES | {
    "rotary_tables": rotary_tables,
    "apply_rotary": apply_rotary,
    "partial_rotary_tables": partial_rotary_tables,
    "apply_partial_rotary": apply_partial_rotary,
}
_RAW = raw(**_STAGES)


@contextlib.contextmanager
def _quiet_jit_tracer() -> Iterator[None]:
    """Checks read sizes in Python; under `torch.jit.trace` that is not part of the graph, so say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # pyright: ignore[reportPrivateImportUsage]
        yield


def _module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of the module's first floating-point parameter (None if it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype, param.device
    return None


def _precheck_forward(arguments: dict[str, Any]) -> None:
    """Inputs in the module's dtype and on its device; a cache of the right kind."""
    module = arguments["self"]
    for name in ("query", "key", "value", "attn_mask", "key_padding_mask", "positions"):
        failure = not_dense(name, arguments[name])
        if failure is not None:  # first: a nested tensor's sizes are symbolic, a sparse one has no views
            raise failure
    if arguments["positions"] is not None and module.rotary is None:
        raise ConfigError(
            "positions were given, but this module has no rotary embeddings (rope_theta=None): "
            "nothing would use them. Build it with rope_theta=..., or drop positions."
        )
    key, query = arguments["key"], arguments["query"]
    if module.rotary is not None and isinstance(key, Tensor) and isinstance(query, Tensor) and key is not query:
        if key.dim() == query.dim() == 3 and key.shape[1] != query.shape[1]:
            raise mismatch(
                f"key has kv_seq={key.shape[1]} positions for the query's seq={query.shape[1]}, but this module "
                f"rotates queries and keys by the same positions (rope_theta={module.rotary.theta}): cross-attention "
                "with rotary embeddings is not supported. Build the module with rope_theta=None for cross-attention.",
                arg="key",
                dim="kv_seq",
            )
    found = _module_dtype_device(module)
    cache = arguments["kv_cache"]
    check_cache(cache, KVCache)
    if cache is not None and not _window_fits(cache.window, module.window):
        raise mismatch(
            f"kv_cache keeps a window of {cache.window} positions, but the module attends over "
            + ("every position" if module.window is None else f"a window of {module.window}")
            + "; it would have dropped keys the module needs. Make it with module.new_cache(batch, capacity).",
            arg="kv_cache",
            dim="window",
        )
    if found is None:
        return
    dtype, device = found
    for name in ("query", "key", "value"):
        tensor = arguments[name]
        if not isinstance(tensor, Tensor):
            continue
        if tensor.dtype != dtype:
            raise mismatch(
                f"{name} has dtype {dtype_name(tensor.dtype)}, but the module's parameters are {dtype_name(dtype)}; "
                + (
                    f"cast the input ({name}.to({dtype})) or the module (module.to({tensor.dtype}))."
                    if tensor.is_floating_point()
                    else f"inputs must be floating point: {name}.to({dtype})."
                ),
                arg=name,
            )
        if tensor.device != device:
            raise mismatch(
                f"{name} is on {tensor.device}, but the module's parameters are on {device}; "
                f"move one of them ({name}.to('{device}') or module.to('{tensor.device}')).",
                arg=name,
            )


def _kind(tensor: Tensor) -> tuple[Any, ...]:
    return type(tensor), tensor.dtype, tensor.device


def _window_fits(kept: int | None, needed: int | None) -> bool:
    """Whether a cache keeping a window of `kept` positions (None: all) holds every key a window of `needed` sees."""
    return kept is None or (needed is not None and kept >= needed)


def _explain_forward(arguments: dict[str, Any], failure: ExplainedError) -> str | None:
    if failure.arg == "value" and failure.dim in ("kv_seq", "new"):
        return "key and value must cover the same positions."
    if failure.arg in ("key", "value") and failure.dim == "batch":
        return f"{failure.arg} needs one sequence per query sequence."
    return explain_mask(arguments, failure)


def forward_key(
    module: Any,
    path: str,
    fused: FusedQKV | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: Any,
    need_weights: Any,
    kv_cache: KVCache | None,
    positions: Tensor | None,
) -> CallKey:
    """What the verdict of a `MultiHeadAttention` call depends on: its structure (kinds, ranks, dtypes, devices,
    flags, path, submodules) and its sizes; these exactly, for a lookup that costs one hash. `fused`: the fused
    projection this call runs, current (its projections are then read from it, see `module_state`)."""
    shape = query.shape
    key_shape = shape if key is query else key.shape
    kv_len = key_shape[1]
    cache_kind = buffer_shape = kept = None
    if kv_cache is not None:
        kv_len += kv_cache._start + kv_cache._length  # len(kv_cache), without a Python call of __len__
        buffer = kv_cache.keys_buffer
        cache_kind, buffer_shape = (type(kv_cache), buffer.dtype, buffer.device, kv_cache.window), buffer.shape
        if kv_cache.window is not None:
            kept = (kv_cache.kept, kv_cache.kept + key_shape[1])
    masked = attn_mask is not None or key_padding_mask is not None
    device = query.device
    modules = module._modules.values()
    own = module.__dict__  # its own tensors, read each call (`.data` swapped, a tensor keeps its identity)
    sinks, slopes = own["_parameters"].get("sinks"), own["_buffers"].get("alibi_slopes")
    structure = (
        path,
        type(query),
        query.dtype,
        device,
        None if key is query else (type(key), key.dtype, key.device),
        None if value is key else (type(value), value.dtype, value.device),
        None if attn_mask is None else (type(attn_mask), attn_mask.dtype, attn_mask.device),
        None if key_padding_mask is None else _kind(key_padding_mask),
        None if positions is None else (type(positions), positions.dtype, positions.device),
        cache_kind,
        type(is_causal),
        is_causal,
        type(need_weights),
        need_weights,
        shape[1] > kv_len,  # some rows have nothing to attend to
        shape[1] == 1 and K.native_decodes(shape[0], module.num_heads, kv_len, module.d_head),
        module.training,
        autocast_on() and autocast_dtype(device),
        *modules,  # a projection replaced is another module (compared by identity)
        module_state(modules, fused),  # hooks added, parameters replaced or re-typed
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
        None if slopes is None else (slopes.shape, slopes.dtype, slopes.device),
    )
    shapes = (
        shape,
        None if key is query else key_shape,
        None if value is key else value.shape,
        None if attn_mask is None else attn_mask.shape,
        None if key_padding_mask is None else key_padding_mask.shape,
        buffer_shape,
        kept,
        None if positions is None else positions.shape,
    )
    # kv_seq counts the cached positions too; it is checked only against masks.
    return tuple.__new__(CallKey, (structure, shapes, kv_len if masked else None))  # without NamedTuple's frame


class MultiHeadAttention(nn.Module):
    """Multi-head attention with MHA, GQA and MQA by configuration, batch-first, checked.

    `o_proj(merge_heads(attention(split_heads(q_proj(x)), split_heads(k_proj(x)), split_heads(v_proj(x)))))`.
    The four projections are `nn.Linear` submodules named `q_proj, k_proj, v_proj, o_proj`, so
    checkpoints in that common layout load directly, and they are called as submodules: LoRA
    adapters, hooks (torch's or accelerate's), quantized or parametrized layers in those slots work
    (a plain `nn.Linear` with none is computed as its forward would, without nn.Module's call). The first call of each
    kind runs every stage checked against one set of named dimensions (see `forward`); the verdict
    is remembered for calls whose sizes relate the same way, which then run the stages unchecked.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> attn = ssm.MultiHeadAttention(d_model=64, num_heads=8, num_kv_heads=2)
        >>> attn(torch.randn(2, 10, 64), is_causal=True).shape
        torch.Size([2, 10, 64])

    Arguments:
        d_model: width of inputs and outputs.
        num_heads: query heads.
        num_kv_heads: key/value heads; None means `num_heads` (MHA), 1 is MQA, any divisor of
            `num_heads` is GQA.
        d_head: width of each head; default `d_model // num_heads` (which must then divide).
        bias: biases on all four projections.
        dropout: dropout on the attention probabilities, in training mode.
        rope_theta: rotary position embeddings with this base (Llama: 10000 or 500000); None: none.
        rope_scaling: transformers' `rope_parameters` dict for scaled RoPE ("llama3", "yarn"; "dynamic" and
            "longrope", whose frequencies follow each call's length, `max(positions) + 1`: decoding then turns
            each step by its own, as a transformers model decoding through its cache does), or None.
        rope_dim: partial rotary: rotate only the first `rope_dim` features of each query and key head
            (even, at most `d_head`), the rest passed through, with the frequencies spaced over those
            `rope_dim` (Phi, StableLM, GLM: transformers' `partial_rotary_factor * head_dim`); default
            `d_head`, every feature.
        rope_interleaved: RoPE pairs adjacent features `(2i, 2i+1)` instead of the halves `(i, i + rope_dim/2)`
            of Llama's `rotate_half` (Cohere, GLM, ERNIE).
        qk_norm: RMS-normalise each head's query and key over `d_head` before RoPE, with learned
            weights (`q_norm`, `k_norm` submodules), as Qwen3 and Gemma 3 do.
        qk_norm_over: "head" (default): each head's `d_head` features, weights `(d_head,)`; "all": every
            head's features together, before the head split (OLMo-2), weights `(num_heads * d_head,)` for
            the queries and `(num_kv_heads * d_head,)` for the keys; "per_head": each head's `d_head` features
            with weights of its own, `(num_heads, d_head)` for the queries and `(num_kv_heads, d_head)` for the
            keys (Cohere's `use_qk_norm`; the norms are then `HeadNorm`s).
        qk_norm_centred: the QK-norm subtracts each head's mean first, a LayerNorm without bias
            (`(x - mean) / sqrt(var + eps) * weight`, Cohere), instead of an RMSNorm; per head only.
        qk_norm_offset: the QK-norm scales by `qk_norm_offset + weight` (Gemma 3, whose checkpoints store
            the scale's offset from 1: `1.0`; the norms are then `OffsetRMSNorm`s); default 0, `nn.RMSNorm`.
        qk_norm_after_rope: the per-head QK-norm comes after RoPE instead of before it (HunYuan), so the
            cached keys are the normalised rotated ones.
        norm_eps: the epsilon of QK-norm.
        window: sliding-window attention: a query sees only the `window` most recent keys,
            itself included (Mistral, Gemma); `new_cache` then keeps only those. Without
            `is_causal` the window bounds only how far back a query sees.
        logit_softcap: cap the scores at `±logit_softcap` smoothly, `c * tanh(scores / c)`, before
            the mask (Gemma 2).
        query_pre_attn_scalar: scale the scores by `query_pre_attn_scalar ** -0.5` instead of
            `d_head ** -0.5` (Gemma 2).
        output_gate: an output gate (Qwen3-Next, Qwen3.5): `q_proj` gives each head `d_head` query features
            and then `d_head` gate features, and the merged heads are multiplied by `sigmoid(gate)` before
            `o_proj`. `q_proj` is then `2 * num_heads * d_head` wide.
        clip_qkv: clamp the projected queries, keys and values to `[-clip_qkv, clip_qkv]` before the head
            split (OLMo, OLMoE; after a QK-norm over every head, before a per-head one).
        attention_sinks: attention sinks (gpt-oss): a learned logit per query head, the `sinks` parameter
            (zeros at first), takes part in each row's softmax and is dropped after it, so a head may give
            less than all of its weight to the keys. The scores are then computed here, not by SDPA.
        temperature_tuning: `(floor_scale, attn_scale)`, Llama 4's temperature tuning of its NoPE layers:
            the queries at cache index `i` (counted over every call into a `kv_cache`) are multiplied by
            `1 + attn_scale * log(1 + floor((i + 1) / floor_scale))` after RoPE and QK-norm (Llama 4:
            `(8192, 0.1)`, on layers without RoPE).
        chunk_size: Llama 4's chunked attention (`attention_chunk_size`): a query sees only the keys of its own
            chunk of `chunk_size` positions (with `is_causal`, those up to itself), the chunks counted from
            each sequence's first real key (after the left padding `key_padding_mask` shows, as transformers
            counts them). Not with a `window`.
        alibi: ALiBi position biases (Bloom, MPT) instead of position embeddings: each head `h` adds
            `alibi_slopes[h] * (kv_pos - q_pos)` to its scores (after the scale and the softcap), the query at
            its lower-right aligned position, so a key `d` positions back costs `d * slope`. `alibi_slopes` is a
            buffer (saved in the state dict), Press et al.'s geometric slopes at first (`2 ** (-8 * h / n)`,
            Bloom's interpolation for a head count not a power of two); overwrite it for others (MPT's). The
            scores are then computed here, not by SDPA.
        device, dtype: of the parameters.

    Raises:
        ConfigError: the sizes are not positive ints, `num_kv_heads` does not divide `num_heads`,
            `d_head` is not given and `num_heads` does not divide `d_model`, `dropout` is not a
            number in [0, 1), `window` is not a positive int, `logit_softcap` /
            `query_pre_attn_scalar` not a positive number, or `rope_dim` / `rope_interleaved` are given
            without `rope_theta` or `rope_dim` is not an even int in `[2, d_head]`.
    """

    alibi_slopes: Tensor | None  # ALiBi's slopes, one per query head (a buffer; None without ALiBi)
    native_shape: bool  # derived (`_derive`): torch's fused MHA kernel fits these sizes and options
    _qkv_rows: tuple[int, int, int]
    _constants: frozenset[int]

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        d_head: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope_theta: float | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        rope_dim: int | None = None,
        rope_interleaved: bool = False,
        qk_norm: bool = False,
        qk_norm_over: str = "head",
        qk_norm_centred: bool = False,
        qk_norm_offset: float = 0.0,
        qk_norm_after_rope: bool = False,
        norm_eps: float = 1e-6,
        window: int | None = None,
        logit_softcap: float | None = None,
        query_pre_attn_scalar: float | None = None,
        clip_qkv: float | None = None,
        attention_sinks: bool = False,
        alibi: bool = False,
        output_gate: bool = False,
        temperature_tuning: tuple[int, float] | None = None,
        chunk_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = AttentionConfig(**{name: value for name, value in locals().items() if name in OPTIONS})
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ConfigError(
                f"{config.owner}: dtype={dtype!r} is not a floating-point torch.dtype, but the weights are learned and "
                "softmax needs fractions; pass torch.float32, torch.bfloat16, torch.float16 or torch.float64."
            )
        self._build(config, {"device": device, "dtype": dtype})

    def _build(self, config: AttentionConfig, factory: dict[str, Any]) -> None:
        """The submodules, parameters and attributes `config` describes (validated when it was made)."""
        d_model, num_heads, num_kv_heads, d_head = config.d_model, config.num_heads, config.kv_heads, config.head_width
        c, device, dtype = config, factory["device"], factory["dtype"]
        self.d_model, self.num_heads, self.num_kv_heads, self.d_head = d_model, num_heads, num_kv_heads, d_head
        self.group = num_heads // num_kv_heads
        self.dropout = c.dropout
        self.output_gate = c.output_gate
        bias = c.bias
        self.q_proj = nn.Linear(d_model, num_heads * d_head * (2 if c.output_gate else 1), bias=bias, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=bias, **factory)
        pack_qkv(self.q_proj, self.k_proj, self.v_proj)  # one storage, viewed whole by the fused path
        self.rope_theta = c.rope_theta
        self.rope_dim = c.rotated_width
        self.rope_interleaved = c.rope_interleaved
        self.rotary: RotaryEmbedding | None = None
        if c.rope_theta is not None:
            if self.rope_dim == d_head:
                check_rotary_width(d_head, c.owner)
            self.rotary = RotaryEmbedding(self.rope_dim or d_head, c.rope_theta, c.rope_scaling, c.rope_interleaved)
            self.rotary.to(device=device)
        self.qk_norm, self.qk_norm_over, self.qk_norm_centred = c.qk_norm, c.qk_norm_over, c.qk_norm_centred
        self.qk_norm_offset, self.qk_norm_after_rope = float(c.qk_norm_offset), c.qk_norm_after_rope
        self.norm_eps = c.norm_eps
        if c.qk_norm:
            norm_eps, offset = c.norm_eps, c.qk_norm_offset
            every = c.qk_norm_over == "all"
            widths = (num_heads * d_head, num_kv_heads * d_head) if every else (d_head, d_head)
            if c.qk_norm_over == "per_head" or c.qk_norm_centred:  # Cohere: a norm of each head, its own weights
                heads = (num_heads, num_kv_heads) if c.qk_norm_over == "per_head" else (None, None)
                self.q_norm = HeadNorm(heads[0], d_head, norm_eps, c.qk_norm_centred, **factory)
                self.k_norm = HeadNorm(heads[1], d_head, norm_eps, c.qk_norm_centred, **factory)
            elif offset:
                self.q_norm = OffsetRMSNorm(widths[0], norm_eps, float(offset), **factory)
                self.k_norm = OffsetRMSNorm(widths[1], norm_eps, float(offset), **factory)
            else:
                self.q_norm = nn.RMSNorm(widths[0], eps=norm_eps, **factory)
                self.k_norm = nn.RMSNorm(widths[1], eps=norm_eps, **factory)
        self.window = c.window
        self.logit_softcap = c.logit_softcap
        self.query_pre_attn_scalar = _scalar(self, c.query_pre_attn_scalar)
        self.sinks: nn.Parameter | None = None
        if c.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, **factory))
        slopes = None
        if c.alibi:  # not learned: a buffer, kept in the state dict so that loaded slopes (MPT's) stay
            slopes = K.alibi_slopes(num_heads).to(device=device, dtype=dtype or torch.get_default_dtype())
        self.register_buffer("alibi_slopes", slopes)
        self.clip_qkv = _bound(self, c.clip_qkv)
        self.temperature_tuning = _tuning(c.temperature_tuning)
        self.chunk_size = c.chunk_size
        self._derive()

    @classmethod
    def from_config(
        cls, config: AttentionConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> "MultiHeadAttention":
        """The module `config` describes, its parameters freshly initialised.

        Example:
            >>> import dataclasses, torch, shapesafe_mha as ssm
            >>> attn = ssm.MultiHeadAttention(64, 8, 2)
            >>> wider = ssm.MultiHeadAttention.from_config(dataclasses.replace(attn.config, window=16))
            >>> wider.window, wider(torch.randn(1, 4, 64), is_causal=True).shape
            (16, torch.Size([1, 4, 64]))
        """
        if not isinstance(config, AttentionConfig):
            raise ConfigError(
                f"MultiHeadAttention.from_config(): config must be an AttentionConfig, but got {type(config).__name__}."
            )
        return cls(**{name: getattr(config, name) for name in OPTIONS}, device=device, dtype=dtype)

    @property
    def config(self) -> AttentionConfig:
        """The module as it is now, described as one `AttentionConfig` (`bias`: whether `q_proj` has one)."""
        return self._described()

    def _described(self) -> AttentionConfig:
        rotary = self._modules.get("rotary")
        return AttentionConfig(
            **{name: getattr(self, name) for name in _HELD},
            bias=self.bias,
            rope_scaling=getattr(rotary, "scaling", None),
            rope_dim=None if self.rope_dim == self.d_head else self.rope_dim,
            attention_sinks=self._parameters.get("sinks") is not None,
            alibi=self._buffers.get("alibi_slopes") is not None,
        )

    def _derive(self) -> None:
        """What the sizes and options fix, derived from them (again, when one is set after construction: a
        verdict or fused weight remembered under the old ones is forgotten)."""
        d_model, num_heads, num_kv_heads, d_head = self.d_model, self.num_heads, self.num_kv_heads, self.d_head
        variant = (
            self.qk_norm
            or self.window is not None
            or self.logit_softcap is not None
            or self.query_pre_attn_scalar is not None
            or self._parameters.get("sinks") is not None
            or self.clip_qkv is not None
            or self.output_gate
            or self.temperature_tuning is not None
            or self.chunk_size is not None
            or self._buffers.get("alibi_slopes") is not None
        )
        derived = self.__dict__  # not __setattr__: these are what it derives
        if num_kv_heads and num_heads % num_kv_heads == 0:  # (sizes set one by one: the call checks them)
            derived["group"] = num_heads // num_kv_heads
        # Torch's fused MHA kernel needs plain MHA with heads that tile d_model (see fastpath.native_fits).
        derived["native_shape"] = (
            num_kv_heads == num_heads and num_heads * d_head == d_model and self.rope_theta is None and not variant
        )
        # the rows of q_proj, k_proj and v_proj this module's sizes fix: the only ones fused (fastpath.fused_qkv)
        derived["_qkv_rows"] = (num_heads * d_head, num_kv_heads * d_head, num_kv_heads * d_head)
        derived["_constants"] = frozenset(
            {d_model, num_heads, num_kv_heads, d_head, self.group, num_heads * d_head, num_kv_heads * d_head}
            | ({self.window} if self.window is not None else set())
            | ({self.rope_dim} if self.rope_dim is not None else set())
        )
        self._forget()

    def _forget(self) -> None:
        """Drop what is remembered about calls: verdicts and the fused Q/K/V weight."""
        self._verdicts = Verdicts()
        self._fused: FusedQKV | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> "MultiHeadAttention":
        # .to(), .half(), .cuda(): the parameters change dtype or device; what was remembered may not hold.
        # The projections' tensors it made anew are packed again (`pack_qkv`); one it left as it was stays.
        before = {id(t): t.data_ptr() for t in self._qkv_tensors()}
        super()._apply(fn, recurse)
        self._forget()
        pack_qkv(*self._qkv_modules(), fresh=lambda t: before.get(id(t)) != t.data_ptr())
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and pickle: tensors of its own, packed again where each is its storage whole
        super().__setstate__(state)
        pack_qkv(*self._qkv_modules())

    def _qkv_modules(self) -> tuple[Any, Any, Any]:
        modules = self._modules
        return modules.get("q_proj"), modules.get("k_proj"), modules.get("v_proj")

    def _qkv_tensors(self) -> list[Tensor]:
        modules = [m for m in self._qkv_modules() if isinstance(m, nn.Module)]
        return [t for m in modules for t in m._parameters.values() if t is not None]

    def __setattr__(self, name: str, value: Any) -> None:
        # A projection replaced (PEFT wraps and later unwraps them): forget the fused view of the old ones. A size,
        # an option or a tensor of the module's own set (head pruning, sinks or ALiBi slopes loaded another way): derive
        # what they fix again, and forget what was remembered under the old ones.
        built = "_fused" in self.__dict__  # (not while __init__ sets them)
        if built and name in OPTIONS and name not in SIZES:
            if name in _BUILT_FROM:
                raise ConfigError(
                    f"MultiHeadAttention: {name} cannot be set on a built module: its {_BUILT_FROM[name]} "
                    f"{'were' if _BUILT_FROM[name].endswith('s') else 'was'} built from it. Build one that has it: "
                    f"MultiHeadAttention.from_config(dataclasses.replace(module.config, {name}={value!r})), then "
                    "load_state_dict(module.state_dict())."
                )
            dataclasses.replace(self._described(), **{name: value})  # validated as at construction (ConfigError)
            value = _DERIVED.get(name, _same)(self, value)
        super().__setattr__(name, value)
        if not built:
            return
        if isinstance(value, nn.Module):
            self._forget()
        elif not name.startswith("_") and name != "training":  # (the mode is in every verdict's key)
            self._derive()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_verdicts=Verdicts(), _fused=None)
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_restoring(self, args, kwargs, KVCache)  # a hook that raises after forward changes nothing

    def extra_repr(self) -> str:
        # the sizes (resolved) and dropout, then each option that differs from its default (AttentionConfig's)
        sizes = ", ".join(f"{name}={getattr(self, name)!r}" for name in (*SIZES, "dropout"))
        try:
            variants = {k: v for k, v in self._described().variants().items() if k not in ("dropout", "bias")}
        except ConfigError:  # sizes set one by one (head pruning) that do not fit yet
            return sizes
        return ", ".join([sizes, *(f"{name}={value!r}" for name, value in variants.items())])

    @property
    def bias(self) -> bool:
        return self.q_proj.bias is not None

    def weights(self) -> AttentionWeights:
        """The parameters as an `AttentionWeights` (the parameters themselves, not copies; with an output gate,
        the query rows of `q_proj`, views of it, and `gate_weights()` the gate's)."""
        if self.output_gate:
            q_weight, q_bias = self._query_rows(0)
            return AttentionWeights(q_weight, self.k_proj.weight, self.v_proj.weight, self.o_proj.weight, q_bias,
                                    self.k_proj.bias, self.v_proj.bias, self.o_proj.bias)  # fmt: skip
        return AttentionWeights(
            self.q_proj.weight,
            self.k_proj.weight,
            self.v_proj.weight,
            self.o_proj.weight,
            self.q_proj.bias,
            self.k_proj.bias,
            self.v_proj.bias,
            self.o_proj.bias,
        )

    def gate_weights(self) -> tuple[Tensor, Tensor | None]:
        """The output gate's rows of `q_proj`, `(num_heads * d_head, d_model)` and the bias's (views of them), as the
        per-head reference takes them (`per_head_attention(..., output_gate=)`).

        Raises:
            ConfigError: the module has no output gate.
        """
        if not self.output_gate:
            raise ConfigError("MultiHeadAttention.gate_weights(): this module has no output gate (output_gate=False).")
        return self._query_rows(1)

    def _query_rows(self, part: int) -> tuple[Tensor, Tensor | None]:
        """Of a gated `q_proj`, each head's query rows (`part` 0) or gate rows (1), in head order."""
        weight, bias = self.q_proj.weight, self.q_proj.bias
        rows = weight.unflatten(0, (self.num_heads, 2, self.d_head))[:, part].flatten(0, 1)
        return rows, None if bias is None else bias.unflatten(0, (self.num_heads, 2, self.d_head))[:, part].flatten()

    @classmethod
    def from_weights(
        cls,
        weights: AttentionWeights,
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        rope_theta: float | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        verify: bool = True,
    ) -> "MultiHeadAttention":
        """A module holding copies of `weights` (on their device, in their dtype), each bias as given.

        Verified on a float64 probe against `reference.per_head_attention` with the same weights
        (`verify=False` skips it; `meta` weights are not probed).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> a = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
            >>> b = ssm.MultiHeadAttention.from_weights(a.weights(), num_heads=4, num_kv_heads=2)
            >>> x = torch.randn(1, 3, 16)
            >>> torch.equal(a(x), b(x))
            True

        Raises:
            ConfigError, ShapeError: the weights do not fit the head counts, or are not floating point.
        """
        from .._interop.torch_nn import from_weights

        return from_weights(
            cls,
            weights,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            verify=verify,
        )

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A `KVCache` that fits this module: its KV heads, `d_head`, dtype, device and sliding window.

        With a `window`, `capacity >= window` serves a generation of any length (see `KVCache`).
        """
        weight = self.k_proj.weight
        return KVCache(
            batch,
            self.num_kv_heads,
            capacity,
            self.d_head,
            dtype=weight.dtype,
            device=weight.device,
            window=self.window,
        )

    def forward(
        self,
        query: Tokens,
        key: Memory | None = None,
        value: Memory | None = None,
        *,
        attn_mask: AttnMask | None = None,
        key_padding_mask: PaddingMask | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | PagedKVCache | None = None,
        positions: Positions | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> Tokens | tuple[Tokens, Probabilities]:
        """Attend from `query` to `key`/`value` (default: `query`, self-attention).

        `o_proj(merge(attention(split(q_proj(query)), split(k_proj(key)), split(v_proj(value)))))`.

        Checking: on the first call of a kind, every stage runs checked, arguments and result,
        against one set of named dimensions (`batch`, `seq`, `kv_seq`, `num_heads`, ... bound by the
        module's sizes and by the first tensor that shows each one); then the verdict is remembered
        for every call whose sizes relate the same way (equal where these were equal, 1 where these
        were 1), on the same execution path, so decoding step after step is checked once.

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> attn = ssm.MultiHeadAttention(d_model=64, num_heads=8, num_kv_heads=2)
            >>> attn(torch.randn(2, 10, 64), is_causal=True).shape
            torch.Size([2, 10, 64])

        Arguments:
            query: `(batch, seq, d_model)`.
            key, value: `(batch, kv_seq, d_model)`; with a `kv_cache`, the new positions only
                (`(batch, new, d_model)`).
            attn_mask: `(seq, kv_seq)` or `(#batch, #num_heads, seq, kv_seq)`; bool (True = may
                attend) or float (added to the scores). With a cache, `kv_seq` counts every
                cached position plus the new ones.
            key_padding_mask: `(batch, kv_seq)` bool, True = padding (ignored), as in
                `nn.MultiheadAttention`.
            is_causal: mask future positions, lower-right aligned (query `i` is position
                `kv_seq - seq + i`), so prefill and decoding with a cache agree.
            need_weights: also return the per-head probabilities `(batch, num_heads, seq, kv_seq)`.
            kv_cache: append this call's keys and values to it and attend over all it holds. A `PagedKVCache`
                serves all its live sequences at once: a packed batch with `cu_seqlens`, or `(num_seqs, 1,
                d_model)`, one new token each (see docs/serving.md).
            positions: `(batch, seq)` integer positions of the queries, for rotary embeddings
                (default: `len(kv_cache) + arange(seq)` for every sequence, so prefill and
                decoding agree; a left-padded batch passes its own). Packed: `(1, total)`.
            cu_seqlens: a packed batch: `query` is `(1, total, d_model)`, the sequences end to end, and
                `cu_seqlens` `(num_seqs + 1,)` int32 their offsets, from 0 to `total`. Each sequence attends only
                to itself (its own positions from 0, causal mask, window), as if it were called alone.

        Returns:
            `(batch, seq, d_model)`, or `(output, weights)` with `need_weights=True`. A query
            with nothing to attend to gets zeros (never NaN), in outputs and gradients.

        Raises:
            ShapeError: any input does not fit the module, the others or the cache; nothing
                (parameters, cache) is changed by a failed call.
        """
        if cu_seqlens is not None or isinstance(kv_cache, PagedKVCache):  # serving: packed batches, paged caches
            return serving_forward(self, query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   is_causal=is_causal, need_weights=need_weights, kv_cache=kv_cache,
                                   positions=positions, cu_seqlens=cu_seqlens)  # fmt: skip
        key = query if key is None else key
        value = key if value is None else value
        call = (query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, kv_cache, positions)
        jit_tracing = torch.jit.is_tracing()  # pyright: ignore[reportPrivateImportUsage]
        path, fused = choose_path(self, *call, jit_tracing=jit_tracing)

        def checked(check: bool, observer: Any) -> Any:
            with _quiet_jit_tracer() if jit_tracing else contextlib.nullcontext():
                return self._checked(check, observer, path, fused, *call)

        return remembered_forward(
            self._verdicts,
            self._constants,
            lambda: None if jit_tracing else forward_key(self, path, fused, *call),
            kv_cache if isinstance(kv_cache, KVCache) else None,
            lambda: self._run(_RAW, path, fused, *call),
            checked,
            current_observer(),
        )

    def _checked(
        self,
        check: bool,
        observer: Any,
        path: str,
        fused: FusedQKV | None,
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any,
        key_padding_mask: Any,
        is_causal: Any,
        need_weights: Any,
        kv_cache: Any,
        positions: Any,
    ) -> Any:
        """The forward with every stage checked against one memo, and reported to the trace."""
        with Session("MultiHeadAttention.forward()", check=check, observer=observer) as session:
            sizes = (self.d_model, self.num_heads, self.num_kv_heads, self.d_head, self.group)
            session.seed(ModuleSizes, witness(sizes), "the module")
            if self.rope_dim is not None and self.rope_dim != self.d_head:
                session.seed(RotarySizes, witness((self.rope_dim,)), "the module")
            session.check_arguments(
                _FORWARD,
                (self, query, key, value),
                dict(
                    attn_mask=attn_mask,
                    key_padding_mask=key_padding_mask,
                    is_causal=is_causal,
                    need_weights=need_weights,
                    kv_cache=kv_cache,
                    positions=positions,
                ),
                hints=_FORWARD_HINTS if kv_cache is None else _CACHED_FORWARD_HINTS,
            )
            if observer is not None:
                observer("query", "batch seq d_model", query)
            stages = session.stages(**_STAGES)
            call = (query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, kv_cache, positions)
            result = self._run(stages, path, fused, *call)
            session.report(_FORWARD, result)
        return result

    def _run(
        self,
        s: Any,
        path: str,
        fused: FusedQKV | None,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        kv_cache: KVCache | None,
        positions: Tensor | None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The forward, stage by stage: `s` holds the stages, checked (a session's) or plain."""
        num_heads, num_kv_heads, d_head = self.num_heads, self.num_kv_heads, self.d_head
        modules = self._modules  # plain dict lookups: nn.Module.__getattr__ costs a microsecond each
        q_proj, k_proj, v_proj, o_proj = modules["q_proj"], modules["k_proj"], modules["v_proj"], modules["o_proj"]
        if path is NATIVE and fused is not None:
            out = o_proj._parameters  # pyright: ignore[reportOptionalMemberAccess]  (built in __init__)
            out_weight, out_bias = out["weight"], out["bias"]
            return s.native_attention(query, fused.weight, fused.bias, out_weight, out_bias, num_heads)
        gate = None
        every = self.qk_norm and self.qk_norm_over == "all"
        before_split = every or self.clip_qkv is not None  # these see the projections before the head split
        split = False  # whether q, k and v are heads already
        if self.output_gate:  # Qwen3-Next: each head's queries and its gate from one projection
            q, gate = s.split_gated_query(s.project_gated_query(q_proj, query), num_heads)
            k = s.project_key(k_proj, key)
            v = s.project_value(v_proj, value)
        elif path is FUSED and fused is not None:
            qkv = s.project_qkv(query, fused.weight, fused.bias)
            if before_split:
                q, k, v = s.unfuse(qkv, num_heads * d_head, num_kv_heads * d_head)
            else:  # three views, the same as unfusing and then splitting each (four fewer calls)
                q, k, v = s.split_fused(qkv, num_heads, num_kv_heads)
                split = True
        else:
            q = s.project_query(q_proj, query)
            k = s.project_key(k_proj, key)
            v = s.project_value(v_proj, value)
        if every:  # the statistic of every head's features together, before they are split
            q, k = s.normalize_qk_inner(modules["q_norm"], modules["k_norm"], q, k)
        if self.clip_qkv is not None:
            q, k, v = s.clip_projections(q, k, v, self.clip_qkv)
        if not split:
            if gate is None:
                q = s.split_query(q, num_heads)
            k = s.split_key(k, num_kv_heads)
            v = s.split_value(v, num_kv_heads)
        if self.qk_norm and not every and not self.qk_norm_after_rope:
            q, k = s.normalize_qk(modules["q_norm"], modules["k_norm"], q, k)
        rotary = modules.get("rotary")
        if rotary is not None:
            if positions is None:
                positions = default_positions(query, 0 if kv_cache is None else kv_cache.seen)
            if self.rope_dim == d_head:
                cos, sin = s.rotary_tables(rotary, positions, q)
                q, k = s.apply_rotary(q, k, cos, sin, self.rope_interleaved)
            else:  # partial rotary: the tables and the rotation of the first rope_dim features only
                cos, sin = s.partial_rotary_tables(rotary, positions, q)
                q, k = s.apply_partial_rotary(q, k, cos, sin, self.rope_interleaved)
        if self.qk_norm_after_rope:  # HunYuan: the rotated queries and keys normalised, and so cached
            q, k = s.normalize_qk(modules["q_norm"], modules["k_norm"], q, k)
        tuning = self.temperature_tuning
        if tuning is not None:  # Llama 4's NoPE layers: each query scaled by its cache index
            q = s.tune_query_temperature(q, 0 if kv_cache is None else kv_cache.seen, *tuning)
        if kv_cache is None:
            k, v = s.attend_to_new(k, v)
        else:
            k, v = s.append_to_cache(kv_cache, kv_cache.keys_buffer, k, v)
            masked = attn_mask is not None or key_padding_mask is not None
            if masked and kv_cache.window is not None and kv_cache.seen != k.shape[2]:  # positions were dropped
                attn_mask, key_padding_mask = s.visible_masks(attn_mask, key_padding_mask, kv_cache.seen, k.shape[2])
        if self.chunk_size is not None:  # Llama 4: a query sees only the keys of its own chunk
            attn_mask = s.chunk_masks(q, k, attn_mask, key_padding_mask, self.chunk_size)
        scale, softcap, sinks = self.scale, self.logit_softcap, self._parameters.get("sinks")
        slopes = self._buffers.get("alibi_slopes")
        # the scores computed here, not by SDPA
        explicit = need_weights or softcap is not None or sinks is not None or slopes is not None
        dropout_p = self.dropout if self.training else 0.0
        native = not explicit and K.native_gqa(q, k, dropout_p)  # torch's own kernel, where it copies nothing
        mask = s.combine_masks(q, k, attn_mask, key_padding_mask, is_causal, explicit, self.window, native)
        weights = merged = None
        if mask is None and num_heads == num_kv_heads and not explicit:
            out = s.attend_heads(q, k, v, K.native_causal(is_causal, q, k), dropout_p, scale)
        elif native:
            causal = mask is None and K.native_causal(is_causal, q, k, gqa=True)
            may_empty = mask is not None and K.may_empty_rows(
                attn_mask, key_padding_mask, is_causal, q.shape[2], k.shape[2]
            )
            out = s.attend_native(q, k, v, mask, causal, may_empty, dropout_p, scale)
        else:
            single = q.shape[2] == 1  # decoding: the fold and the merge are one view or reshape each
            folded = s.fold_one_query(q, num_kv_heads) if single else s.fold_queries(s.group_queries(q, num_kv_heads))
            folded_mask, rows = None, None
            if mask is not None:
                may_empty = K.may_empty_rows(attn_mask, key_padding_mask, is_causal, q.shape[2], k.shape[2])
                may_empty = may_empty and (explicit or not K.zeroes_empty_rows(q, dropout_p))  # SDPA's own zeros
                folded_mask, rows = s.fold_mask(mask, may_empty, num_heads, num_kv_heads)
            if explicit:
                bias = None if slopes is None else s.alibi_bias(slopes, q, k)
                folded_weights = s.folded_weights(folded, k, folded_mask, scale, softcap, sinks, bias)
                if need_weights:
                    weights = s.unfold_weights(folded_weights, num_heads, rows)
                out = s.unfold(s.weigh_values(folded_weights, v, dropout_p), num_heads, rows)
            else:
                out = s.attend_folded(folded, k, v, folded_mask, dropout_p, scale)
                if single and rows is None:
                    merged = s.merge_one_query(out)
                else:
                    out = s.unfold(out, num_heads, rows)
        if merged is None:  # one query a head (decoding): the heads merge by one reshape, no transpose
            merged = s.merge_one_query_heads(out) if q.shape[2] == 1 else s.merge(out)
        if gate is not None:
            merged = s.gate_output(merged, gate)
        out = s.project_output(o_proj, merged)
        return out if weights is None else (out, weights)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A `MultiHeadAttention` computing what a batch-first `module` computes.

        Masks translate as: our bool `attn_mask` is True where attending is allowed, torch's
        module's is True where it is *forbidden*, so pass `~their_mask`; `key_padding_mask` means
        the same in both (True = padding).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
            >>> ours = ssm.MultiHeadAttention.from_torch(theirs)
            >>> x = torch.randn(2, 5, 32)
            >>> bool(torch.allclose(ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6))
            True

        Raises:
            ConfigError: `module` is not batch-first (the message says how to convert), or uses
                features without an equivalent here (`kdim`/`vdim`, `add_bias_kv`, `add_zero_attn`).
        """
        from .._interop.torch_nn import from_torch

        return from_torch(cls, module)

    @classmethod
    def from_hf(cls, attention: nn.Module, *, config: Any = None, verify: bool = True) -> "MultiHeadAttention":
        """A `MultiHeadAttention` computing what a transformers attention layer computes (causal, with RoPE).

        For layers in the q/k/v/o_proj layout (Llama, Mistral, Qwen2/3, Gemma 2 and alike; Phi's `dense` as
        o_proj; GPT-NeoX's per-head fused `query_key_value` and Phi-3's stacked `qkv_proj` as q/k/v_proj),
        configured by `attention.config`: sizes, GQA, biases per projection, dropout, RoPE (default, llama3, YaRN,
        dynamic or LongRoPE scaling; tables computed as
        transformers computes them; partial rotary from `partial_rotary_factor`, interleaved pairs read
        from the model's own rotary parts), and the variants: sliding window, QK-norm, logit softcapping,
        `query_pre_attn_scalar` (QK-norm: per head, over every head, `1 + weight`, Cohere's LayerNorm of each
        head); ALiBi (Bloom's per-head fused `query_key_value`, MPT's `Wqkv`), with the slopes
        their model passes them, read from transformers' own `build_alibi_tensor` / `build_mpt_alibi_tensor`.
        Bloom's and MPT's layers keep no config: pass their model's, `from_hf(layer, config=model.config)`.
        Call it `is_causal=True`; positions
        default to `len(kv_cache) + arange(seq)`, and decoding uses our `KVCache` (windowed where
        the layer is). Multi-head latent attention (DeepSeek) loads with `LatentAttention.from_hf`.

        The result is verified, not trusted: both layers run a causal forward and a decoding step on
        a small float64 probe (the layer as its model calls it: its rotary class, its mask function, a
        `DynamicCache`), and a layer that computes something else is refused, naming the difference.
        `verify=False` skips the probe (layers on `meta`, which hold no values, are not probed).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> from transformers import LlamaConfig
            >>> from transformers.models.llama.modeling_llama import LlamaAttention
            >>> config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
            >>> ours = ssm.MultiHeadAttention.from_hf(LlamaAttention(config, layer_idx=0))
            >>> ours
            MultiHeadAttention(
              d_model=64, num_heads=8, num_kv_heads=2, d_head=8, dropout=0.0, rope_theta=10000.0
              ...

        Raises:
            ConfigError: a variant computed differently here (another RoPE scaling, a QK-norm other
                than those above, latent attention), named by its config field or the submodule; or the
                converted layer differs from `attention` on the probe.
        """
        from .._interop.hf import from_hf

        return from_hf(cls, attention, config=config, verify=verify)

    def to_hf(self, config: Any, *, verify: bool = True) -> nn.Module:
        """The transformers attention layer for `config` (a LlamaConfig, Qwen2Config, ...), with these weights.

        Verified as `from_hf` is: the layer, called as its model calls it, against this module on a
        float64 probe (`verify=False` skips it).

        Raises:
            ConfigError: `config` describes other sizes, biases, RoPE (theta or scaling), dropout or
                variants than this module, or its model type has no such attention class, or the
                layer differs from this module on the probe.
        """
        from .._interop.hf import to_hf

        return to_hf(self, config, verify=verify)

    def to_torch(self, *, verify: bool = True) -> nn.MultiheadAttention:
        """An equivalent `nn.MultiheadAttention(batch_first=True)`; MHA with `num_heads*d_head == d_model` only.

        Biases on some projections only become zero biases there (it has all or none). Verified on a
        float64 probe (`verify=False` skips it).

        Raises:
            ConfigError: the configuration has no `nn.MultiheadAttention` equivalent (GQA/MQA,
                `num_heads * d_head != d_model`, or a variant: RoPE, QK-norm, a window, softcapping,
                `query_pre_attn_scalar`, sinks, ALiBi), named.
        """
        from .._interop.torch_nn import to_torch

        return to_torch(self, verify=verify)


_FORWARD = Stage(
    MultiHeadAttention.forward,
    name="MultiHeadAttention.forward",
    public=("query", "key", "value", "attn_mask", "key_padding_mask", "kv_cache"),
    trace=("",),
    sources={},
    precheck=_precheck_forward,
    validate=None,
    explain=_explain_forward,
)
# Masks are checked where kv_seq is known (the mask stage, after the cache); with a cache, key and
# value hold the new positions only.
_FORWARD_HINTS = {k: v for k, v in _FORWARD.hints.items() if k not in ("attn_mask", "key_padding_mask")}
_CACHED_FORWARD_HINTS = _FORWARD_HINTS | {"key": KVTokens, "value": KVTokens}
