"""`MultiHeadAttention`: the module, for MHA, GQA and MQA, composed of checked stages."""

import contextlib
import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from .._compute.cache import KVCache
from .._compute.fastpath import FusedQKV, call_restoring, choose_path, pack_qkv, tensor_kind
from .._compute.packed import serving_forward
from .._compute.paged import PagedKVCache
from .._compute.rotary import RotaryEmbedding
from .._compute.stages import check_float_dtype
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
from .config import (
    BUILT_FROM,
    HELD_AS,
    HELD_BY_PARTS,
    OPTIONS,
    SIZED,
    SIZES,
    AttentionConfig,
    bind,
    constructor_of,
)
from .contract import checked_forward, forward_key, forward_stage, quiet_jit_tracer
from .conversions import Conversions
from .plan import (
    PARTS,
    RAW,
    TENSORS,
    Guarded,
    part_misfit,
    plan,
    qk_norm_modules,
    rotary_of,
    run,
    variant_tensors,
)

# What a built module derives from its sizes and options (`_derive`, `AttentionConfig.score_scale`): set, it would
# be undone by the next derivation, or disagree with the path that does not read it (torch's fused kernel).
DERIVED = {
    "scale": "query_pre_attn_scalar (query_pre_attn_scalar ** -0.5; None: 1 / sqrt(d_head))",
    "group": "num_heads // num_kv_heads",
    "native_shape": "the sizes and options (whether torch's fused kernel computes them)",
}


@dataclasses.dataclass(frozen=True)
class _Options(AttentionConfig):
    """The constructor's parameters: the config's fields, then where the parameters are made."""

    device: torch.device | str | None = dataclasses.field(default=None, kw_only=True)
    dtype: torch.dtype | None = dataclasses.field(default=None, kw_only=True)


class MultiHeadAttention(Conversions, Guarded):
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

    Its keywords are `AttentionConfig`'s fields, described there (the signature is derived from them), and
    `device`, `dtype` of the parameters: `d_model`, the width of inputs and outputs; `num_heads`, query heads;
    `num_kv_heads`, key/value heads (None: `num_heads`, MHA; 1: MQA; any divisor of `num_heads`: GQA), these three
    by position too; `d_head`, each head's width (default `d_model // num_heads`, which must then divide); and
    every variant (RoPE, QK-norm, windows, softcapping, sinks, ALiBi, an output gate, ...).

    Raises:
        ConfigError: a size or an option out of its range, or contradicting another (see `AttentionConfig`).
    """

    alibi_slopes: Tensor | None  # ALiBi's slopes, one per query head (a buffer; None without ALiBi)
    sinks: nn.Parameter | None  # attention sinks' logits, one per query head (None without)
    rotary: RotaryEmbedding | None
    window: int | None  # an option, held under its name (as each of `AttentionConfig`'s)
    d_model: int  # the sizes, resolved; each option is held under its own name too (`AttentionConfig.held`)
    num_heads: int
    num_kv_heads: int
    d_head: int
    group: int
    dropout: float
    scale: float | None  # the scores' scale the options fix (`AttentionConfig.score_scale`; None: 1/sqrt(d_head))
    native_shape: bool  # derived (`_derive`): torch's fused MHA kernel fits these sizes and options
    _qkv_rows: tuple[int, int, int]
    _constants: frozenset[int]

    @constructor_of(_Options)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        options = bind("MultiHeadAttention", _Options, args, kwargs)
        factory = {"device": options.pop("device"), "dtype": options.pop("dtype")}
        config = AttentionConfig(**options)
        check_float_dtype(config.owner, factory["dtype"])
        self._build(config, factory)

    def _build(self, config: AttentionConfig, factory: dict[str, Any]) -> None:
        """The submodules, parameters and attributes `config` describes (validated when it was made)."""
        c = config
        d_model, num_heads, num_kv_heads, d_head = c.d_model, c.num_heads, c.kv_heads, c.head_width
        self.group = num_heads // num_kv_heads
        for name, value in c.held().items():  # each option held under its own name, as it is held
            setattr(self, name, value)
        self.scale = c.score_scale
        self.q_proj = nn.Linear(d_model, c.query_rows, bias=c.bias, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=c.bias, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=c.bias, **factory)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=c.bias, **factory)
        pack_qkv(self.q_proj, self.k_proj, self.v_proj)  # one storage, viewed whole by the fused path
        self.rotary = rotary_of(c, factory["device"])
        for name, norm in qk_norm_modules(c, factory).items():
            self.add_module(name, norm)
        parameters, buffers = variant_tensors(c, factory)
        for name, parameter in parameters.items():
            setattr(self, name, parameter)
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer)
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
        return AttentionConfig(
            **{name: HELD_BY_PARTS[name](self) if name in HELD_BY_PARTS else getattr(self, name) for name in OPTIONS}
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
            | {size for size in (getattr(self, name) for name in SIZED) if size is not None}
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

    _GUARDED, _BUILT = frozenset((*PARTS, *TENSORS, *OPTIONS, *DERIVED)), "_fused"  # (`Guarded`)

    def __setattr__(self, name: str, value: Any) -> None:
        # A projection replaced (PEFT wraps and later unwraps them): forget the fused view of the old ones. A size,
        # an option or a tensor of the module's own set (head pruning, sinks or ALiBi slopes loaded another way): derive
        # what they fix again, and forget what was remembered under the old ones.
        built = "_fused" in self.__dict__  # (not while __init__ sets them)
        if built and name in DERIVED and value != getattr(self, name):
            raise ConfigError(
                f"MultiHeadAttention: {name} cannot be set: it is derived from {DERIVED[name]}, and follows it. Set "
                "that, or build the module you want: MultiHeadAttention.from_config(dataclasses.replace(module.config, "
                "...))."
            )
        if built and name in PARTS and (why := part_misfit(self._described(), name, value)) is not None:
            raise ConfigError(
                f"MultiHeadAttention: {name} cannot be replaced by this one: {why}. Build the module that has it: "
                "MultiHeadAttention.from_config(dataclasses.replace(module.config, ...)), then load its state_dict."
            )
        if built and name in OPTIONS and name not in SIZES:
            described = self._described()
            changed = dataclasses.replace(described, **{name: value})  # validated as at construction (ConfigError)
            if name in BUILT_FROM and changed == described:  # (the value it has: nothing to change)
                return
            if name in BUILT_FROM:
                raise ConfigError(
                    f"MultiHeadAttention: {name} cannot be set on a built module: its {BUILT_FROM[name]} "
                    f"{'were' if BUILT_FROM[name].endswith('s') else 'was'} built from it. Build one that has it: "
                    f"MultiHeadAttention.from_config(dataclasses.replace(module.config, {name}={value!r})), then "
                    "load_state_dict(module.state_dict())."
                )
            value = HELD_AS[name](value) if name in HELD_AS else value
            if changed.score_scale != described.score_scale:  # the scores' scale it fixes
                self.__dict__["scale"] = changed.score_scale
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
        dtype, device = tensor_kind(self, self.k_proj)
        return KVCache(batch, self.num_kv_heads, capacity, self.d_head, dtype=dtype, device=device, window=self.window)

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
        cache = kv_cache if kv_cache is None or isinstance(kv_cache, KVCache) else None  # (one isinstance a call)
        if cu_seqlens is not None or (cache is not kv_cache and isinstance(kv_cache, PagedKVCache)):  # serving
            return serving_forward(self, query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   is_causal=is_causal, need_weights=need_weights, kv_cache=kv_cache,
                                   positions=positions, cu_seqlens=cu_seqlens)  # fmt: skip
        key = query if key is None else key
        value = key if value is None else value
        call: tuple[Any, ...] = (
            query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, kv_cache, positions
        )  # fmt: skip
        jit_tracing = torch.jit.is_tracing()  # pyright: ignore[reportPrivateImportUsage]
        compiling = torch.compiler.is_compiling()  # (asked once: the path and the checks both read it)
        path, fused = choose_path(self, *call, jit_tracing=jit_tracing, compiling=compiling)

        def checked(check: bool, observer: Any) -> Any:
            with quiet_jit_tracer() if jit_tracing else contextlib.nullcontext():
                return self._checked(check, observer, path, fused, *call)

        return remembered_forward(
            self._verdicts,
            self._constants,
            lambda: None if jit_tracing else forward_key(self, path, fused, *call),
            cache,
            lambda: self._run(RAW, path, fused, *call),
            checked,
            current_observer(),
            compiling,
        )

    def _checked(self, check: bool, observer: Any, *call: Any) -> Any:
        """The forward with every stage checked against one memo, and reported to the trace (`checked_forward`)."""
        return checked_forward(self, *_FORWARD, check, observer, *call)

    _run = run  # the forward by this module's plan (`plan.run`), with `s` its stages, checked or plain


_CACHES = (KVCache, PagedKVCache)  # the caches a call writes, restored if a hook raises after it (`call_restoring`)
_FORWARD = forward_stage(MultiHeadAttention.forward)  # the stage, its hints without a cache and with one
