"""Check Hugging Face attention classes as written: `check_hf_attention` (needs transformers, the `hf` extra)."""

from ._hf_check import check_hf_attention as check_hf_attention

__all__ = ["check_hf_attention"]
