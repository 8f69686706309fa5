"""The dimension vocabulary and the shape aliases of shapesafe_mha's stages, for annotating your own code.

`DIMS` maps every dimension name to its meaning; the aliases are jaxtyping annotations built from those
names (`Tokens` is `Float[Tensor, "batch seq d_model"]`). Use them beside names of your own
(`Float[Tensor, "batch patches d_model"]`) in functions checked by `shapesafe_mha.shapecheck`.

Example:
    >>> from shapesafe_mha.dims import DIMS, Heads
    >>> DIMS["num_kv_heads"]
    'key/value heads (MHA: `num_heads`, MQA: 1)'
    >>> Heads
    <class 'jaxtyping.Float[Tensor, 'batch num_heads seq d_head']'>
"""

from ._dims import DIMS as DIMS
from ._dims import AttnMask as AttnMask
from ._dims import Bias as Bias
from ._dims import CacheBuffer as CacheBuffer
from ._dims import GroupedQueries as GroupedQueries
from ._dims import Heads as Heads
from ._dims import Inner as Inner
from ._dims import KVHeads as KVHeads
from ._dims import KVTokens as KVTokens
from ._dims import LinearIn as LinearIn
from ._dims import LinearOut as LinearOut
from ._dims import Memory as Memory
from ._dims import NewKVHeads as NewKVHeads
from ._dims import NewKVInner as NewKVInner
from ._dims import PaddingMask as PaddingMask
from ._dims import Positions as Positions
from ._dims import Probabilities as Probabilities
from ._dims import QueryInner as QueryInner
from ._dims import RotaryTable as RotaryTable
from ._dims import SameSeqKVHeads as SameSeqKVHeads
from ._dims import Tokens as Tokens
from ._dims import Weight as Weight

__all__ = [
    "DIMS",
    "AttnMask",
    "Bias",
    "CacheBuffer",
    "GroupedQueries",
    "Heads",
    "Inner",
    "KVHeads",
    "KVTokens",
    "LinearIn",
    "LinearOut",
    "Memory",
    "NewKVHeads",
    "NewKVInner",
    "PaddingMask",
    "Positions",
    "Probabilities",
    "QueryInner",
    "RotaryTable",
    "SameSeqKVHeads",
    "Tokens",
    "Weight",
]
