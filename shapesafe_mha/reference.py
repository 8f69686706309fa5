"""The naive per-head reference implementations, the oracles of shapesafe_mha's property tests."""

from ._compute.reference import alibi_slopes as alibi_slopes
from ._compute.reference import packed_per_head_attention as packed_per_head_attention
from ._compute.reference import per_head_attention as per_head_attention
from ._compute.reference import per_head_latent_attention as per_head_latent_attention

__all__ = ["alibi_slopes", "packed_per_head_attention", "per_head_attention", "per_head_latent_attention"]
