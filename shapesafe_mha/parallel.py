"""Head-parallel attention on torch.distributed (gloo on CPU, NCCL on GPUs)."""

from ._parallel import HeadParallelAttention as HeadParallelAttention
from ._parallel import HeadShard as HeadShard
from ._parallel import plan_heads as plan_heads
from ._parallel import working_world_sizes as working_world_sizes

__all__ = ["HeadParallelAttention", "HeadShard", "plan_heads", "working_world_sizes"]
