"""The dimension vocabulary: every dimension name is declared here, once.

Notation:

| name           | meaning                                                          |
|----------------|------------------------------------------------------------------|
| `batch`        | independent sequences                                            |
| `seq`          | query positions                                                  |
| `kv_seq`       | key/value positions attended over (cached + new when decoding)   |
| `new`          | key/value positions given in this call (appended to a KV cache)  |
| `capacity`     | positions a `KVCache` can hold                                   |
| `d_model`      | the model's width                                                |
| `num_heads`    | query heads                                                      |
| `num_kv_heads` | key/value heads (MHA: `num_heads`, MQA: 1)                       |
| `group`        | query heads per KV head, `num_heads // num_kv_heads`             |
| `d_head`       | width of one head                                                |
| `d_inner`      | a projection's width around the head split, `heads * d_head`     |
| `d_in`, `d_out`| a linear map's input and output widths                           |
| `local_heads`  | query heads held by one rank of a head-parallel group            |
| `local_kv_heads` | KV heads held by one rank (sharded or replicated)              |

Shapes are built from these names once, below, and reused by every stage.
"""

from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

DIMS = (
    "batch",
    "seq",
    "kv_seq",
    "new",
    "capacity",
    "d_model",
    "num_heads",
    "num_kv_heads",
    "group",
    "d_head",
    "d_inner",
    "d_in",
    "d_out",
    "local_heads",
    "local_kv_heads",
)

# The sizes a module fixes, bound before any argument is checked (from a `meta` witness tensor).
ModuleSizes = Shaped[Tensor, "d_model num_heads num_kv_heads d_head group"]

# Activations of the model.
Tokens = Float[Tensor, "batch seq d_model"]
Memory = Float[Tensor, "batch kv_seq d_model"]  # key/value inputs, every position attended
KVTokens = Float[Tensor, "batch new d_model"]  # key/value inputs appended to a KV cache
Inner = Float[Tensor, "batch seq d_inner"]
QueryInner = Float[Tensor, "batch seq num_heads*d_head"]  # projected queries, and the merged heads
NewKVInner = Float[Tensor, "batch new num_kv_heads*d_head"]  # projected keys or values
FusedInner = Float[Tensor, "batch seq (num_heads+2*num_kv_heads)*d_head"]  # q, k and v projected at once

# A linear map, nn.Linear layout.
LinearIn = Float[Tensor, "batch seq d_in"]
LinearOut = Float[Tensor, "batch seq d_out"]
Weight = Float[Tensor, "d_out d_in"]
Bias = Float[Tensor, " d_out"]

# Per-head tensors.
Heads = Float[Tensor, "batch num_heads seq d_head"]
KVHeads = Float[Tensor, "batch num_kv_heads kv_seq d_head"]
NewKVHeads = Float[Tensor, "batch num_kv_heads new d_head"]
CacheBuffer = Float[Tensor, "batch num_kv_heads capacity d_head"]
SameSeqKVHeads = Float[Tensor, "batch num_kv_heads seq d_head"]  # keys at the queries' positions
GroupedQueries = Float[Tensor, "batch num_kv_heads group seq d_head"]
FoldedQueries = Float[Tensor, "batch num_kv_heads group*seq d_head"]  # a group's query heads end to end
Probabilities = Float[Tensor, "batch num_heads seq kv_seq"]
FoldedProbabilities = Float[Tensor, "batch num_kv_heads group*seq kv_seq"]

# Rotary position embeddings: integer positions of the queries, and their cos/sin tables.
Positions = Int[Tensor, "batch seq"]
RotaryTable = Float[Tensor, "seq d_head"] | Float[Tensor, "#batch seq d_head"]

# Masks. Boolean: True = may attend. Float: added to the scores. Only batch and heads broadcast.
AttnMask = (
    Bool[Tensor, "seq kv_seq"]
    | Bool[Tensor, "#batch #num_heads seq kv_seq"]
    | Float[Tensor, "seq kv_seq"]
    | Float[Tensor, "#batch #num_heads seq kv_seq"]
)
PaddingMask = Bool[Tensor, "batch kv_seq"]
# Every restriction of a call combined (a key padding mask alone broadcasts over seq), and laid out
# for the folded queries of GQA.
FullMask = Bool[Tensor, "#batch #num_heads #seq kv_seq"] | Float[Tensor, "#batch #num_heads #seq kv_seq"]
FoldedMask = (
    Bool[Tensor, "#batch #num_kv_heads #group*seq kv_seq"] | Float[Tensor, "#batch #num_kv_heads #group*seq kv_seq"]
)
RowsWithAKey = Bool[Tensor, "#batch #num_heads #seq 1"]
