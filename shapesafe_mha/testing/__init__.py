"""Property-testing tools for attention code: strategies, checks against the reference, memory assertions.

Importable without pytest; needs hypothesis (`pip install "shapesafe_mha[testing]"`). Hugging Face
attention classes are checked as written by `shapesafe_mha.testing.hf.check_hf_attention` (that
submodule needs transformers; this one does not import it).
"""

from .._core.trace import Allocation as Allocation
from .._core.trace import AllocationRecorder as AllocationRecorder
from .._core.trace import storage_id as storage_id
from .._interop.adapters import load_weights as load_weights
from ._strategies import ALL_KINDS as ALL_KINDS
from ._strategies import AttentionConfig as AttentionConfig
from ._strategies import AttentionInputs as AttentionInputs
from ._strategies import attention_configs as attention_configs
from ._strategies import attention_inputs as attention_inputs
from ._strategies import attention_masks as attention_masks
from ._strategies import boundary_sizes as boundary_sizes
from ._strategies import key_padding_masks as key_padding_masks
from ._strategies import projection_weights as projection_weights
from ._strategies import sequence_lengths as sequence_lengths
from ._toolkit import FailedCheckError as FailedCheckError
from ._toolkit import check_attention as check_attention
from ._toolkit import check_module as check_module
from ._toolkit import tolerance as tolerance
from ._verify import assert_no_kv_expansion as assert_no_kv_expansion
from ._verify import assert_shares_storage as assert_shares_storage

__all__ = [
    "ALL_KINDS",
    "Allocation",
    "AllocationRecorder",
    "AttentionConfig",
    "AttentionInputs",
    "FailedCheckError",
    "assert_no_kv_expansion",
    "assert_shares_storage",
    "attention_configs",
    "attention_inputs",
    "attention_masks",
    "boundary_sizes",
    "check_attention",
    "check_module",
    "key_padding_masks",
    "load_weights",
    "projection_weights",
    "sequence_lengths",
    "storage_id",
    "tolerance",
]
