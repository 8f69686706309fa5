"""Head-parallel attention on torch.distributed (gloo on CPU, NCCL on GPUs)."""

from ._modules.parallel import HeadParallelAttention as HeadParallelAttention
from ._modules.parallel import HeadShard as HeadShard
from ._modules.parallel import plan_heads as plan_heads
from ._modules.parallel import working_world_sizes as working_world_sizes

__all__ = ["HeadParallelAttention", "HeadShard", "plan_heads", "working_world_sizes"]
