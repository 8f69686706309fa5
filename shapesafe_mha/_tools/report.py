"""`trace_forward`: run one forward of a config and report every stage, as observed."""

from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any

import torch

from .._compute.fastpath import choose_path
from .._core.errors import ConfigError
from .._core.trace import Stage, tracing
from .._modules.config import OPTIONS, SIZES, AttentionConfig
from .._modules.latent_config import LatentConfig
from .._modules.multihead import MultiHeadAttention
from .._modules.parallel import plan_heads, refuse_unsharded_norm

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class TraceConfig(AttentionConfig):
    """What to trace: a layer, every `AttentionConfig` field (by default a Llama-style GQA layer, 4096 wide, 32 query
    heads, 8 KV heads), and the call: its batch and positions, on `meta` by default (no memory is used)."""

    d_model: int = 4096
    num_heads: int = 32
    num_kv_heads: int | None = 8
    batch: int = 1
    seq: int = 128
    device: str = "meta"
    dtype: str = "bfloat16"
    decode: int | None = None  # one step against a cache already holding this many positions
    tp: int = 1  # head-parallel ranks: trace one rank's share (every rank's shapes are the same)


@dataclass
class TraceReport:
    """The stages of one forward, as observed, with totals."""

    config: dict[str, Any]
    stages: list[Stage]
    totals: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "stages": [s.as_dict() for s in self.stages], "totals": self.totals}

    def heading(self) -> str:
        """What was traced, in one line: the sizes, the batch, and prefill or decode."""
        c = self.config
        if "kv_lora_rank" in c:
            sizes = (
                f"latent attention: d_model={c['d_model']} num_heads={c['num_heads']} q_lora_rank={c['q_lora_rank']} "
                f"kv_lora_rank={c['kv_lora_rank']} d_nope={c['d_nope']} d_rope={c['d_rope']} d_value={c['d_value']}"
            )
        else:
            sizes = (
                f"d_model={c['d_model']} num_heads={c['num_heads']} num_kv_heads={c['num_kv_heads']} "
                f"d_head={c['d_head']}"
            )
        rank = f"rank 0 of {c['tp']}: " if c.get("tp", 1) != 1 else ""
        when = f"decode after {c['decode']}" if c["decode"] is not None else f"seq={c['seq']}"
        return f"{rank}{sizes} batch={c['batch']} {when}"


def _dtype(owner: str, name: Any) -> torch.dtype:
    """The torch dtype a config names, or `ConfigError` naming the ones a trace takes."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"{owner}: dtype={name!r} is not one of {', '.join(map(repr, DTYPES))}; pass one of them.")
    return DTYPES[name]


def _cache_bytes(batch: int, positions: int, kv_heads: int, d_head: int, itemsize: int) -> int:
    return 2 * batch * kv_heads * positions * d_head * itemsize


def trace_forward(config: TraceConfig = TraceConfig()) -> TraceReport:
    """Run one forward of `config` and record every stage's shape, strides, aliasing and allocations.

    Example:
        >>> from shapesafe_mha import TraceConfig, trace_forward
        >>> report = trace_forward(TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4))
        >>> [s.aliases for s in report.stages if s.name == "split_q"]
        ['qkv_proj']

    Raises:
        ConfigError: the config is impossible (the module's own checks).
    """
    dtype = _dtype("trace_forward()", config.dtype)
    device = torch.device(config.device)
    options: dict[str, Any] = {name: getattr(config, name) for name in OPTIONS if name not in SIZES}
    options |= {"device": device, "dtype": dtype}
    full = MultiHeadAttention(config.d_model, config.num_heads, config.num_kv_heads, d_head=config.d_head, **options)
    module, shards = full.eval(), []
    if config.tp != 1:
        refuse_unsharded_norm(full, "trace_forward()")
        shards = [plan_heads(full.num_heads, full.num_kv_heads, config.tp, rank) for rank in range(config.tp)]
        local = shards[0].local_heads, shards[0].local_kv_heads
        module = MultiHeadAttention(full.d_model, *local, d_head=full.d_head, **options).eval()
        module.o_proj.register_parameter("bias", None)  # added once, after the all-reduce
    seq = 1 if config.decode is not None else config.seq
    x = torch.randn(config.batch, seq, config.d_model, device=device, dtype=dtype)
    cache = None
    if config.decode is not None:
        cache = module.new_cache(config.batch, config.decode + 1)
        filler = torch.zeros(
            config.batch, module.num_kv_heads, config.decode, module.d_head, device=device, dtype=dtype
        )
        cache.append(filler, filler)
    with torch.no_grad():
        # The fused Q/K/V view is made once and kept (a fast path's cache; a copy only where the projections do not
        # lie side by side): make it before tracing, so the trace shows what every call allocates, and count it apart.
        choose_path(module, x, x, x, None, None, True, False, cache, None)
    fused = module._fused
    with torch.no_grad(), tracing() as tracer:
        if cache is not None:
            tracer.add("cache_keys_buffer", "batch num_kv_heads capacity d_head", cache.keys_buffer)
            tracer.add("cache_values_buffer", "batch num_kv_heads capacity d_head", cache.values_buffer)
        module(x, is_causal=True, kv_cache=cache)
    positions = config.seq if config.decode is None else config.decode + 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_kind = {  # the whole layer's cache, whatever the split
        kind: _cache_bytes(config.batch, positions, heads, full.d_head, itemsize)
        for kind, heads in (("mha", full.num_heads), ("this", full.num_kv_heads), ("mqa", 1))
    }
    resolved = asdict(config) | {"d_head": module.d_head, "group": full.group}
    stages = tracer.stages
    totals: dict[str, Any] = {
        "allocated_bytes": sum(s.allocated_bytes for s in tracer.stages),
        # a view of the projections' own storage (fastpath.pack_qkv): no bytes of its own
        "fused_qkv_weight_bytes": 0
        if fused is None or fused.weight.device.type == "meta" or _views(fused, module)
        else fused.weight.numel() * itemsize,
        "kv_cache_bytes": per_kind["this"],
        "kv_cache_positions": positions,
        "kv_cache_bytes_mha": per_kind["mha"],
        "kv_cache_bytes_mqa": per_kind["mqa"],
        # the ratios of the heads cached: the bytes' where there are any (no division by 0 at seq=0 or batch=0)
        "kv_cache_ratio_vs_mha": full.num_kv_heads / full.num_heads,
        "kv_cache_ratio_mqa_vs_mha": 1 / full.num_heads,
    }
    if shards:
        for stage in stages:  # name the per-rank head counts as what they are
            stage.named_shape = stage.named_shape.replace("num_kv_heads", "local_kv_heads").replace(
                "num_heads", "local_heads"
            )
        payload = config.batch * seq * config.d_model * itemsize
        totals |= {
            "tp": config.tp,
            "replicated_kv": shards[0].replicated_kv,
            "per_rank_weight_bytes": sum(p.numel() for p in module.parameters()) * itemsize
            + (config.d_model * itemsize if full.o_proj.bias is not None else 0),
            "per_rank_kv_cache_bytes": _cache_bytes(
                config.batch, positions, module.num_kv_heads, module.d_head, itemsize
            ),
            "all_reduce_bytes": payload,
            "all_reduce_ring_bytes_per_rank": 2 * (config.tp - 1) * payload // config.tp,
            "ranks": [
                {
                    "rank": s.rank,
                    "q_heads": [s.q_heads.start, s.q_heads.stop],
                    "kv_heads": [s.kv_heads.start, s.kv_heads.stop],
                }
                for s in shards
            ],
        }
    return TraceReport(resolved, stages, totals)


@dataclass(frozen=True)
class LatentTraceConfig(LatentConfig):
    """What to trace of multi-head latent attention: a layer, every `LatentConfig` field (by default DeepSeek-V3's
    layer), and the call: its batch and positions, on `meta` by default (no memory is used)."""

    d_model: int = 7168
    num_heads: int = 128
    _: KW_ONLY  # (the rest by keyword, as LatentAttention takes them)
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    d_nope: int = 128
    d_rope: int = 64
    d_value: int = 128
    batch: int = 1
    seq: int = 128
    device: str = "meta"
    dtype: str = "bfloat16"
    decode: int | None = None  # one step against a cache already holding this many positions


def trace_latent(config: LatentTraceConfig = LatentTraceConfig()) -> TraceReport:
    """Run one forward of a `LatentAttention` and record every stage, with the cache per position.

    The totals compare what the latent cache holds per position and sequence with a K/V cache of the
    same heads at every head (MHA) and at one KV head (MQA).

    Example:
        >>> from shapesafe_mha import LatentTraceConfig, trace_latent
        >>> report = trace_latent(LatentTraceConfig(decode=10))
        >>> [s.named_shape for s in report.stages if s.name == "cache_latent"]
        ['batch kv_seq kv_lora_rank']
        >>> report.totals["kv_cache_bytes_per_position"], report.totals["kv_cache_bytes_per_position_mha"]
        (1152, 81920)

    Raises:
        ConfigError: the config is impossible (the module's own checks).
    """
    from .._modules.latent import LatentAttention

    dtype = _dtype("trace_latent()", config.dtype)
    device = torch.device(config.device)
    module = LatentAttention.from_config(config, device=device, dtype=dtype).eval()
    seq = 1 if config.decode is not None else config.seq
    x = torch.randn(config.batch, seq, config.d_model, device=device, dtype=dtype)
    cache = None
    if config.decode is not None:
        cache = module.new_cache(config.batch, config.decode + 1)
        latent = torch.zeros(config.batch, config.decode, config.kv_lora_rank, device=device, dtype=dtype)
        rope = torch.zeros(config.batch, 1, config.decode, config.d_rope, device=device, dtype=dtype)
        cache.write(latent, rope, "trace_latent()")
    with torch.no_grad(), tracing() as tracer:
        if cache is not None:
            tracer.add("cache_buffer", "batch capacity kv_lora_rank+d_rope", cache.buffer)
        module(x, is_causal=True, kv_cache=cache)
    itemsize = torch.empty((), dtype=dtype).element_size()
    positions = config.seq if config.decode is None else config.decode + 1
    per_position = (config.kv_lora_rank + config.d_rope) * itemsize
    head = (config.d_nope + config.d_rope + config.d_value) * itemsize  # one head's key and value
    totals: dict[str, Any] = {
        "allocated_bytes": sum(s.allocated_bytes for s in tracer.stages),
        "kv_cache_positions": positions,
        "kv_cache_bytes": config.batch * positions * per_position,
        "kv_cache_bytes_per_position": per_position,
        "kv_cache_bytes_per_position_mha": config.num_heads * head,
        "kv_cache_bytes_per_position_mqa": head,
        "kv_cache_bytes_mha": config.batch * positions * config.num_heads * head,
        "kv_cache_bytes_mqa": config.batch * positions * head,
        "kv_cache_ratio_vs_mha": per_position / (config.num_heads * head),
        "kv_cache_ratio_mqa_vs_mha": 1 / config.num_heads,
    }
    return TraceReport(asdict(config), tracer.stages, totals)


def _views(fused: Any, module: Any) -> bool:
    """Whether the fused Q/K/V weight lies in the q projection's own storage (a view, not a copy)."""
    own = module.q_proj.weight.untyped_storage().data_ptr()
    return fused.weight.untyped_storage().data_ptr() == own
