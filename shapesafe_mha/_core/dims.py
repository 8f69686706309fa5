"""The dimension vocabulary: every dimension name is declared here, once.

Notation: the table below is made from `DIMS`, each name with its meaning.

Shapes are built from these names once, below, and reused by every stage.
"""

from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

DIMS: dict[str, str] = {
    "batch": "independent sequences",
    "seq": "query positions",
    "kv_seq": "key/value positions attended over (cached + new when decoding)",
    "new": "key/value positions given in this call (appended to a KV cache)",
    "capacity": "positions a `KVCache` can hold",
    "d_model": "the model's width",
    "num_heads": "query heads",
    "num_kv_heads": "key/value heads (MHA: `num_heads`, MQA: 1)",
    "group": "query heads per KV head, `num_heads // num_kv_heads`",
    "d_head": "width of one head",
    "d_inner": "a projection's width around the head split, `heads * d_head`",
    "d_in": "a linear map's input width",
    "d_out": "a linear map's output width",
    "local_heads": "query heads held by one rank of a head-parallel group",
    "local_kv_heads": "KV heads held by one rank (sharded or replicated)",
    "seen": "positions a sliding-window cache has seen (its masks cover them)",
    "q_lora_rank": "latent attention: width of the queries' low-rank bottleneck",
    "kv_lora_rank": "latent attention: width of the shared key/value latent (cached)",
    "d_nope": "latent attention: the part of a query/key head without RoPE",
    "d_rope": "the rotary part of a query/key head (partial rotary: the first `d_rope` of `d_head`; latent "
    "attention: one rotary key shared by all heads)",
    "d_value": "latent attention: width of a value head (may differ from `d_nope + d_rope`)",
    "total": "a packed batch: the tokens of every sequence, end to end (`cu_seqlens[-1]`)",
    "bounds": "a packed batch: where each sequence starts, and the end, `num_seqs + 1` offsets (`cu_seqlens`)",
    "num_blocks": "a paged cache: blocks in its pool, shared by every sequence",
    "block_size": "a paged cache: positions one block holds",
    "max_blocks": "a paged cache: the longest block table (blocks of the sequence holding most)",
}
__doc__ = (__doc__ or "") + "\n| name | meaning |\n|---|---|\n" + "\n".join(f"| `{n}` | {m} |" for n, m in DIMS.items())

# The sizes a module fixes, bound before any argument is checked (from a `meta` witness tensor).
ModuleSizes = Shaped[Tensor, "d_model num_heads num_kv_heads d_head group"]

# Activations of the model.
Tokens = Float[Tensor, "batch seq d_model"]
Memory = Float[Tensor, "batch kv_seq d_model"]  # key/value inputs, every position attended
KVTokens = Float[Tensor, "batch new d_model"]  # key/value inputs appended to a KV cache
Inner = Float[Tensor, "batch seq d_inner"]
QueryInner = Float[Tensor, "batch seq num_heads*d_head"]  # projected queries, and the merged heads
GatedQueryInner = Float[Tensor, "batch seq num_heads*2*d_head"]  # each head's queries, then its output gate
OutputGate = Float[Tensor, "batch seq num_heads d_head"]
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
Sinks = Float[Tensor, " num_heads"]  # attention sinks (gpt-oss): one logit per query head
AlibiSlopes = Float[Tensor, " num_heads"]  # ALiBi (Bloom, MPT): one slope per query head
Lambda = Float[Tensor, " d_head"]  # differential attention (DiffLlama): one of the vectors its lambda is made of
FoldedBias = Float[Tensor, "num_kv_heads group*seq kv_seq"]  # a score bias per folded query row and key (ALiBi)

# Rotary position embeddings: integer positions of the queries, and their cos/sin tables.
Positions = Int[Tensor, "batch seq"]
RotaryTable = Float[Tensor, "seq d_head"] | Float[Tensor, "#batch seq d_head"]
# Partial rotary (Phi, StableLM, GLM): the tables of the rotated part only, and its width, fixed by the module.
PartialRotaryTable = Float[Tensor, "#batch seq d_rope"] | Float[Tensor, "seq d_rope"]
RotarySizes = Shaped[Tensor, " d_rope"]

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
# A sliding-window cache keeps only the positions its window still sees; masks given with it cover
# every position seen, and are cut to the ones kept.
SeenAttnMask = (
    Bool[Tensor, "seq seen"]
    | Bool[Tensor, "#batch #num_heads seq seen"]
    | Float[Tensor, "seq seen"]
    | Float[Tensor, "#batch #num_heads seq seen"]
)
SeenPaddingMask = Bool[Tensor, "batch seen"]

# Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank bottleneck, keys and
# values rebuilt per head from one latent shared by all heads, which is all that is cached.
LatentSizes = Shaped[Tensor, "d_model num_heads kv_lora_rank d_nope d_rope d_value"]
QueryBottleneck = Float[Tensor, "batch seq q_lora_rank"]
LatentQueries = Float[Tensor, "batch seq num_heads*(d_nope+d_rope)"]
NopeQueries = Float[Tensor, "batch num_heads seq d_nope"]
RopeQueries = Float[Tensor, "batch num_heads seq d_rope"]
LatentQueryHeads = Float[Tensor, "batch num_heads seq d_nope+d_rope"]
CompressedKV = Float[Tensor, "batch seq kv_lora_rank+d_rope"]  # the latent and the rotary key, projected at once
NewLatent = Float[Tensor, "batch seq kv_lora_rank"]
NewRopeKey = Float[Tensor, "batch 1 seq d_rope"]  # one rotary key, shared by every head
RopeTable = Float[Tensor, "#batch seq d_rope"]
LatentBuffer = Float[Tensor, "batch capacity kv_lora_rank+d_rope"]
Latent = Float[Tensor, "batch kv_seq kv_lora_rank"]
RopeKey = Float[Tensor, "batch 1 kv_seq d_rope"]
ExpandedKV = Float[Tensor, "batch kv_seq num_heads*(d_nope+d_value)"]
LatentKeyHeads = Float[Tensor, "batch num_heads kv_seq d_nope+d_rope"]
ValueHeads = Float[Tensor, "batch num_heads kv_seq d_value"]
LatentOutHeads = Float[Tensor, "batch num_heads seq d_value"]
LatentMerged = Float[Tensor, "batch seq num_heads*d_value"]
LatentMask = Bool[Tensor, "#batch #num_heads #seq kv_seq"] | Float[Tensor, "#batch #num_heads #seq kv_seq"]
# Decoding by absorption: each head's query taken into the latent's space, attending the cache as it is.
LatentUpWeight = Float[Tensor, "num_heads*(d_nope+d_value) kv_lora_rank"]  # kv_b_proj.weight
AbsorbedQueries = Float[Tensor, "batch num_heads seq kv_lora_rank+d_rope"]
CacheEntries = Float[Tensor, "batch 1 kv_seq kv_lora_rank+d_rope"]  # latent and rotary key: the keys, one head
LatentValues = Float[Tensor, "batch 1 kv_seq kv_lora_rank"]
AbsorbedOut = Float[Tensor, "batch num_heads seq kv_lora_rank"]

# Serving: a packed batch (sequences end to end, no padding) and a paged cache (blocks of positions in one
# pool, a block table per sequence).
PackedTokens = Float[Tensor, "1 total d_model"]
CuSeqlens = Int[Tensor, " bounds"]
PagePool = Float[Tensor, "num_blocks block_size num_kv_heads d_head"]
BlockTable = Int[Tensor, "batch max_blocks"]
