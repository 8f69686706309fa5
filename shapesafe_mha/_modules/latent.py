"""`LatentAttention`: multi-head latent attention (MLA, DeepSeek-V2/V3), composed of checked stages.

Queries pass a low-rank bottleneck (`q_lora_rank`); keys and values are rebuilt per head from one
latent of width `kv_lora_rank` shared by every head, and each query/key head is a `d_nope` part
without RoPE and a `d_rope` part with it, the rotary key being one for all heads. Only the latent and
the rotary key are cached: `kv_lora_rank + d_rope` numbers per position and sequence, where a K/V
cache at every head holds `num_heads * (d_nope + d_rope + d_value)`.

A prefill rebuilds every head's keys and values from the latent (`kv_b_proj`); a decoding step absorbs
`kv_b_proj` into the query and the output instead and attends the cached buffer as it is, where that is
provably the same computation (see `LatentAttention._absorbs`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.fastpath import (
    call_restoring,
    global_hooks,
    module_state,
    plain_linear,
    refuse_under_vmap,
    tensor_kind,
)
from .._compute.packed import serving_forward
from .._compute.paged import PagedKVCache
from .._compute.rotary import RotaryEmbedding, default_positions
from .._compute.stages import (
    autocast_dtype,
    autocast_on,
    check_cache,
    explain_mask,
    positive_count,
    precheck_masks,
    torch_norm_agrees,
)
from .._core.contract import CallKey, Session, Stage, Verdicts, raw, remembered_forward, stage, witness
from .._core.dims import (
    AbsorbedOut,
    AbsorbedQueries,
    AttnMask,
    CacheEntries,
    CompressedKV,
    CuSeqlens,
    ExpandedKV,
    Latent,
    LatentBuffer,
    LatentKeyHeads,
    LatentMask,
    LatentMerged,
    LatentOutHeads,
    LatentQueries,
    LatentQueryHeads,
    LatentSizes,
    LatentUpWeight,
    LatentValues,
    NewLatent,
    NewRopeKey,
    NopeQueries,
    PaddingMask,
    Positions,
    QueryBottleneck,
    RopeKey,
    RopeQueries,
    RopeTable,
    Tokens,
    ValueHeads,
)
from .._core.errors import ConfigError, ShapeError
from .._core.messages import dtype_name, mismatch
from .._core.trace import current_observer
from .config import bind, constructor_of, copied, parts_eps
from .latent_config import LATENT_BUILT_FROM, LATENT_OPTIONS, LATENT_SIZES, LatentConfig
from .plan import Guarded, misfit

_OWNER = "LatentAttention.forward()"


class LatentCache:
    """The latent and the rotary key of past positions: all multi-head latent attention caches.

    One buffer `(batch, capacity, kv_lora_rank + d_rope)`: per position, the latent every head's keys
    and values are rebuilt from, and the one rotary key all heads share (already rotated).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> mla = ssm.LatentAttention(64, 8, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
        >>> cache = mla.new_cache(batch=2, capacity=32)
        >>> cache.buffer.shape, cache.nbytes
        (torch.Size([2, 32, 20]), 5120)

    Arguments:
        batch, capacity: sequences, and positions the cache can hold.
        kv_lora_rank, d_rope: the latent's width and the rotary key's.
        dtype, device: the buffer's.
    """

    buffer: LatentBuffer

    def __init__(
        self,
        batch: int,
        capacity: int,
        kv_lora_rank: int,
        d_rope: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        for name, size in (
            ("batch", batch),
            ("capacity", capacity),
            ("kv_lora_rank", kv_lora_rank),
            ("d_rope", d_rope),
        ):
            positive_count("LatentCache(): ", name, size)
        self.kv_lora_rank = kv_lora_rank
        self.buffer = torch.zeros(batch, capacity, kv_lora_rank + d_rope, dtype=dtype, device=device)
        self._length = 0

    @property
    def batch(self) -> int:
        return self.buffer.shape[0]

    @property
    def capacity(self) -> int:
        return self.buffer.shape[1]

    @property
    def d_rope(self) -> int:
        return self.buffer.shape[2] - self.kv_lora_rank

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (what the cache holds, filled or not)."""
        return self.buffer.numel() * self.buffer.element_size()

    def __len__(self) -> int:
        return self._length

    @property
    def seen(self) -> int:
        """`len(self)`, as a size that may stay symbolic under `torch.export` (`len()` must make it an int)."""
        return self._length

    def __repr__(self) -> str:
        return (
            f"LatentCache(batch={self.batch}, capacity={self.capacity}, kv_lora_rank={self.kv_lora_rank}, "
            f"d_rope={self.d_rope}, dtype={self.dtype}, device={self.device}, filled={self._length})"
        )

    def reset(self) -> None:
        """Empty the cache (the buffer is kept; any autograd graph through it is dropped)."""
        self._length = 0
        self.buffer = self.buffer.detach()

    def latent(self) -> Latent:
        """A view of the cached latent, `(batch, len(self), kv_lora_rank)`."""
        return self.buffer[:, : self._length, : self.kv_lora_rank]

    def rope_keys(self) -> RopeKey:
        """A view of the cached rotary keys, `(batch, 1, len(self), d_rope)`: one for every head."""
        return self.buffer[:, None, : self._length, self.kv_lora_rank :]

    def entries(self) -> CacheEntries:
        """A view of everything cached, `(batch, 1, len(self), kv_lora_rank + d_rope)`: absorbed decoding's keys."""
        return self.buffer[:, None, : self._length]

    def write(self, latent: Tensor, k_rope: Tensor, owner: str) -> tuple[Tensor, Tensor]:
        """Append without checking shapes (the capacity is always checked); views of all cached."""
        start, end = self._length, self._length + latent.shape[1]
        refuse_under_vmap(latent, owner)
        if end > self.capacity:
            raise ShapeError(
                f"{owner}: appending new={latent.shape[1]} positions to the {start} in kv_cache would exceed its "
                f"capacity={self.capacity}; make a larger cache or reset() this one."
            )
        # out of place also without grad while the buffer is in a graph: an earlier step's backward reads it
        tracked = self.buffer.requires_grad or (
            torch.is_grad_enabled() and (latent.requires_grad or k_rope.requires_grad)
        )
        if not torch.compiler.is_compiling() and self.buffer.is_inference() and not torch.is_inference_mode_enabled():
            self.buffer = self.buffer.clone()  # filled under torch.inference_mode: no in-place write outside it
        if tracked:  # out of place: earlier steps' graphs keep the buffer they saw
            entry = torch.cat((latent, k_rope[:, 0]), dim=-1)
            self.buffer = torch.slice_scatter(self.buffer, entry, dim=1, start=start, end=end)
        else:
            self.buffer[:, start:end, : self.kv_lora_rank] = latent
            self.buffer[:, start:end, self.kv_lora_rank :] = k_rope[:, 0]
        self._length = end
        return self.latent(), self.rope_keys()

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "LatentCache":
        """Move the buffer (and what it holds) to `dtype` and/or `device`, in place; return the cache."""
        self.buffer = self.buffer.to(device=device, dtype=dtype)
        return self

    def state(self) -> tuple[Tensor, int]:
        return self.buffer, self._length

    def restore(self, state: tuple[Tensor, int]) -> None:
        self.buffer, self._length = state


# --- stages ------------------------------------------------------------------------------------------


def _bottleneck_norm_agrees(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    torch_norm_agrees(arguments["q_a_norm"], "q_a_layernorm")


def _latent_norm_agrees(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    torch_norm_agrees(arguments["kv_a_norm"], "kv_a_layernorm")


@stage(name="q_a_proj", public=("query",), validate=_bottleneck_norm_agrees)
def compress_query(q_a_proj: nn.Module, q_a_norm: nn.Module, query: Tokens) -> QueryBottleneck:
    """Queries into the low-rank bottleneck, RMS-normalised (DeepSeek's `q_a_layernorm`)."""
    return q_a_norm(q_a_proj(query))


@stage(name="q_b_proj")
def expand_query(q_b_proj: nn.Module, bottleneck: QueryBottleneck) -> LatentQueries:
    return q_b_proj(bottleneck)


@stage(name="q_proj", public=("query",))
def project_latent_query(q_proj: nn.Module, query: Tokens) -> LatentQueries:
    """Without a bottleneck (`q_lora_rank=None`): one projection."""
    return q_proj(query)


@stage(name="split_q", trace=("q_nope", "q_rope"))
def split_latent_query(q: LatentQueries, num_heads: int, d_nope: int) -> tuple[NopeQueries, RopeQueries]:
    """Heads, each a part without RoPE and a rotary part: views."""
    heads = K.split_heads(q, num_heads)
    return heads[..., :d_nope], heads[..., d_nope:]


@stage(name="kv_a_proj", public=("query",))
def compress_kv(kv_a_proj: nn.Module, query: Tokens) -> CompressedKV:
    """The latent and the shared rotary key, projected at once (`kv_a_proj_with_mqa`)."""
    return kv_a_proj(query)


@stage(name="latent", trace=("latent", "k_rope"), validate=_latent_norm_agrees)
def split_latent(compressed: CompressedKV, kv_a_norm: nn.Module, kv_lora_rank: int) -> tuple[NewLatent, NewRopeKey]:
    """The latent RMS-normalised; the rotary key as one head for all (a view)."""
    return kv_a_norm(compressed[..., :kv_lora_rank]), compressed[:, None, :, kv_lora_rank:]


@stage(name="rotary", trace=("", ""), public=("positions",))
def latent_rotary_tables(rotary: nn.Module, positions: Positions, q: RopeQueries) -> tuple[RopeTable, RopeTable]:
    return rotary(positions, q.dtype)


@stage(name="rotate", trace=("rotary_q", "rotary_k"))
def rotate_latent(
    q: RopeQueries, k: NewRopeKey, cos: RopeTable, sin: RopeTable, interleaved: bool
) -> tuple[RopeQueries, NewRopeKey]:
    """RoPE on the rotary parts only; `interleaved` pairs features `(2i, 2i+1)` (DeepSeek's checkpoints)."""
    if interleaved:
        q, k = K.deinterleave(q), K.deinterleave(k)
    return K.rotate(q, cos, sin), K.rotate(k, cos, sin)


@stage(name="keys", trace=("", ""), sources={"result": "the new latent"})
def attend_to_new_latent(latent: NewLatent, k_rope: NewRopeKey) -> tuple[Latent, RopeKey]:
    """Without a cache the positions attended over are this call's (`kv_seq` is `seq`)."""
    return latent, k_rope


def _precheck_latent_cache(arguments: dict[str, Any]) -> None:
    check_cache(arguments["cache"], LatentCache, arguments["latent"])


@stage(
    name="cache",
    public=("kv_cache",),
    trace=("cache_latent", "cache_k_rope"),
    sources={"result": "the cache plus the new latent"},
    precheck=_precheck_latent_cache,
)
def append_latent(
    cache: LatentCache, kv_cache: LatentBuffer, latent: NewLatent, k_rope: NewRopeKey
) -> tuple[Latent, RopeKey]:
    """Write the new positions' latent and rotary key; attend over everything cached."""
    return cache.write(latent, k_rope, _OWNER)


@stage(name="kv_b_proj")
def expand_latent(kv_b_proj: nn.Module, latent: Latent) -> ExpandedKV:
    """Every head's key (without RoPE) and value, rebuilt from the latent."""
    return kv_b_proj(latent)


@stage(name="split_kv", trace=("k", "v"))
def split_latent_kv(kv: ExpandedKV, k_rope: RopeKey, num_heads: int, d_nope: int) -> tuple[LatentKeyHeads, ValueHeads]:
    """Keys: each head's own part beside the shared rotary key (a new tensor); values: a view."""
    heads = K.split_heads(kv, num_heads)
    keys = torch.cat((heads[..., :d_nope], k_rope.expand(-1, num_heads, -1, -1)), dim=-1)
    return keys, heads[..., d_nope:]


@stage(name="q")
def join_query(q_nope: NopeQueries, q_rope: RopeQueries) -> LatentQueryHeads:
    return torch.cat((q_nope, q_rope), dim=-1)


@stage(name="mask", public=("attn_mask", "key_padding_mask"), precheck=precheck_masks, explain=explain_mask)
def latent_masks(
    q: LatentQueryHeads,
    k: LatentKeyHeads,
    attn_mask: AttnMask | None,
    key_padding_mask: PaddingMask | None,
    is_causal: bool,
) -> LatentMask | None:
    return K.combine_masks(attn_mask, key_padding_mask, is_causal, q, k, explicit=False)


@stage(name="attention")
def latent_attend(
    q: LatentQueryHeads,
    k: LatentKeyHeads,
    v: ValueHeads,
    mask: LatentMask | None,
    causal: bool,
    may_empty: bool,
    scale: float,
    dropout_p: float,
) -> LatentOutHeads:
    """SDPA per head (values narrower or wider than keys is fine); rows with no key are zeros."""
    rows = None
    if mask is not None and may_empty:
        rows = K.rows_with_a_key(mask)
        mask = K.open_empty_rows(mask, rows)
    return K.zero_rows(K.sdpa(q, k, v, mask, causal, scale, dropout_p), rows)


@stage(name="q_absorbed")
def absorb_query(
    q_nope: NopeQueries, q_rope: RopeQueries, kv_b_weight: LatentUpWeight, num_heads: int
) -> AbsorbedQueries:
    """Each head's query taken into the latent's space (`q_nope @ W_k[h]`), beside its rotary part.

    `q_nope . (W_k[h] latent) == (q_nope W_k[h]) . latent`: the keys need not be rebuilt.
    """
    up_keys = kv_b_weight.unflatten(0, (num_heads, -1))[:, : q_nope.shape[-1]]
    return torch.cat((torch.matmul(q_nope, up_keys), q_rope), dim=-1)


@stage(name="entries", trace=("keys_latent", "values_latent"))
def cached_entries(cache: LatentCache, latent: Latent) -> tuple[CacheEntries, LatentValues]:
    """The cache as it is, as one head of keys (latent and rotary key) and of values (the latent): views."""
    return cache.entries(), latent[:, None]


@stage(name="mask", public=("attn_mask", "key_padding_mask"), explain=explain_mask)
def absorbed_masks(
    q: AbsorbedQueries,
    k: CacheEntries,
    attn_mask: AttnMask | None,
    key_padding_mask: PaddingMask | None,
    is_causal: bool,
) -> LatentMask | None:
    return K.combine_masks(attn_mask, key_padding_mask, is_causal, q, k, explicit=False)


@stage(name="attention_latent")
def attend_absorbed(
    q: AbsorbedQueries,
    k: CacheEntries,
    v: LatentValues,
    mask: LatentMask | None,
    may_empty: bool,
    scale: float,
    dropout_p: float,
) -> AbsorbedOut:
    """Every head attends the one cached head (as MQA: queries folded, the cache never expanded)."""
    return K.attend(q, k, v, mask, False, may_empty, scale, dropout_p)


@stage(name="attention")
def unabsorb(out: AbsorbedOut, kv_b_weight: LatentUpWeight, num_heads: int, d_nope: int) -> LatentOutHeads:
    """Each head's weighted latent through its value rows: `out_h @ W_v[h].T`."""
    up_values = kv_b_weight.unflatten(0, (num_heads, -1))[:, d_nope:]
    return torch.matmul(out, up_values.transpose(-1, -2))


@stage(name="merge", raw=K.merge_heads)
def merge_latent(x: LatentOutHeads) -> LatentMerged:
    return K.merge_heads(x)


@stage(name="o_proj")
def project_latent_output(o_proj: nn.Module, x: LatentMerged) -> Tokens:
    return o_proj(x)


_STAGES: dict[str, Any] = {
    "compress_query": compress_query,
    "expand_query": expand_query,
    "project_latent_query": project_latent_query,
    "split_latent_query": split_latent_query,
    "compress_kv": compress_kv,
    "split_latent": split_latent,
    "latent_rotary_tables": latent_rotary_tables,
    "rotate_latent": rotate_latent,
    "attend_to_new_latent": attend_to_new_latent,
    "append_latent": append_latent,
    "expand_latent": expand_latent,
    "split_latent_kv": split_latent_kv,
    "join_query": join_query,
    "latent_masks": latent_masks,
    "latent_attend": latent_attend,
    "absorb_query": absorb_query,
    "cached_entries": cached_entries,
    "absorbed_masks": absorbed_masks,
    "attend_absorbed": attend_absorbed,
    "unabsorb": unabsorb,
    "merge_latent": merge_latent,
    "project_latent_output": project_latent_output,
}
_RAW = raw(**_STAGES)


def _precheck_forward(arguments: dict[str, Any]) -> None:
    module, query, cache = arguments["self"], arguments["query"], arguments["kv_cache"]
    check_cache(cache, LatentCache)
    if cache is not None and cache.kv_lora_rank != module.kv_lora_rank:
        raise mismatch(
            f"kv_cache holds kv_lora_rank={cache.kv_lora_rank} and d_rope={cache.d_rope} per position, but the module "
            f"(kv_lora_rank={module.kv_lora_rank}, d_rope={module.d_rope}) needs those; make it with "
            "module.new_cache(batch, capacity).",
            arg="kv_cache",
            dim="kv_lora_rank",
        )
    weight = getattr(module.kv_a_proj_with_mqa, "weight", None)
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or not isinstance(query, Tensor):
        return  # a quantized projection (its weight a method), an adapter: its own call decides, the result checked
    if query.dtype != weight.dtype:
        raise mismatch(
            f"query has dtype {dtype_name(query.dtype)}, but the module's parameters are {dtype_name(weight.dtype)}; "
            f"cast one of them (query.to({weight.dtype}) or module.to({query.dtype})).",
            arg="query",
        )
    if query.device != weight.device:
        raise mismatch(f"query is on {query.device}, but the module's parameters are on {weight.device}.", arg="query")


_CACHES = (LatentCache, PagedKVCache)  # the caches a call writes, restored if a hook raises after it (`call_restoring`)


@dataclasses.dataclass(frozen=True)
class _Options(LatentConfig):
    """The constructor's parameters: the config's fields, then where the parameters are made."""

    device: torch.device | str | None = dataclasses.field(default=None, kw_only=True)
    dtype: torch.dtype | None = dataclasses.field(default=None, kw_only=True)


# The parts its config builds, as `_build` makes them: a part set
# on a built module must be one of them, or of the user's own kind (`plan.misfit`).
_PARTS: dict[str, Callable[[LatentConfig], Any]] = {
    "rotary": lambda c: RotaryEmbedding(c.d_rope, c.rope_theta, c.rope_scaling),
    "q_a_layernorm": lambda c: None if c.q_lora_rank is None else nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps),
    "kv_a_layernorm": lambda c: nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps),
}
_FIELDS = ("d_head", "theta", "scaling", "interleaved", "eps")

# An option a built module's parts hold, not an attribute of its name: how `config` reads it back.
_HELD_BY_PARTS: dict[str, Callable[[Any, str], Any]] = {
    "bias": lambda module, _: module.kv_a_proj_with_mqa.bias is not None,
    "rope_scaling": lambda module, _: copied(getattr(module._modules.get("rotary"), "scaling", None)),
    "scale": lambda module, _: module._scale,
    "norm_eps": lambda module, _: parts_eps(module, ("q_a_layernorm", "kv_a_layernorm"), module.norm_eps),
}


class LatentAttention(Guarded):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), checked stage by stage; its cache holds the latent.

    `o_proj(merge(attention(q, cat(k_nope, k_rope), v)))` where `q = q_b_proj(norm(q_a_proj(x)))` split per
    head into `(q_nope, rope(q_rope))`, and `(k_nope, v) = kv_b_proj(latent)` per head, `latent, k_rope =
    kv_a_proj_with_mqa(x)` (the latent normalised, `k_rope` rotated, one for all heads). Submodules carry
    transformers' `DeepseekV3Attention` names, so its state dicts load as they are.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> mla = ssm.LatentAttention(64, 8, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=6)
        >>> mla(torch.randn(2, 10, 64), is_causal=True).shape
        torch.Size([2, 10, 64])

    Its keywords are `LatentConfig`'s fields, described there (the signature is derived from them), and `device`,
    `dtype` of the parameters: `d_model` and `num_heads` (by position too); the sizes `kv_lora_rank`, `d_nope`,
    `d_rope`, `d_value` and `q_lora_rank`; `bias`, `rope_theta`, `rope_scaling`, `scale`, `interleaved`,
    `norm_eps` and `dropout`. `module.config` describes a built module; `from_config` builds one.

    Raises:
        ConfigError: a size is not a positive int, `d_rope` is odd, or an option is out of its range.
    """

    _sizes: tuple[int, ...]  # derived (`_derive`)
    scale: float  # derived: the scale given (`_scale`), else `(d_nope + d_rope) ** -0.5`
    _scale: float | None
    _constants: frozenset[int]

    @constructor_of(_Options)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        options = bind("LatentAttention", _Options, args, kwargs)
        factory = {"device": options.pop("device"), "dtype": options.pop("dtype")}
        self._build(LatentConfig(**options), factory)

    def _build(self, c: LatentConfig, factory: dict[str, Any]) -> None:
        """The submodules and attributes `c` describes (validated when it was made)."""
        self.d_model, self.num_heads, self.q_lora_rank, self.kv_lora_rank = (
            c.d_model, c.num_heads, c.q_lora_rank, c.kv_lora_rank
        )  # fmt: skip
        self.d_nope, self.d_rope, self.d_value = c.d_nope, c.d_rope, c.d_value
        self.rope_theta, self.interleaved, self.dropout = c.rope_theta, c.interleaved, c.dropout
        self.norm_eps = c.norm_eps  # (held, as MultiHeadAttention holds its: a norm of the user's kind has no `eps`)
        self._scale = c.scale  # (None: the default of the sizes, `scale` derived again when one is set)
        q_width = c.num_heads * (c.d_nope + c.d_rope)
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.d_model, q_width, bias=False, **factory)
        else:
            self.q_a_proj = nn.Linear(c.d_model, c.q_lora_rank, bias=c.bias, **factory)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps, **factory)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_width, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(c.d_model, c.kv_lora_rank + c.d_rope, bias=c.bias, **factory)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps, **factory)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.d_nope + c.d_value), bias=False, **factory)
        self.o_proj = nn.Linear(c.num_heads * c.d_value, c.d_model, bias=c.bias, **factory)
        self.rotary = RotaryEmbedding(c.d_rope, c.rope_theta, c.rope_scaling).to(device=factory["device"])
        self._derive()

    @classmethod
    def from_config(
        cls, config: LatentConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> "LatentAttention":
        """The module `config` describes, its parameters freshly initialised.

        Example:
            >>> import dataclasses, shapesafe_mha as ssm
            >>> mla = ssm.LatentAttention(64, 8, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
            >>> ssm.LatentAttention.from_config(dataclasses.replace(mla.config, rope_theta=50000.0)).rope_theta
            50000.0
        """
        if not isinstance(config, LatentConfig):
            raise ConfigError(
                f"LatentAttention.from_config(): config must be a LatentConfig, but got {type(config).__name__}."
            )
        return cls(**{name: getattr(config, name) for name in LATENT_OPTIONS}, device=device, dtype=dtype)

    @property
    def config(self) -> LatentConfig:
        """The module as it is now, described as one `LatentConfig`."""
        return LatentConfig(**{name: _HELD_BY_PARTS.get(name, getattr)(self, name) for name in LATENT_OPTIONS})

    def _derive(self) -> None:
        """What the sizes fix, derived from them (again, when one is set after construction: a verdict remembered
        under the old ones is forgotten)."""
        derived = self.__dict__  # not __setattr__: these are what it derives
        sizes = (self.d_model, self.num_heads, self.kv_lora_rank, self.d_nope, self.d_rope, self.d_value)
        derived["_sizes"] = sizes
        given = derived["_scale"]  # the scores' scale: the one given, else the sizes' default
        derived["scale"] = (self.d_nope + self.d_rope) ** -0.5 if given is None else float(given)
        derived["_constants"] = frozenset(
            {*sizes, self.q_lora_rank or 0, self.d_nope + self.d_rope, self.kv_lora_rank + self.d_rope}
        )
        derived["_verdicts"] = Verdicts()

    _GUARDED, _BUILT = frozenset((*_PARTS, *LATENT_OPTIONS)), "_verdicts"  # (`Guarded`)

    def __setattr__(self, name: str, value: Any) -> None:
        # An option set on a built module: validated as at construction and followed, or refused where parts were
        # built from it. A size set (or an option): what they fix derived again, what was remembered forgotten.
        built = "_verdicts" in self.__dict__  # (not while _build sets them)
        if built and name in _PARTS:  # a part the config builds, replaced: the one it builds, or the user's own kind
            config = self.config
            why = misfit(_PARTS[name](config), value, name, _FIELDS, config)
            if why is not None:
                raise ConfigError(
                    f"LatentAttention: {name} cannot be replaced by this one: {why}. Build the module that has it: "
                    "LatentAttention.from_config(dataclasses.replace(module.config, ...)), then load its state_dict."
                )
        if built and name in LATENT_OPTIONS and name not in LATENT_SIZES:
            changed = dataclasses.replace(self.config, **{name: value})  # validated as at construction
            if name in LATENT_BUILT_FROM and changed == self.config:  # (the value it has: nothing to change)
                return
            if name in LATENT_BUILT_FROM:
                raise ConfigError(
                    f"LatentAttention: {name} cannot be set on a built module: its {LATENT_BUILT_FROM[name]} were "
                    f"built from it. Build one that has it: LatentAttention.from_config(dataclasses.replace("
                    f"module.config, {name}={value!r})), then load_state_dict(module.state_dict())."
                )
            name, value = ("_scale", changed.scale) if name == "scale" else (name, getattr(changed, name))
        super().__setattr__(name, value)
        if built and (not name.startswith("_") or name == "_scale") and name != "training":
            self._derive()

    def _apply(self, fn: Any, recurse: bool = True) -> "LatentAttention":
        super()._apply(fn, recurse)
        self._verdicts = Verdicts()
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_restoring(self, args, kwargs, _CACHES)  # a hook that raises after forward changes nothing

    def extra_repr(self) -> str:
        # the sizes and rope_theta, then each option that differs from its default (LatentConfig's)
        try:
            config = self.config
        except ConfigError:  # (parts that disagree: reading the config says so, printing the module does not)
            return ", ".join(f"{name}={getattr(self, name)!r}" for name in LATENT_SIZES)
        shown = [*LATENT_SIZES, "rope_theta"]
        fields = dataclasses.fields(config)
        shown += [f.name for f in fields if f.name not in shown and getattr(config, f.name) != f.default]
        return ", ".join(f"{name}={getattr(config, name)!r}" for name in shown)

    def new_cache(self, batch: int, capacity: int) -> LatentCache:
        """A `LatentCache` that fits this module: `kv_lora_rank + d_rope` numbers per position."""
        dtype, device = tensor_kind(self, self.kv_a_proj_with_mqa)
        return LatentCache(batch, capacity, self.kv_lora_rank, self.d_rope, dtype=dtype, device=device)

    @classmethod
    def from_hf(cls, attention: nn.Module, *, verify: bool = True) -> "LatentAttention":
        """A `LatentAttention` computing what transformers' `DeepseekV3Attention` (or alike) computes.

        Sizes, biases, norms and `rope_interleave` from `attention.config`; the weights copied (the
        submodule names are the same). Call it `is_causal=True`; decoding uses our `LatentCache`.
        Verified as `MultiHeadAttention.from_hf` is, on a float64 probe (`verify=False` skips it); a
        config without `rope_interleave` (DeepSeek-V2, which always interleaves) gets the pairing the
        probe shows.

        Raises:
            ConfigError: a RoPE scaling (`rope_parameters['rope_type']`, e.g. yarn) or another variant
                computed differently here, named by its config field; or the converted layer differs
                from `attention` on the probe.
        """
        from .._interop.hf import latent_from_hf

        return latent_from_hf(cls, attention, verify=verify)

    def forward(
        self,
        query: Tokens,
        *,
        attn_mask: AttnMask | None = None,
        key_padding_mask: PaddingMask | None = None,
        is_causal: bool = False,
        kv_cache: LatentCache | PagedKVCache | None = None,
        positions: Positions | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> Tokens:
        """Self-attention of `query` `(batch, seq, d_model)`; with `kv_cache`, over everything it holds too.

        Checked on the first call of a kind, every stage against one set of named dimensions; the
        verdict is remembered for calls whose sizes relate the same way (see `MultiHeadAttention`).

        Example:
            >>> import torch, shapesafe_mha as ssm
            >>> mla = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4)
            >>> cache = mla.new_cache(1, 16)
            >>> mla(torch.randn(1, 5, 32), is_causal=True, kv_cache=cache).shape, len(cache)
            (torch.Size([1, 5, 32]), 5)

        Arguments:
            query: `(batch, seq, d_model)`.
            attn_mask, key_padding_mask, is_causal: as in `MultiHeadAttention.forward` (`kv_seq`
                counts the cached positions and the new ones).
            kv_cache: a `LatentCache`: this call's latent is appended, and attention covers all of it.
            positions: `(batch, seq)` rotary positions; default `len(kv_cache) + arange(seq)`.
            cu_seqlens: a packed batch `(1, total, d_model)` of sequences end to end, and a `PagedKVCache`
                (`PagedKVCache.for_module(self, ...)`), as in `MultiHeadAttention.forward` (prompts and chunks
                sequence by sequence, one new token of every sequence as one batch).

        Returns:
            `(batch, seq, d_model)`.

        Raises:
            ShapeError: an input does not fit the module, the others or the cache; a failed call changes nothing.
        """
        if cu_seqlens is not None or isinstance(kv_cache, PagedKVCache):  # serving: packed batches, paged caches
            from .paged_latent import latent_decode, latent_view

            return serving_forward(self, query, None, None, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   is_causal=is_causal, need_weights=False, kv_cache=kv_cache, positions=positions,
                                   cu_seqlens=cu_seqlens, view=latent_view(self),
                                   decode=latent_decode(self))  # fmt: skip
        call = (query, attn_mask, key_padding_mask, is_causal, kv_cache, positions)
        absorb = isinstance(query, Tensor) and isinstance(kv_cache, LatentCache) and self._absorbs(query)
        keyed = isinstance(query, Tensor) and isinstance(kv_cache, LatentCache | None)
        return remembered_forward(
            self._verdicts,
            self._constants,
            lambda: self._key(absorb, *call) if keyed else None,
            kv_cache if isinstance(kv_cache, LatentCache) else None,
            lambda: self._run(_RAW, absorb, *call),
            lambda check, observer: self._checked(check, observer, absorb, *call),
            current_observer(),
            torch.compiler.is_compiling(),
        )

    def _checked(self, check: bool, observer: Any, absorb: bool, *call: Any) -> Any:
        """The forward with every stage checked against one memo, and reported to the trace."""
        query, attn_mask, key_padding_mask, is_causal, kv_cache, positions = call
        with Session(_OWNER, check=check, observer=observer) as session:
            session.seed(LatentSizes, witness(self._sizes), "the module")
            arguments = dict(
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                kv_cache=kv_cache,
                positions=positions,
            )
            session.check_arguments(_FORWARD, (self, query), arguments, hints=_FORWARD_HINTS)
            if observer is not None:
                observer("query", "batch seq d_model", query)
            result = self._run(session.stages(**_STAGES), absorb, *call)
            session.report(_FORWARD, result)
        return result

    def _absorbs(self, query: Tensor) -> bool:
        """Decode one token by absorption (`kv_b_proj`'s weight taken into the query and the output) instead of
        rebuilding every cached position's keys and values: only where that is provably the same computation,
        `kv_b_proj` a plain bias-free `nn.Linear` without hooks, no autograd, no compiler or tracer."""
        if query.shape[1] != 1 or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if torch.jit.is_tracing():  # pyright: ignore[reportPrivateImportUsage]
            return False
        kv_b = self._modules["kv_b_proj"]
        return plain_linear(kv_b) and getattr(kv_b, "bias", None) is None and not global_hooks()

    def _key(self, absorb: bool, *call: Any) -> CallKey:
        """What a verdict depends on: the call's structure and its sizes (see `CallKey`)."""
        query, attn_mask, key_padding_mask, is_causal, kv_cache, positions = call
        tensors = (query, attn_mask, key_padding_mask, positions, None if kv_cache is None else kv_cache.buffer)
        masked = attn_mask is not None or key_padding_mask is not None
        # kv_seq (cached + new) is checked only against masks.
        kv_seq = query.shape[1] + (0 if kv_cache is None else len(kv_cache)) if masked else None
        structure = (
            tuple(None if t is None else (type(t), t.dtype, t.device) for t in tensors),
            None if kv_cache is None else kv_cache.d_rope,  # the buffer's width alone does not say how it splits
            absorb,
            type(is_causal),
            is_causal,
            self.training,
            autocast_on() and autocast_dtype(query.device),
            *self._modules.values(),
            module_state(self._modules.values()),  # hooks added, parameters replaced or re-typed
        )
        return CallKey(structure, tuple(None if t is None else t.shape for t in tensors), kv_seq)

    def _run(
        self,
        s: Any,
        absorb: bool,
        query: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        kv_cache: LatentCache | None,
        positions: Tensor | None,
    ) -> Tensor:
        """The forward, stage by stage: `s` holds the stages, checked (a session's) or plain."""
        m = self._modules
        if self.q_lora_rank is None:
            q = s.project_latent_query(m["q_proj"], query)
        else:
            q = s.expand_query(m["q_b_proj"], s.compress_query(m["q_a_proj"], m["q_a_layernorm"], query))
        q_nope, q_rope = s.split_latent_query(q, self.num_heads, self.d_nope)
        latent, k_rope = s.split_latent(
            s.compress_kv(m["kv_a_proj_with_mqa"], query), m["kv_a_layernorm"], self.kv_lora_rank
        )
        if positions is None:
            positions = default_positions(query, 0 if kv_cache is None else kv_cache.seen)
        cos, sin = s.latent_rotary_tables(m["rotary"], positions, q_rope)
        q_rope, k_rope = s.rotate_latent(q_rope, k_rope, cos, sin, self.interleaved)
        if kv_cache is None:
            latent, k_rope = s.attend_to_new_latent(latent, k_rope)
        else:
            latent, k_rope = s.append_latent(kv_cache, kv_cache.buffer, latent, k_rope)
        dropout_p = self.dropout if self.training else 0.0
        if absorb and kv_cache is not None:
            kv_b: Any = m["kv_b_proj"]
            weight = kv_b.weight
            q = s.absorb_query(q_nope, q_rope, weight, self.num_heads)
            keys, values = s.cached_entries(kv_cache, latent)
            mask = s.absorbed_masks(q, keys, attn_mask, key_padding_mask, is_causal)
            may_empty = K.may_empty_rows(attn_mask, key_padding_mask, is_causal, q.shape[2], keys.shape[2])
            out = s.attend_absorbed(q, keys, values, mask, may_empty, self.scale, dropout_p)
            return s.project_latent_output(
                m["o_proj"], s.merge_latent(s.unabsorb(out, weight, self.num_heads, self.d_nope))
            )
        k, v = s.split_latent_kv(s.expand_latent(m["kv_b_proj"], latent), k_rope, self.num_heads, self.d_nope)
        q = s.join_query(q_nope, q_rope)
        mask = s.latent_masks(q, k, attn_mask, key_padding_mask, is_causal)
        causal = mask is None and K.native_causal(is_causal, q, k)
        may_empty = K.may_empty_rows(attn_mask, key_padding_mask, is_causal, q.shape[2], k.shape[2])
        out = s.latent_attend(q, k, v, mask, causal, may_empty, self.scale, dropout_p)
        return s.project_latent_output(m["o_proj"], s.merge_latent(out))


_FORWARD = Stage(
    LatentAttention.forward,
    name="LatentAttention.forward",
    public=("query", "attn_mask", "key_padding_mask", "kv_cache"),
    trace=("",),
    sources={},
    precheck=_precheck_forward,
    validate=None,
    explain=None,
)
# Masks are checked where kv_seq is known (the mask stage, after the cache).
_FORWARD_HINTS = {k: v for k, v in _FORWARD.hints.items() if k not in ("attn_mask", "key_padding_mask")}
