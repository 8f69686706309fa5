"""Hugging Face models checked as they run: `register()` adds `attn_implementation="shapesafe"` to transformers,
`replace_attention(model)` swaps our checked layers in.

Needs transformers (`pip install "shapesafe_mha[hf]"`); importing this module does not import it.
"""

from ._interop.hf_backend import attention as attention
from ._interop.hf_backend import register as register
from ._interop.hf_replace import HFAttention as HFAttention
from ._interop.hf_replace import Replacements as Replacements
from ._interop.hf_replace import replace_attention as replace_attention

__all__ = ["HFAttention", "Replacements", "attention", "register", "replace_attention"]
