"""shapesafe_mha: multi-head, grouped-query and multi-query attention with checked shapes."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the docs read; at run time each name loads on first use
    from ._compute.cache import KVCache as KVCache
    from ._compute.flex import flex_attention as flex_attention
    from ._compute.packed import check_cu_seqlens as check_cu_seqlens
    from ._compute.paged import PagedKVCache as PagedKVCache
    from ._compute.rotary import RotaryEmbedding as RotaryEmbedding
    from ._compute.rotary import apply_partial_rotary as apply_partial_rotary
    from ._compute.rotary import apply_rotary as apply_rotary
    from ._compute.rotary import inverse_frequencies as inverse_frequencies
    from ._compute.rotary import long_frequencies as long_frequencies
    from ._compute.stages import attention_weights as attention_weights
    from ._compute.stages import group_queries as group_queries
    from ._compute.stages import merge_heads as merge_heads
    from ._compute.stages import project as project
    from ._compute.stages import scaled_dot_product_attention as scaled_dot_product_attention
    from ._compute.stages import split_heads as split_heads
    from ._core.contract import checks_enabled as checks_enabled
    from ._core.contract import unchecked as unchecked
    from ._core.errors import ConfigError as ConfigError
    from ._core.errors import ShapeError as ShapeError
    from ._core.errors import ShapesafeError as ShapesafeError
    from ._core.shapecheck import expect as expect
    from ._core.shapecheck import shape_scope as shape_scope
    from ._core.shapecheck import shapecheck as shapecheck
    from ._core.weights import AttentionWeights as AttentionWeights
    from ._modules.config import AttentionConfig as AttentionConfig
    from ._modules.latent import LatentAttention as LatentAttention
    from ._modules.latent import LatentCache as LatentCache
    from ._modules.latent_config import LatentConfig as LatentConfig
    from ._modules.multihead import MultiHeadAttention as MultiHeadAttention
    from ._tools.prove import ShapeProof as ShapeProof
    from ._tools.prove import prove as prove
    from ._tools.report import LatentTraceConfig as LatentTraceConfig
    from ._tools.report import TraceConfig as TraceConfig
    from ._tools.report import TraceReport as TraceReport
    from ._tools.report import trace_forward as trace_forward
    from ._tools.report import trace_latent as trace_latent

# Each public name, from the private module that defines it. They load on first use, not on import:
# `shapesafe-mha --help` lives in this package and must answer before torch is imported (a second).
_WHERE = {
    "KVCache": "_compute.cache",
    "PagedKVCache": "_compute.paged",
    "check_cu_seqlens": "_compute.packed",
    "checks_enabled": "_core.contract",
    "unchecked": "_core.contract",
    "ConfigError": "_core.errors",
    "ShapeError": "_core.errors",
    "ShapesafeError": "_core.errors",
    "flex_attention": "_compute.flex",
    "AttentionConfig": "_modules.config",
    "LatentAttention": "_modules.latent",
    "LatentCache": "_modules.latent",
    "LatentConfig": "_modules.latent_config",
    "MultiHeadAttention": "_modules.multihead",
    "ShapeProof": "_tools.prove",
    "prove": "_tools.prove",
    "LatentTraceConfig": "_tools.report",
    "TraceConfig": "_tools.report",
    "TraceReport": "_tools.report",
    "trace_forward": "_tools.report",
    "trace_latent": "_tools.report",
    "RotaryEmbedding": "_compute.rotary",
    "apply_partial_rotary": "_compute.rotary",
    "apply_rotary": "_compute.rotary",
    "inverse_frequencies": "_compute.rotary",
    "long_frequencies": "_compute.rotary",
    "expect": "_core.shapecheck",
    "shape_scope": "_core.shapecheck",
    "shapecheck": "_core.shapecheck",
    "attention_weights": "_compute.stages",
    "group_queries": "_compute.stages",
    "merge_heads": "_compute.stages",
    "project": "_compute.stages",
    "scaled_dot_product_attention": "_compute.stages",
    "split_heads": "_compute.stages",
    "AttentionWeights": "_core.weights",
}


_SUBMODULES = ("dims", "hf", "parallel", "reference", "testing")  # public namespaces, imported when first named


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "AttentionWeights",
    "ConfigError",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "LatentConfig",
    "LatentTraceConfig",
    "MultiHeadAttention",
    "PagedKVCache",
    "RotaryEmbedding",
    "ShapeError",
    "ShapeProof",
    "ShapesafeError",
    "TraceConfig",
    "TraceReport",
    "apply_partial_rotary",
    "apply_rotary",
    "attention_weights",
    "check_cu_seqlens",
    "checks_enabled",
    "expect",
    "flex_attention",
    "group_queries",
    "inverse_frequencies",
    "long_frequencies",
    "merge_heads",
    "project",
    "prove",
    "scaled_dot_product_attention",
    "shape_scope",
    "shapecheck",
    "split_heads",
    "trace_forward",
    "trace_latent",
    "unchecked",
]
