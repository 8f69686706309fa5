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

from ._core.dims import DIMS as DIMS
from ._core.dims import AttnMask as AttnMask
from ._core.dims import Bias as Bias
from ._core.dims import BlockTable as BlockTable
from ._core.dims import CacheBuffer as CacheBuffer
from ._core.dims import CuSeqlens as CuSeqlens
from ._core.dims import GroupedQueries as GroupedQueries
from ._core.dims import Heads as Heads
from ._core.dims import Inner as Inner
from ._core.dims import KVHeads as KVHeads
from ._core.dims import KVTokens as KVTokens
from ._core.dims import LinearIn as LinearIn
from ._core.dims import LinearOut as LinearOut
from ._core.dims import Memory as Memory
from ._core.dims import NewKVHeads as NewKVHeads
from ._core.dims import NewKVInner as NewKVInner
from ._core.dims import PackedTokens as PackedTokens
from ._core.dims import PaddingMask as PaddingMask
from ._core.dims import PagePool as PagePool
from ._core.dims import PartialRotaryTable as PartialRotaryTable
from ._core.dims import Positions as Positions
from ._core.dims import Probabilities as Probabilities
from ._core.dims import QueryInner as QueryInner
from ._core.dims import RotaryTable as RotaryTable
from ._core.dims import SameSeqKVHeads as SameSeqKVHeads
from ._core.dims import Tokens as Tokens
from ._core.dims import Weight as Weight

__all__ = [
    "DIMS",
    "AttnMask",
    "Bias",
    "BlockTable",
    "CacheBuffer",
    "CuSeqlens",
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
    "PackedTokens",
    "PaddingMask",
    "PagePool",
    "PartialRotaryTable",
    "Positions",
    "Probabilities",
    "QueryInner",
    "RotaryTable",
    "SameSeqKVHeads",
    "Tokens",
    "Weight",
]
