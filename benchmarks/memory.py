"""Memory of one decoding step: MHA vs GQA vs MQA, and our GQA vs the common repeat-KV implementation.

Every allocation during the step is recorded at the dispatcher (`AllocationRecorder`), so the
numbers are what the operators really allocated, in this run, side by side.

    python -m benchmarks.memory [--d-model 4096 --num-heads 32 --num-kv-heads 8 --cache 1024 --device cpu]
"""

import argparse

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm
from shapesafe_mha.testing import AllocationRecorder


def _repeat_kv_step(module: ssm.MultiHeadAttention, x: torch.Tensor, cache: ssm.KVCache) -> torch.Tensor:
    """The common GQA decode step: append to the cache, then expand K/V to num_heads heads (a copy)."""
    b, s, _ = x.shape
    q = module.q_proj(x).view(b, s, module.num_heads, module.d_head).transpose(1, 2)
    k = module.k_proj(x).view(b, s, module.num_kv_heads, module.d_head).transpose(1, 2)
    v = module.v_proj(x).view(b, s, module.num_kv_heads, module.d_head).transpose(1, 2)
    keys, values = cache.append(k, v)
    group = module.group
    keys = keys[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, module.num_heads, -1, module.d_head)
    values = values[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, module.num_heads, -1, module.d_head)
    out = F.scaled_dot_product_attention(q, keys, values)
    return module.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _step_bytes(module: ssm.MultiHeadAttention, cached: int, device: str, repeat_kv: bool) -> tuple[int, int]:
    """Bytes allocated by one decode step against `cached` positions, and the cache's bytes."""
    cache = module.new_cache(batch=1, capacity=cached + 1)
    past = torch.zeros(1, module.num_kv_heads, cached, module.d_head, device=device)
    cache.append(past, past)
    x = torch.randn(1, 1, module.d_model, device=device)
    with torch.no_grad(), AllocationRecorder() as recorder:
        if repeat_kv:
            _repeat_kv_step(module, x, cache)
        else:
            module(x, is_causal=True, kv_cache=cache)
    return sum(a.nbytes for a in recorder.allocations), cache.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--cache", type=int, default=1024, help="positions already cached")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    rows = []
    for label, kv_heads, repeat in (
        ("MHA", args.num_heads, False),
        (f"GQA ({args.num_kv_heads} KV heads)", args.num_kv_heads, False),
        ("MQA", 1, False),
        (f"GQA, repeat-KV ({args.num_kv_heads} KV heads)", args.num_kv_heads, True),
    ):
        module = ssm.MultiHeadAttention(args.d_model, args.num_heads, kv_heads, device=args.device).eval()
        step, cache = _step_bytes(module, args.cache, args.device, repeat)
        rows.append((label, step, cache))

    mha_step, mha_cache = rows[0][1], rows[0][2]
    ours_gqa_step = rows[1][1]
    table = Table(
        title=f"One decode step, d_model={args.d_model}, {args.num_heads} heads, {args.cache} cached positions"
    )
    for column in ("attention", "allocated per step", "vs MHA", "KV cache", "cache vs MHA", "step vs our GQA"):
        table.add_column(column, justify="left" if column == "attention" else "right")
    for label, step, cache in rows:
        table.add_row(
            label,
            f"{step / 2**20:.2f} MiB",
            f"{step / mha_step:.3f}",
            f"{cache / 2**20:.1f} MiB",
            f"{cache / mha_cache:.3f}",
            f"{step / ours_gqa_step:.2f}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
