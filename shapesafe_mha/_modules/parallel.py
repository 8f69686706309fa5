"""Head-parallel attention on torch.distributed: query heads split across ranks, KV heads with them.

Megatron-style tensor parallelism on the head axis: q/k/v projections are column-parallel (each
rank keeps the rows of its heads), the output projection row-parallel (each rank keeps the columns
of its heads), so each rank computes a partial output and one all-reduce sums them.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._compute.cache import KVCache
from .._core import probe
from .._core.contract import checks_enabled
from .._core.errors import ConfigError, ShapeError
from .config import OPTIONS, SIZES
from .multihead import DERIVED, MultiHeadAttention
from .plan import PARTS


@dataclass(frozen=True)
class HeadShard:
    """Which heads one rank holds: a contiguous range of query heads and the KV heads they read."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    q_heads: range
    kv_heads: range
    replicated_kv: bool  # True when several ranks hold copies of the same KV head

    @property
    def local_heads(self) -> int:
        return len(self.q_heads)

    @property
    def local_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def kv_sharers(self) -> list[int]:
        """The ranks (in the group) holding this rank's KV heads, this one included."""
        if not self.replicated_kv:
            return [self.rank]
        per_kv = self.world_size // self.num_kv_heads
        first = self.kv_heads.start * per_kv
        return list(range(first, first + per_kv))


def working_world_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """World sizes over which `num_heads` query heads and `num_kv_heads` KV heads can be split."""
    return [
        w for w in range(1, num_heads + 1) if num_heads % w == 0 and (num_kv_heads % w == 0 or w % num_kv_heads == 0)
    ]


def plan_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Assign rank `rank` of `world_size` its heads, or raise `ConfigError` (before any communication).

    Query heads `[rank*H/W, (rank+1)*H/W)`. KV heads are sharded with their query groups when
    `num_kv_heads % W == 0`; when `W % num_kv_heads == 0` each KV head is replicated on the ranks
    whose query heads read it (MQA works for any `W` that divides `num_heads`).

    Example:
        >>> from shapesafe_mha.parallel import plan_heads
        >>> shard = plan_heads(32, 8, world_size=4, rank=1)
        >>> shard.q_heads, shard.kv_heads, shard.replicated_kv
        (range(8, 16), range(2, 4), False)
        >>> plan_heads(32, 2, world_size=4, rank=3).kv_heads
        range(1, 2)

    Raises:
        ConfigError: the heads cannot be split over `world_size` ranks; the message lists sizes that work.
    """
    working = working_world_sizes(num_heads, num_kv_heads)
    if world_size not in working:
        raise ConfigError(
            f"HeadParallelAttention: num_heads={num_heads}, num_kv_heads={num_kv_heads} cannot be split over "
            f"world_size={world_size}: each rank needs whole query heads, and KV heads must divide among ranks "
            f"or ranks among KV heads; world sizes that work: {working}."
        )
    per_rank = num_heads // world_size
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads % world_size == 0:
        per_rank_kv = num_kv_heads // world_size
        kv_heads = range(rank * per_rank_kv, (rank + 1) * per_rank_kv)
        return HeadShard(rank, world_size, num_heads, num_kv_heads, q_heads, kv_heads, False)
    group = num_heads // num_kv_heads
    kv_head = q_heads.start // group
    return HeadShard(rank, world_size, num_heads, num_kv_heads, q_heads, range(kv_head, kv_head + 1), True)


def refuse_unsharded_norm(module: MultiHeadAttention, owner: str) -> None:
    """Raise `ConfigError` where a rank holding some of the heads cannot compute the layer (a QK-norm over every
    head at once, differential attention's pairs of heads half the heads apart: `AttentionConfig.across_heads`)."""
    across = module.config.across_heads()
    if across is not None:
        raise ConfigError(f"{owner}: {across}")


def _of_each_head(weight: Tensor) -> bool:
    """Whether a QK-norm's weight has a row for each head, `(heads, d_head)` (Cohere's), not one for every head."""
    return weight.dim() == 2


def _rows(heads: range, d_head: int) -> slice:
    return slice(heads.start * d_head, heads.stop * d_head)


def _local_share(module: MultiHeadAttention, shard: HeadShard) -> tuple[MultiHeadAttention, nn.Parameter | None]:
    """This rank's `MultiHeadAttention` (every option of `module`, its heads' rows) and the output bias apart."""
    weight = module.q_proj.weight
    # every option of the module, described once (`config`): a temperature or chunk mask is by position, the same
    # on every rank's heads
    config = dataclasses.replace(
        module.config, num_heads=shard.local_heads, num_kv_heads=shard.local_kv_heads, d_head=module.d_head, bias=True
    )
    local = MultiHeadAttention.from_config(config, device=weight.device, dtype=weight.dtype)
    q_rows, kv_rows = _rows(shard.q_heads, module.d_head), _rows(shard.kv_heads, module.d_head)
    per_query_head = module.q_proj.weight.shape[0] // module.num_heads  # 2 * d_head with an output gate
    with torch.no_grad():
        for mine, full, rows in (
            (local.q_proj, module.q_proj, _rows(shard.q_heads, per_query_head)),
            (local.k_proj, module.k_proj, kv_rows),
            (local.v_proj, module.v_proj, kv_rows),
        ):
            mine.weight.copy_(full.weight[rows])
            if full.bias is None:
                mine.register_parameter("bias", None)
            else:
                mine.bias.copy_(full.bias[rows])  # pyright: ignore[reportOptionalMemberAccess]
        local.o_proj.weight.copy_(module.o_proj.weight[:, q_rows])
        if module.sinks is not None:  # one logit per query head: this rank's heads'
            local.sinks.copy_(module.sinks[shard.q_heads.start : shard.q_heads.stop])  # pyright: ignore[reportOptionalMemberAccess]
        if module.alibi_slopes is not None:  # one slope per query head: this rank's heads' (not the sequence's start)
            local.alibi_slopes.copy_(module.alibi_slopes[shard.q_heads.start : shard.q_heads.stop])  # pyright: ignore[reportOptionalMemberAccess]
        for name, heads in (("q_norm", shard.q_heads), ("k_norm", shard.kv_heads)):
            if name in module._modules:  # one weight per feature of a head for every head, or each head's own row
                mine_norm: Any = local._modules[name]
                held = getattr(module, name).weight
                mine_norm.weight.copy_(held[heads.start : heads.stop] if _of_each_head(held) else held)
    local.o_proj.register_parameter("bias", None)  # the output bias is added once, after the sum
    out_bias = None
    if module.o_proj.bias is not None:
        out_bias = nn.Parameter(module.o_proj.bias.detach().clone())
    return local, out_bias


class _CopyToHeads(torch.autograd.Function):
    """Forward: the replicated input as is. Backward: sum the input's gradient over the ranks."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumPartials(torch.autograd.Function):
    """Forward: all-reduce (sum) the partial outputs. Backward: the gradient as is (it is replicated)."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, group: Any) -> Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return grad, None


class _GatherHeads(torch.autograd.Function):
    """Forward: all-gather per-rank weights along the heads axis. Backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, rank: int) -> Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx.rank, ctx.heads = rank, local.shape[1]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return grad[:, ctx.rank * ctx.heads : (ctx.rank + 1) * ctx.heads], None, None


# What a HeadParallelAttention's shard holds for it: the options, what a module derives from them (but `group`: its own
# is the process group) and the parts they build.
_SHARDS = frozenset(OPTIONS) - frozenset(SIZES) | frozenset(DERIVED) - {"group"} | frozenset(PARTS)


class HeadParallelAttention(nn.Module):
    """`MultiHeadAttention` split by heads across the ranks of a torch.distributed process group.

    Build it on every rank with `from_module`, from a module holding the same weights everywhere.
    Replicated input in, replicated output out: each rank runs its heads, and an autograd-aware
    all-reduce sums the partial outputs, so training works (gradients of KV heads replicated on
    several ranks are summed among those ranks, keeping the copies equal).

    Example (under `torchrun --nproc-per-node 2`):

        dist.init_process_group("gloo")
        torch.manual_seed(0)  # the same weights on every rank
        full = ssm.MultiHeadAttention(4096, 32, 8)
        attn = HeadParallelAttention.from_module(full)   # this rank: 16 query heads, 4 KV heads
        out = attn(x, is_causal=True)                     # equal to full(x, is_causal=True)
    """

    def __init__(self, local: MultiHeadAttention, out_bias: nn.Parameter | None, shard: HeadShard, group: Any) -> None:
        super().__init__()
        self.local = local
        self.out_bias = out_bias
        self.shard = shard
        self.group = group
        self.d_model = local.d_model
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.d_head = local.d_head

    def __setattr__(self, name: str, value: Any) -> None:
        # Built: an option, or what a module derives or builds from them, is the shard's (set there: followed, or
        # refused as MultiHeadAttention refuses it); the sizes split the heads, so another value of one is refused.
        # (Set as a plain attribute, either would be ignored.)
        if "d_head" in self.__dict__:
            if name in _SHARDS:
                setattr(self.local, name, value)
                return
            if name in SIZES and value != getattr(self, name):
                raise ConfigError(
                    f"HeadParallelAttention: {name} cannot be set on a built one: the heads were split by it. Split "
                    "a module of those sizes: HeadParallelAttention.from_module(module)."
                )
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name in _SHARDS and "local" in self._modules:  # the shard's, as set (`__setattr__`)
            return getattr(self._modules["local"], name)
        return super().__getattr__(name)

    @classmethod
    def from_module(
        cls, module: MultiHeadAttention, group: Any = None, *, verify: bool = True
    ) -> "HeadParallelAttention":
        """Keep this rank's share of `module`: its query heads, the KV heads they read, `o_proj`'s columns.

        Every option of `module` is carried (its `config`, each `AttentionConfig` field; attention sinks and ALiBi
        slopes each rank its heads'; the biases each projection has). The QK-norm weights, whole on every rank, get
        the gradient summed over the ranks; weights of each head (Cohere's) are split with their heads, each rank
        holding its heads' rows. The result is
        verified: on a float64 copy, a causal forward and a decoding step of the probe, computed head-parallel
        (collective: every rank joins), equal `module`'s (`verify=False` skips it).

        Raises:
            ConfigError: torch.distributed is not initialised, or the heads cannot be split over the
                group's size (raised on every rank, before any communication), or the shards differ
                from `module` on the probe.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "HeadParallelAttention.from_module(): torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first (torchrun sets the environment for it)."
            )
        refuse_unsharded_norm(module, "HeadParallelAttention.from_module()")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        shard = plan_heads(module.num_heads, module.num_kv_heads, world, rank)
        local, out_bias = _local_share(module, shard)
        parallel = cls(local, out_bias, shard, group)
        parallel.train(module.training)
        if verify and probe.probeable(module):
            with probe.probing(local) as mine, probe.probing(module) as full:
                dtype = probe.dtype_of(mine)
                bias = None if out_bias is None else nn.Parameter(out_bias.detach().to(dtype))
                x = probe.probe_tokens(module.d_model, module.q_proj.weight.device, dtype)
                probe.verify("HeadParallelAttention.from_module()", probe.our_outputs(cls(mine, bias, shard, group), x),
                             probe.our_outputs(full, x), source="the unsharded module")  # fmt: skip
        parallel._sync_replicated_kv_gradients()
        parallel._sync_shared_norm_gradients()
        return parallel

    def _sync_shared_norm_gradients(self) -> None:
        """QK-norm weights are every head's, held whole on every rank: each rank's gradient is its heads' share,
        so the shares are summed over the group in backward, and every rank's optimizer steps alike. Weights of each
        head (Cohere's) are the rank's own rows: nothing to sum (a replicated KV head's are summed with its
        projections)."""
        for name in ("q_norm", "k_norm"):
            norm: Any = self.local._modules.get(name)
            if norm is not None and not _of_each_head(norm.weight):
                norm.weight.register_hook(lambda grad: _summed(grad, self.group))

    def _sync_replicated_kv_gradients(self) -> None:
        """Sum the gradients of replicated KV heads over the ranks sharing them, in backward (collective in the group).

        One all-reduce over the group sums every KV head's copies at once (`_summed_by_kv_head`), rather than one per
        subgroup of sharers: `dist.new_group` must be entered by every rank of the world with the same ranks, which
        ranks of another group (building their own subgroups, or none) never do, and then hangs or mixes groups.
        """
        shard = self.shard
        if not shard.replicated_kv:
            return
        k_norm: Any = self.local._modules.get("k_norm")
        k_norm = k_norm if k_norm is not None and _of_each_head(k_norm.weight) else None
        for proj in (self.local.k_proj, self.local.v_proj, *([k_norm] if k_norm is not None else [])):
            for param in proj.parameters():
                param.register_hook(lambda grad: _summed_by_kv_head(grad, shard, self.group))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """A `KVCache` for this rank's KV heads."""
        return self.local.new_cache(batch, capacity)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`MultiHeadAttention.forward`, computed head-parallel; the same arguments and result on every rank."""
        key = query if key is None else key
        value = key if value is None else value
        if attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] != 1:
            if checks_enabled() and attn_mask.shape[1] != self.num_heads:
                raise ShapeError(
                    f"HeadParallelAttention.forward(): attn_mask has num_heads={attn_mask.shape[1]} (axis 1), but "
                    f"the module has num_heads={self.num_heads} (or 1, to broadcast)."
                )
            attn_mask = attn_mask[:, self.shard.q_heads.start : self.shard.q_heads.stop]
        parallel = self.shard.world_size > 1
        if parallel and torch.is_grad_enabled():
            # Inputs are replicated: their gradients are the sum of every rank's contribution.
            same = key is query, value is key
            query = _CopyToHeads.apply(query, self.group)  # pyright: ignore[reportAssignmentType]
            key = query if same[0] else _CopyToHeads.apply(key, self.group)  # pyright: ignore[reportAssignmentType]
            value = key if same[1] else _CopyToHeads.apply(value, self.group)  # pyright: ignore[reportAssignmentType]
        result = self.local(
            query,
            key,
            value,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            need_weights=need_weights,
            kv_cache=kv_cache,
            positions=positions,
        )
        # The local module has checked its result: (batch, seq, d_model), and the weights at its heads.
        partial, weights = result if isinstance(result, tuple) else (result, None)
        out: Tensor = _SumPartials.apply(partial, self.group) if parallel else partial  # pyright: ignore[reportAssignmentType]
        if self.out_bias is not None:
            out = out + self.out_bias
        if weights is None:
            return out
        if parallel:
            weights = _GatherHeads.apply(weights, self.group, self.shard.rank)
        return out, weights  # pyright: ignore[reportReturnType]

    def gather_gradients(self) -> dict[str, Tensor]:
        """The full module's gradients, assembled from every rank's share (collective: every rank calls it).

        Keys are `MultiHeadAttention` parameter names (`q_proj.weight`, ...); a missing gradient is zeros.
        """
        shard, d_head, d_model = self.shard, self.d_head, self.d_model
        per_query_head = self.local.q_proj.weight.shape[0] // shard.local_heads  # 2 * d_head with an output gate
        layout = {
            "q_proj": (self.local.q_proj, _rows(shard.q_heads, per_query_head), self.num_heads * per_query_head),
            "k_proj": (self.local.k_proj, _rows(shard.kv_heads, d_head), self.num_kv_heads * d_head),
            "v_proj": (self.local.v_proj, _rows(shard.kv_heads, d_head), self.num_kv_heads * d_head),
        }
        grads: dict[str, Tensor] = {}
        for name, (proj, rows, width) in layout.items():
            for kind, param in (("weight", proj.weight), ("bias", proj.bias)):
                if param is None:
                    continue
                full = param.new_zeros((width, d_model) if kind == "weight" else (width,))
                if param.grad is not None and (
                    not shard.replicated_kv or name == "q_proj" or shard.rank == shard.kv_sharers[0]
                ):
                    full[rows] = param.grad  # replicated KV gradients are already summed: count them once
                dist.all_reduce(full, group=self.group)
                grads[f"{name}.{kind}"] = full
        o_weight = self.local.o_proj.weight
        full = o_weight.new_zeros((d_model, self.num_heads * d_head))
        if o_weight.grad is not None:
            full[:, _rows(shard.q_heads, d_head)] = o_weight.grad
        dist.all_reduce(full, group=self.group)
        grads["o_proj.weight"] = full
        sinks = self.local.sinks
        if sinks is not None:  # one per query head: this rank's heads'
            full = sinks.new_zeros(self.num_heads)
            if sinks.grad is not None:
                full[shard.q_heads.start : shard.q_heads.stop] = sinks.grad
            dist.all_reduce(full, group=self.group)
            grads["sinks"] = full
        for name, heads, count in (("q_norm", shard.q_heads, self.num_heads), ("k_norm", shard.kv_heads,
                                                                              self.num_kv_heads)):  # fmt: skip
            norm: Any = self.local._modules.get(name)
            if norm is not None and _of_each_head(norm.weight):  # each rank's rows, a replicated KV head's counted once
                full = norm.weight.new_zeros((count, d_head))
                if norm.weight.grad is not None and (
                    not shard.replicated_kv or name == "q_norm" or shard.rank == shard.kv_sharers[0]
                ):
                    full[heads.start : heads.stop] = norm.weight.grad
                dist.all_reduce(full, group=self.group)
                grads[f"{name}.weight"] = full
            elif norm is not None:  # summed over the ranks in backward already
                grad = norm.weight.grad
                grads[f"{name}.weight"] = grad.clone() if grad is not None else torch.zeros_like(norm.weight)
        if self.out_bias is not None:
            bias_grad = self.out_bias.grad
            grads["o_proj.bias"] = bias_grad.clone() if bias_grad is not None else torch.zeros_like(self.out_bias)
        return grads


def _summed(grad: Tensor, group: Any) -> Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def _summed_by_kv_head(grad: Tensor, shard: HeadShard, group: Any) -> Tensor:
    """The sum of `grad` over the ranks holding the same (replicated) KV head: each rank fills its head's slot."""
    slots = grad.new_zeros((shard.num_kv_heads, *grad.shape))
    slots[shard.kv_heads.start] = grad
    dist.all_reduce(slots, group=group)
    return slots[shard.kv_heads.start].clone()
