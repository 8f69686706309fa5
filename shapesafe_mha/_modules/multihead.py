"""`MultiHeadAttention`: the module, for MHA, GQA and MQA, composed of checked stages."""

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.cache import KVCache
from .._compute.fastpath import FusedQKV, call_restoring, choose_path, pack_qkv
from .._compute.norms import qk_norms
from .._compute.packed import serving_forward
from .._compute.paged import PagedKVCache
from .._compute.rotary import (
    RotaryEmbedding,
    check_rotary_width,
)
from .._compute.stages import check_float_dtype, check_temperature_tuning
from .._core.contract import Verdicts, remembered_forward
from .._core.dims import (
    AttnMask,
    CuSeqlens,
    Memory,
    PaddingMask,
    Positions,
    Probabilities,
    Tokens,
)
from .._core.errors import ConfigError
from .._core.trace import current_observer
from .._core.weights import AttentionWeights
from .config import OPTIONS, SIZES, AttentionConfig
from .contract import checked_forward, forward_key, forward_stage, quiet_jit_tracer
from .conversions import Conversions
from .plan import RAW, plan, run

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
    "differential_lambda_init": "lambda parameters",
}


def _scalar(module: Any, scalar: float | None) -> float | None:
    module.__dict__["scale"] = None if scalar is None else float(scalar) ** -0.5  # the scores' scale it fixes
    return scalar


def _bound(module: Any, clip: float | None) -> float | None:
    return None if clip is None else float(clip)


def _same(module: Any, value: Any) -> Any:
    return value


# An option set on a built module, validated, as it is held (and what it fixes besides, re-derived).
_DERIVED = {
    "query_pre_attn_scalar": _scalar,
    "clip_qkv": _bound,
    "temperature_tuning": lambda m, t: _tuning(t),
    "qk_norm_offset": lambda m, offset: float(offset),
}


def _tuning(tuning: Any) -> tuple[int, float] | None:
    return check_temperature_tuning("", tuning)


class MultiHeadAttention(Conversions, nn.Module):
    """Multi-head attention with MHA, GQA and MQA by configuration, batch-first, checked.

    `o_proj(merge_heads(attention(split_heads(q_proj(x)), split_heads(k_proj(x)), split_heads(v_proj(x)))))`.
    The four projections are `nn.Linear` submodules named `q_proj, k_proj, v_proj, o_proj`, so checkpoints in
    that common layout load directly, and they are called as submodules: LoRA adapters, hooks (torch's or
    accelerate's), quantized or parametrized layers in those slots work (a plain `nn.Linear` with none is computed
    as its forward would, without nn.Module's call). Checked once per kind of call (see `forward`).

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
        device, dtype: of the parameters.

    Every other keyword is a variant (RoPE, QK-norm, windows, softcapping, sinks, ALiBi, an output gate, ...):
    the `AttentionConfig` field of the same name, described there.

    Raises:
        ConfigError: a size or an option out of its range, or contradicting another (see `AttentionConfig`).
    """

    alibi_slopes: Tensor | None  # ALiBi's slopes, one per query head (a buffer; None without ALiBi)
    window: int | None  # an option, held under its name (as each of `AttentionConfig`'s)
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
        differential_lambda_init: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = AttentionConfig(**{name: value for name, value in locals().items() if name in OPTIONS})
        check_float_dtype(config.owner, dtype)
        self._build(config, {"device": device, "dtype": dtype})

    def _build(self, config: AttentionConfig, factory: dict[str, Any]) -> None:
        """The submodules, parameters and attributes `config` describes (validated when it was made)."""
        c, device, dtype = config, factory["device"], factory["dtype"]
        d_model, num_heads, num_kv_heads, d_head = c.d_model, c.num_heads, c.kv_heads, c.head_width
        self.d_model, self.num_heads, self.num_kv_heads, self.d_head = d_model, num_heads, num_kv_heads, d_head
        self.group = num_heads // num_kv_heads
        for name in (n for n in _HELD if n not in SIZES):  # each option held under its own name, as it is held
            setattr(self, name, _DERIVED.get(name, _same)(self, getattr(c, name)))
        self.rope_dim = c.rotated_width
        self.q_proj = nn.Linear(d_model, num_heads * d_head * (2 if c.output_gate else 1), bias=c.bias, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=c.bias, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=c.bias, **factory)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=c.bias, **factory)
        pack_qkv(self.q_proj, self.k_proj, self.v_proj)  # one storage, viewed whole by the fused path
        self.rotary: RotaryEmbedding | None = None
        if c.rope_theta is not None:
            if self.rope_dim == d_head:
                check_rotary_width(d_head, c.owner)
            self.rotary = RotaryEmbedding(self.rope_dim or d_head, c.rope_theta, c.rope_scaling, c.rope_interleaved)
            self.rotary.to(device=device)
        if c.qk_norm:
            self.q_norm, self.k_norm = qk_norms(c, factory)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(num_heads, **factory)) if c.attention_sinks else None
        for name in K.LAMBDAS if c.differential_lambda_init is not None else ():  # DiffLlama's, named as its are
            self.register_parameter(name, nn.Parameter(torch.empty(d_head, **factory).normal_(0, K.LAMBDA_STD)))
        slopes = None
        if c.alibi:  # not learned: a buffer, kept in the state dict so that loaded slopes (MPT's) stay
            slopes = K.alibi_slopes(num_heads).to(device=device, dtype=dtype or torch.get_default_dtype())
        self.register_buffer("alibi_slopes", slopes)
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
        derived = self.__dict__  # not __setattr__: these are what it derives
        try:
            config = self._described()
        except ConfigError:  # sizes set one by one (head pruning) that do not fit yet: the call checks them
            config = None
        if config is not None:
            derived["group"] = num_heads // num_kv_heads
            derived["_plan"] = plan(config)
        # Torch's fused MHA kernel needs plain MHA with heads that tile d_model (see fastpath.native_fits).
        variants = () if config is None else config.variants().keys() - {"dropout", "bias"}
        derived["native_shape"] = (
            config is not None and num_kv_heads == num_heads and num_heads * d_head == d_model and not variants
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
        projections = [self._modules.get(name) for name in ("q_proj", "k_proj", "v_proj")]
        before = {id(t): t.data_ptr() for m in projections if isinstance(m, nn.Module) for t in m.parameters()}
        super()._apply(fn, recurse)
        self._forget()
        pack_qkv(*projections, fresh=lambda t: before.get(id(t)) != t.data_ptr())
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and pickle: tensors of its own, packed again where each is its storage whole
        super().__setstate__(state)
        pack_qkv(*(self._modules.get(name) for name in ("q_proj", "k_proj", "v_proj")))

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
        return self.__dict__ | {"_verdicts": Verdicts(), "_fused": None}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_restoring(self, args, kwargs, _CACHES)  # a hook that raises after forward changes nothing

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
        q_weight, q_bias = self._query_rows(0) if self.output_gate else (self.q_proj.weight, self.q_proj.bias)
        k, v, o = self.k_proj, self.v_proj, self.o_proj
        return AttentionWeights(q_weight, k.weight, v.weight, o.weight, q_bias, k.bias, v.bias, o.bias)

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

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A `KVCache` that fits this module: its KV heads, `d_head`, dtype, device and sliding window.

        With a `window`, `capacity >= window` serves a generation of any length (see `KVCache`).
        """
        weight, heads, d_head = self.k_proj.weight, self.num_kv_heads, self.d_head
        return KVCache(batch, heads, capacity, d_head, dtype=weight.dtype, device=weight.device, window=self.window)

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

        Checked once per kind of call: every stage against one set of named dimensions, bound by the module's
        sizes and the first tensor that shows each; the verdict then covers calls whose sizes relate the same
        way (equal where these were equal, 1 where these were 1), so decoding step after step is checked once.

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
        if cu_seqlens is not None or (kv_cache is not None and isinstance(kv_cache, PagedKVCache)):  # serving
            return serving_forward(self, query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   is_causal=is_causal, need_weights=need_weights, kv_cache=kv_cache,
                                   positions=positions, cu_seqlens=cu_seqlens)  # fmt: skip
        key = query if key is None else key
        value = key if value is None else value
        call = (query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, kv_cache, positions)
        jit_tracing = torch.jit.is_tracing()  # pyright: ignore[reportPrivateImportUsage]
        path, fused = choose_path(self, *call, jit_tracing=jit_tracing)

        def checked(check: bool, observer: Any) -> Any:
            with quiet_jit_tracer() if jit_tracing else contextlib.nullcontext():
                return self._checked(check, observer, path, fused, *call)

        return remembered_forward(
            self._verdicts,
            self._constants,
            lambda: None if jit_tracing else forward_key(self, path, fused, *call),
            kv_cache if isinstance(kv_cache, KVCache) else None,
            lambda: self._run(RAW, path, fused, *call),
            checked,
            current_observer(),
        )

    def _checked(self, check: bool, observer: Any, *call: Any) -> Any:
        """The forward with every stage checked against one memo, and reported to the trace (`checked_forward`)."""
        return checked_forward(self, *_FORWARD, check, observer, *call)

    _run = run  # the forward by this module's plan (`plan.run`), with `s` its stages, checked or plain


_CACHES = (KVCache, PagedKVCache)  # the caches a call writes, restored if a hook raises after it (`call_restoring`)
_FORWARD = forward_stage(MultiHeadAttention.forward)  # the stage, its hints without a cache and with one
