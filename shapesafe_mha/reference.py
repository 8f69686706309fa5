"""The naive per-head reference implementation, the oracle of shapesafe_mha's property tests."""

from ._reference import per_head_attention as per_head_attention

__all__ = ["per_head_attention"]
