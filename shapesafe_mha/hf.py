"""Hugging Face models checked as they run: `register()` adds `attn_implementation="shapesafe"` to transformers.

Needs transformers (`pip install "shapesafe_mha[hf]"`); importing this module does not import it.
"""

from ._interop.hf_backend import attention as attention
from ._interop.hf_backend import register as register

__all__ = ["attention", "register"]
