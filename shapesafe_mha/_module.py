"""`MultiHeadAttention`: the module, for MHA, GQA and MQA, checked once per call."""

from typing import Any, cast

import torch
from torch import Tensor, nn

from ._cache import KVCache
from ._check import Mismatch, checked, checks_enabled, mismatch
from ._dims import AttnMask, CacheBuffer, KVTokens, Memory, PaddingMask, Tokens
from ._errors import ConfigError, ShapeError
from ._stages import (
    _attend,
    _attend_with_weights,
    _masking,
    _merge_heads,
    _project,
    _split_heads,
    check_groups,
    explain_mask,
)
from ._trace import record, tracing_active
from ._weights import AttentionWeights


def _precheck_forward(arguments: dict[str, Any]) -> None:
    """Inputs in the module's dtype and on its device; masks on its device."""
    dtype, device = arguments["dtype"], arguments["device"]
    for name in ("query", "key", "value", "kv_cache"):
        tensor = arguments.get(name)
        if not isinstance(tensor, Tensor):
            continue
        if tensor.dtype != dtype:
            raise mismatch(
                f"{name} has dtype {str(tensor.dtype)[6:]}, but the module's parameters are {str(dtype)[6:]}; "
                + (
                    f"cast the input ({name}.to({dtype})) or the module (module.to({tensor.dtype}))."
                    if tensor.is_floating_point()
                    else f"inputs must be floating point: {name}.to({dtype})."
                )
            )
        if tensor.device != device:
            raise mismatch(
                f"{name} is on {tensor.device}, but the module's parameters are on {device}; "
                f"move one of them ({name}.to('{device}') or module.to('{tensor.device}'))."
            )
    for name in ("attn_mask", "key_padding_mask"):
        mask = arguments[name]
        if isinstance(mask, Tensor) and mask.device != device:
            raise mismatch(f"{name} is on {mask.device}, but the module's parameters are on {device}.")
        if isinstance(mask, Tensor) and mask.is_floating_point() and mask.dtype != dtype and name == "attn_mask":
            raise mismatch(
                f"attn_mask has dtype {str(mask.dtype)[6:]}; a float mask is added to the scores, so it must be "
                f"{str(dtype)[6:]} like the module (or bool: True = may attend)."
            )


def _explain_forward(arguments: dict[str, Any], failure: Mismatch) -> str | None:
    if failure.arg == "value" and failure.dim in ("kv_seq", "new"):
        return "key and value must cover the same positions."
    if failure.arg in ("key", "value") and failure.dim == "batch":
        return f"{failure.arg} needs one sequence per query sequence."
    if failure.arg == "key_padding_mask" and failure.dim is None:
        return "key_padding_mask is (batch, kv_seq) bool, True = padding."
    return explain_mask(arguments, failure)


_CONTRACT: dict[str, Any] = {
    "precheck": _precheck_forward,
    "explain": _explain_forward,
    "name": "MultiHeadAttention.forward()",
    "sources": {
        "d_model": "the module",
        "num_kv_heads": "the module",
        "d_head": "the module",
        "kv_seq": "the cache plus key",
    },
}


@checked(**_CONTRACT)
def _forward_contract(
    d_model: int,
    query: Tokens,
    key: Memory,
    value: Memory,
    attn_mask: AttnMask | None,
    key_padding_mask: PaddingMask | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """What `MultiHeadAttention.forward` checks without a cache (once per signature)."""


@checked(**_CONTRACT)
def _cached_forward_contract(
    d_model: int,
    num_kv_heads: int,
    d_head: int,
    query: Tokens,
    key: KVTokens,
    value: KVTokens,
    kv_cache: CacheBuffer,
    kv_seq: int | None,
    attn_mask: AttnMask | None,
    key_padding_mask: PaddingMask | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """What `MultiHeadAttention.forward` checks with a cache (once per signature; the fill level every call)."""


# Up to this many positions torch's fused MHA kernel is as fast as our fused-QKV + SDPA path or
# faster; beyond it SDPA's flash kernel wins (measured on CPU: 0.82x of the kernel's time at 256).
_NATIVE_MAX_SEQ = 128


def _unshare_qkv(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Save q/k/v parameters as tensors of their own (safetensors refuses tensors that share storage)."""
    for name in ("q_proj", "k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            key = f"{prefix}{name}.{kind}"
            if key in state_dict:
                state_dict[key] = state_dict[key].clone()


def _positive(owner: str, **sizes: Any) -> None:
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"{owner}: {name} must be a positive int, but got {size!r}.")


def _shown(values: list[int]) -> str:
    return "{" + ", ".join(map(str, values[:5])) + (", ...}" if len(values) > 5 else "}")


class MultiHeadAttention(nn.Module):
    """Multi-head attention with MHA, GQA and MQA by configuration, batch-first, checked.

    `o_proj(merge_heads(attention(split_heads(q_proj(x)), split_heads(k_proj(x)), split_heads(v_proj(x)))))`.
    The four projections are `nn.Linear` submodules named `q_proj, k_proj, v_proj, o_proj`, so
    checkpoints in that common layout load directly. Every call is checked once at this boundary
    (then the verdict is remembered for calls of the same shapes); the stages run unchecked inside.

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
        device, dtype: of the parameters.

    Raises:
        ConfigError: the sizes are not positive, `num_kv_heads` does not divide `num_heads`, or
            `d_head` is not given and `num_heads` does not divide `d_model`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        d_head: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        owner = f"MultiHeadAttention(d_model={d_model}, num_heads={num_heads}, num_kv_heads={num_kv_heads})"
        _positive(owner, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if num_kv_heads > num_heads:
            raise ConfigError(
                f"{owner}: num_kv_heads={num_kv_heads} is more than num_heads={num_heads}; each KV head serves "
                f"a group of query heads, so num_kv_heads must divide num_heads (MQA: 1, MHA: {num_heads})."
            )
        check_groups(num_heads, num_kv_heads, owner)
        if d_head is None:
            if d_model % num_heads:
                divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
                raise ConfigError(
                    f"{owner}: d_model must be num_heads * d_head, and {d_model} is not divisible by {num_heads}; "
                    f"pass d_head explicitly or use num_heads in {_shown(divisors)}."
                )
            d_head = d_model // num_heads
        _positive(owner, d_head=d_head)
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"{owner}: dropout must be in [0, 1), but got {dropout}.")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.d_head = d_head
        self.group = num_heads // num_kv_heads
        self.dropout = dropout
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, num_heads * d_head, bias=bias, **factory)
        self.k_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias, **factory)
        self.v_proj = nn.Linear(d_model, num_kv_heads * d_head, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * d_head, d_model, bias=bias, **factory)
        self._fuse_qkv()
        self.register_state_dict_post_hook(_unshare_qkv)

    def _fuse_qkv(self) -> None:
        """Lay the q/k/v weights (and biases) end to end in one storage; the parameters become views of it.

        Nothing changes for users (q_proj.weight is still q_proj's parameter, loads and optimizers
        update it in place), but self-attention without autograd can then project Q, K and V with
        one matrix multiply instead of three, as torch's own fast path does.
        """
        projs = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj}
        with torch.no_grad():
            weight = torch.cat([p.weight.detach() for p in projs.values()])
            biases = [p.bias.detach() for p in projs.values() if p.bias is not None]
            bias = torch.cat(biases) if len(biases) == 3 else None
            start, expected = 0, []
            for name, p in projs.items():
                rows = slice(start, start + p.weight.shape[0])
                p.weight.data = weight[rows]
                expected.append((name, "weight", p.weight.data_ptr()))
                if p.bias is not None and bias is not None:
                    p.bias.data = bias[rows]
                    expected.append((name, "bias", p.bias.data_ptr()))
                start = rows.stop
        self._qkv: tuple[Tensor, Tensor | None, tuple[tuple[str, str, int], ...]] = (weight, bias, tuple(expected))

    def _fused_qkv(self) -> tuple[Tensor, Tensor | None] | None:
        """The fused q/k/v weight and bias, if the parameters still are views of them (else None)."""
        weight, bias, expected = self._qkv
        modules = self._modules  # plain dict lookups: this runs on every inference call
        for name, kind, pointer in expected:
            param = modules[name]._parameters.get(kind)  # pyright: ignore[reportOptionalMemberAccess]
            if param is None or param.data_ptr() != pointer:
                return None
        return weight, bias

    def _native_fits(self, query: Tensor) -> bool:
        """Whether torch's fused MHA kernel computes this call: MHA, num_heads * d_head == d_model, biases,
        no dropout, a short sequence, a dtype and device it supports, and nobody tracing the stages."""
        return (
            self.num_kv_heads == self.num_heads
            and self.num_heads * self.d_head == self.d_model
            and self._qkv[1] is not None
            and self.o_proj.bias is not None
            and (self.dropout == 0.0 or not self.training)
            and query.shape[1] <= _NATIVE_MAX_SEQ
            and query.dtype in (torch.float32, torch.float64)
            and query.device.type in ("cpu", "cuda")
            and not tracing_active()
        )

    def _native(self, query: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """Exactly what nn.MultiheadAttention's inference fast path runs: torch's fused MHA kernel."""
        kernel = torch._native_multi_head_attention  # pyright: ignore[reportPrivateImportUsage]
        out_weight, out_bias = self.o_proj.weight, self.o_proj.bias
        return kernel(
            query, query, query, self.d_model, self.num_heads, weight, bias, out_weight, out_bias, None, False
        )[0]

    def _apply(self, fn: Any, recurse: bool = True) -> "MultiHeadAttention":
        # .to(), .half(), .cuda() give each parameter new storage: fuse them again.
        super()._apply(fn, recurse)
        self._fuse_qkv()
        return self

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"d_head={self.d_head}, dropout={self.dropout}"
        )

    @property
    def bias(self) -> bool:
        return self.q_proj.bias is not None

    def weights(self) -> AttentionWeights:
        """The parameters as an `AttentionWeights` (the parameters themselves, not copies)."""
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

    @classmethod
    def from_weights(
        cls, weights: AttentionWeights, *, num_heads: int, num_kv_heads: int | None = None, dropout: float = 0.0
    ) -> "MultiHeadAttention":
        """A module holding copies of `weights` (on their device, in their dtype).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> a = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2)
            >>> b = ssm.MultiHeadAttention.from_weights(a.weights(), num_heads=4, num_kv_heads=2)
            >>> x = torch.randn(1, 3, 16)
            >>> torch.equal(a(x), b(x))
            True

        Raises:
            ConfigError, ShapeError: the weights do not fit the head counts.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        d_head = weights.check(num_heads, num_kv_heads)
        module = cls(
            weights.d_model,
            num_heads,
            num_kv_heads,
            d_head=d_head,
            bias=weights.bias,
            dropout=dropout,
            device=weights.w_q.device,
            dtype=weights.w_q.dtype,
        )
        with torch.no_grad():
            for name, proj in (("q", module.q_proj), ("k", module.k_proj), ("v", module.v_proj), ("o", module.o_proj)):
                proj.weight.copy_(getattr(weights, f"w_{name}"))
                bias = getattr(weights, f"b_{name}")
                if proj.bias is not None and bias is not None:
                    proj.bias.copy_(bias)
        return module

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A `KVCache` that fits this module: its KV heads, `d_head`, dtype and device."""
        weight = self.k_proj.weight
        return KVCache(batch, self.num_kv_heads, capacity, self.d_head, dtype=weight.dtype, device=weight.device)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from `query` to `key`/`value` (default: `query`, self-attention).

        Arguments:
            query: `(batch, seq, d_model)`.
            key, value: `(batch, kv_seq, d_model)`; with a `kv_cache`, the new positions only.
            attn_mask: `(seq, kv_seq)` or `(#batch, #num_heads, seq, kv_seq)`; bool (True = may
                attend) or float (added to the scores). With a cache, `kv_seq` counts every
                cached position plus the new ones.
            key_padding_mask: `(batch, kv_seq)` bool, True = padding (ignored), as in
                `nn.MultiheadAttention`.
            is_causal: mask future positions, lower-right aligned (query `i` is position
                `kv_seq - seq + i`), so prefill and decoding with a cache agree.
            need_weights: also return the per-head probabilities `(batch, num_heads, seq, kv_seq)`.
            kv_cache: append this call's keys and values to it and attend over all it holds.

        Returns:
            `(batch, seq, d_model)`, or `(output, weights)` with `need_weights=True`. A query
            with nothing to attend to gets zeros (never NaN), in outputs and gradients.

        Raises:
            ShapeError: any input does not fit the module, the others or the cache; nothing
                (parameters, cache) is changed.
        """
        key = query if key is None else key
        value = key if value is None else value
        if checks_enabled():
            self._check(query, key, value, attn_mask, key_padding_mask, kv_cache)
        record("query", "batch seq d_model", query)
        fused = None
        if key is query and value is query and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            fused = self._fused_qkv()
            plain = attn_mask is None and key_padding_mask is None and kv_cache is None
            if fused is not None and fused[1] is not None and plain and not (is_causal or need_weights):
                if self._native_fits(query):
                    return self._native(query, fused[0], fused[1])

        if fused is not None:
            qkv = _project(query, *fused)
            record("qkv_proj", "batch seq (num_heads+2*num_kv_heads)*d_head", qkv)
            kv_width = self.num_kv_heads * self.d_head
            q, k, v = qkv.split([self.num_heads * self.d_head, kv_width, kv_width], dim=-1)
        else:
            q = _project(query, self.q_proj.weight, self.q_proj.bias)
            k = _project(key, self.k_proj.weight, self.k_proj.bias)
            v = _project(value, self.v_proj.weight, self.v_proj.bias)
        record("q_proj", "batch seq num_heads*d_head", q)
        record("k_proj", "batch kv_seq num_kv_heads*d_head", k)
        record("v_proj", "batch kv_seq num_kv_heads*d_head", v)
        q = _split_heads(q, self.num_heads)
        record("split_q", "batch num_heads seq d_head", q)
        k = _split_heads(k, self.num_kv_heads)
        record("split_k", "batch num_kv_heads kv_seq d_head", k)
        v = _split_heads(v, self.num_kv_heads)
        record("split_v", "batch num_kv_heads kv_seq d_head", v)
        if kv_cache is not None:
            k, v = kv_cache._append(k, v)
            record("cache_k", "batch num_kv_heads kv_seq d_head", k)
            record("cache_v", "batch num_kv_heads kv_seq d_head", v)
        masking = _masking(attn_mask, key_padding_mask, is_causal, q, k, explicit=need_weights)
        if masking.mask is not None:
            record("mask", "#batch #num_heads seq kv_seq", masking.mask)
        dropout_p = self.dropout if self.training else 0.0
        weights: Tensor | None = None
        if need_weights:
            out, weights = _attend_with_weights(q, k, v, masking, None, dropout_p)
        else:
            out = _attend(q, k, v, masking, None, dropout_p)
        out = _merge_heads(out)
        record("merge", "batch seq num_heads*d_head", out)
        out = _project(out, self.o_proj.weight, self.o_proj.bias)
        record("o_proj", "batch seq d_model", out)
        return out if weights is None else (out, weights)

    def _check(
        self,
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any,
        key_padding_mask: Any,
        kv_cache: KVCache | None,
    ) -> None:
        # Plain dict lookups (nn.Module.__getattr__ costs ~1 us per step): this runs on every call.
        weight = cast(Tensor, self._modules["q_proj"]._parameters["weight"])  # pyright: ignore[reportOptionalMemberAccess]
        if kv_cache is None:
            _forward_contract(self.d_model, query, key, value, attn_mask, key_padding_mask, weight.dtype, weight.device)
            return
        if not isinstance(kv_cache, KVCache):
            raise ShapeError(
                f"MultiHeadAttention.forward(): kv_cache must be a shapesafe_mha.KVCache, but got "
                f"{type(kv_cache).__name__}; make one with module.new_cache(batch, capacity)."
            )
        masked = attn_mask is not None or key_padding_mask is not None
        kv_seq = len(kv_cache) + key.shape[1] if masked and isinstance(key, Tensor) and key.ndim == 3 else None
        _cached_forward_contract(
            self.d_model,
            self.num_kv_heads,
            self.d_head,
            query,
            key,
            value,
            kv_cache.keys_buffer,
            kv_seq,
            attn_mask,
            key_padding_mask,
            weight.dtype,
            weight.device,
        )
        cache, new = kv_cache, key.shape[1]
        if len(cache) + new > cache.capacity:
            raise ShapeError(
                f"MultiHeadAttention.forward(): appending new={new} positions to the {len(cache)} in kv_cache "
                f"would exceed its capacity={cache.capacity}; make a larger cache or reset() this one."
            )

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiHeadAttention":
        """A `MultiHeadAttention` computing what `module` computes (batch-first, whatever `module.batch_first`).

        Masks translate as: our bool `attn_mask` is True where attending is allowed, torch's
        module's is True where it is *forbidden*; `key_padding_mask` means the same in both.

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
            >>> ours = ssm.MultiHeadAttention.from_torch(theirs)
            >>> x = torch.randn(2, 5, 32)
            >>> bool(torch.allclose(ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6))
            True

        Raises:
            ConfigError: `module` uses features without an equivalent here (`kdim`/`vdim`,
                `add_bias_kv`, `add_zero_attn`).
        """
        if not module._qkv_same_embed_dim:
            raise ConfigError(
                "MultiHeadAttention.from_torch(): modules with kdim or vdim != embed_dim are not supported."
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ConfigError("MultiHeadAttention.from_torch(): add_bias_kv and add_zero_attn are not supported.")
        weight = module.in_proj_weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            for proj, w in zip((ours.q_proj, ours.k_proj, ours.v_proj), weight.chunk(3), strict=True):
                proj.weight.copy_(w)
            ours.o_proj.weight.copy_(module.out_proj.weight)
            if module.in_proj_bias is not None:
                for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), module.in_proj_bias.chunk(3), strict=True):
                    proj.bias.copy_(b)  # pyright: ignore[reportOptionalMemberAccess]  (built with bias above)
                ours.o_proj.bias.copy_(module.out_proj.bias)  # pyright: ignore[reportOptionalMemberAccess]
        return ours

    def to_torch(self) -> nn.MultiheadAttention:
        """An equivalent `nn.MultiheadAttention(batch_first=True)`; MHA with `num_heads*d_head == d_model` only.

        Raises:
            ConfigError: the configuration has no `nn.MultiheadAttention` equivalent (GQA/MQA, or
                `num_heads * d_head != d_model`).
        """
        if self.num_kv_heads != self.num_heads or self.num_heads * self.d_head != self.d_model:
            raise ConfigError(
                f"MultiHeadAttention.to_torch(): nn.MultiheadAttention has no GQA/MQA and needs num_heads * d_head "
                f"== d_model, but this module has num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"d_head={self.d_head}, d_model={self.d_model}."
            )
        weight = self.q_proj.weight
        theirs = nn.MultiheadAttention(
            self.d_model,
            self.num_heads,
            dropout=self.dropout,
            bias=self.bias,
            batch_first=True,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            theirs.in_proj_weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            theirs.out_proj.weight.copy_(self.o_proj.weight)
            if self.bias:
                biases = [p.bias for p in (self.q_proj, self.k_proj, self.v_proj)]
                theirs.in_proj_bias.copy_(torch.cat([b for b in biases if b is not None]))
                theirs.out_proj.bias.copy_(self.o_proj.bias)
        return theirs
