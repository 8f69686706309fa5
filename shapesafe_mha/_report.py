"""`trace_forward`: run one forward of a config and report every stage, as observed."""

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ._module import MultiHeadAttention
from ._parallel import plan_heads
from ._trace import Stage, tracing

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class TraceConfig:
    """What to trace. The default is a Llama-style GQA layer on `meta` (no memory is used)."""

    d_model: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    d_head: int | None = None
    batch: int = 1
    seq: int = 128
    device: str = "meta"
    dtype: str = "bfloat16"
    decode: int | None = None  # one step against a cache already holding this many positions
    tp: int = 1  # head-parallel ranks: trace one rank's share (every rank's shapes are the same)
    rope_theta: float | None = None  # rotary position embeddings with this base


@dataclass
class TraceReport:
    """The stages of one forward, as observed, with totals."""

    config: dict[str, Any]
    stages: list[Stage]
    totals: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "stages": [s.as_dict() for s in self.stages], "totals": self.totals}


def _cache_bytes(batch: int, positions: int, kv_heads: int, d_head: int, itemsize: int) -> int:
    return 2 * batch * kv_heads * positions * d_head * itemsize


def trace_forward(config: TraceConfig = TraceConfig()) -> TraceReport:
    """Run one forward of `config` and record every stage's shape, strides, aliasing and allocations.

    Example:
        >>> from shapesafe_mha import TraceConfig, trace_forward
        >>> report = trace_forward(TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4))
        >>> [s.aliases for s in report.stages if s.name == "split_q"]
        ['q_proj']

    Raises:
        ConfigError: the config is impossible (the module's own checks).
    """
    dtype = DTYPES[config.dtype]
    device = torch.device(config.device)
    full = MultiHeadAttention(
        config.d_model,
        config.num_heads,
        config.num_kv_heads,
        d_head=config.d_head,
        rope_theta=config.rope_theta,
        device=device,
        dtype=dtype,
    ).eval()
    module, shards = full, []
    if config.tp != 1:
        shards = [plan_heads(full.num_heads, full.num_kv_heads, config.tp, rank) for rank in range(config.tp)]
        module = MultiHeadAttention(
            full.d_model,
            shards[0].local_heads,
            shards[0].local_kv_heads,
            d_head=full.d_head,
            rope_theta=config.rope_theta,
            device=device,
            dtype=dtype,
        ).eval()
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
        "kv_cache_bytes": per_kind["this"],
        "kv_cache_positions": positions,
        "kv_cache_bytes_mha": per_kind["mha"],
        "kv_cache_bytes_mqa": per_kind["mqa"],
        "kv_cache_ratio_vs_mha": per_kind["this"] / per_kind["mha"],
        "kv_cache_ratio_mqa_vs_mha": per_kind["mqa"] / per_kind["mha"],
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
