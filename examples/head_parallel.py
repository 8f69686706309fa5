"""Head-parallel GQA attention over every process of a torchrun job, checked against one device.

    torchrun --nproc-per-node 2 examples/head_parallel.py

gloo on CPU; with one GPU per process, NCCL and CUDA (set SHAPESAFE_DEVICE=cuda).
"""

import os

import torch
import torch.distributed as dist

import shapesafe_mha as ssm
from shapesafe_mha.parallel import HeadParallelAttention

device = os.environ.get("SHAPESAFE_DEVICE", "cpu")
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same weights and inputs on every rank
full = ssm.MultiHeadAttention(d_model=256, num_heads=8, num_kv_heads=2, device=device)
attn = HeadParallelAttention.from_module(full)  # this rank keeps its query heads and their KV heads
x = torch.randn(2, 16, 256, device=device)

out = attn(x, is_causal=True)  # replicated in, replicated out
torch.testing.assert_close(out, full(x, is_causal=True), atol=1e-5, rtol=1e-5)

cache = attn.new_cache(batch=2, capacity=16)  # per-rank cache of this rank's KV heads
steps = [attn(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(16)]
torch.testing.assert_close(torch.cat(steps, dim=1), out, atol=1e-5, rtol=1e-5)

print(f"rank {rank}/{world}: query heads {list(attn.shard.q_heads)}, KV heads {list(attn.shard.kv_heads)}: equal")
dist.destroy_process_group()
