"""Ways to attend one decoding step over a paged cache, side by side: what the paged step runs, and two that read
the blocks where they lie.

    python -m benchmarks.paged_kernels [--quick] [--rounds N] [--threads 1] [--flex] [--device cpu]

A `PagedKVCache` is filled by a `MultiHeadAttention` (the serving benchmark's sizes: `d_model=256`, 8 heads, 2 KV
heads, blocks of 16, 1, 8 and 32 sequences of the same seeded lengths), its free list shuffled first so that each
sequence's blocks are scattered through the pool. Then one query a sequence attends to that sequence's keys, by:

- **gather** (what `PagedKVCache`'s decoding step does): each sequence's keys and values gathered from their
  blocks, right-aligned to the longest (one `index_select` each), then `F.scaled_dot_product_attention` with the
  padding masked: a copy of the keys attended, every step;
- **in place**: no copy of a key. Each block is scored against the queries of the sequence holding it in one
  batched matrix product over the pool as it lies (`(num_blocks, block_size, kv_heads * d_head)`, a view), the
  queries laid block-diagonally over the KV heads (`kv_heads` times the multiplications); the softmax runs over each
  sequence's blocks (`index_reduce_` and `index_add_` by owner), the values weighted in place the same way;
- **flex** (with `--flex`): `torch.compile(flex_attention)` over the whole pool as one sequence, a block mask
  letting each query see only its own sequence's positions (FlexAttention's paged decoding, a document mask).

Each way is checked against a per-sequence reference (its keys gathered block by block, plain softmax) before it is
timed; each ratio is the median of per-round ratios to **gather**, measured alternately in one run.
"""

import random
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm
from benchmarks.__main__ import measure
from benchmarks.serving import BLOCK, D_MODEL, HEADS, KV_HEADS, arguments, lengths_of, settle

D_HEAD = D_MODEL // HEADS


def filled(count: int, device: str) -> tuple[ssm.PagedKVCache, list[int], list[list[int]]]:
    """A paged cache holding `count` sequences' prompts, written by the module through `cu_seqlens`, its blocks
    handed out from a shuffled free list; the lengths and each sequence's block table."""
    lengths = lengths_of(count)
    module = ssm.MultiHeadAttention(D_MODEL, HEADS, KV_HEADS, rope_theta=10000.0, bias=False).eval().to(device)
    blocks = sum(-(-n // BLOCK) for n in lengths) + count
    cache = ssm.PagedKVCache.for_module(module, num_blocks=blocks, block_size=BLOCK)
    random.Random(0).shuffle(cache._free)  # (the free list: scattered blocks, as a long-running server's are)
    for _ in lengths:
        cache.add()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    with torch.no_grad():
        module(torch.randn(1, sum(lengths), D_MODEL, device=device), cu_seqlens=cu, is_causal=True, kv_cache=cache)
    tables = [[int(b) for b in row if b >= 0] for row in cache.block_table()]
    return cache, lengths, tables


def reference(cache: ssm.PagedKVCache, lengths: list[int], tables: list[list[int]], q: torch.Tensor) -> torch.Tensor:
    """Per sequence: its keys and values read block by block, GQA by `repeat_interleave`, softmax, weighted sum."""
    outs = []
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        k = torch.cat([cache.keys_pool[b] for b in table])[:n].transpose(0, 1)  # (kv_heads, n, d_head)
        v = torch.cat([cache.values_pool[b] for b in table])[:n].transpose(0, 1)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (k, v))
        weights = torch.softmax(q[i, :, None] @ k.transpose(-1, -2) / D_HEAD**0.5, dim=-1)
        outs.append((weights @ v)[:, 0])
    return torch.stack(outs)


def gather_way(cache: ssm.PagedKVCache, lengths: list[int], tables: list[list[int]]) -> Callable[..., torch.Tensor]:
    longest, device = max(lengths), cache.device
    slots = torch.zeros(len(lengths), longest, dtype=torch.int64)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        position = torch.arange(n)
        slots[i, longest - n :] = torch.tensor(table)[position // BLOCK] * BLOCK + position % BLOCK
    pad = torch.arange(longest)[None] < (longest - torch.tensor(lengths))[:, None]
    slots, keep = slots.reshape(-1).to(device), (~pad)[:, None, None].to(device)
    flat = (-1, KV_HEADS, D_HEAD)
    shape = (len(lengths), longest, KV_HEADS, D_HEAD)

    def run(q: torch.Tensor) -> torch.Tensor:
        k = cache.keys_pool.view(flat).index_select(0, slots).view(shape).transpose(1, 2)
        v = cache.values_pool.view(flat).index_select(0, slots).view(shape).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep, enable_gqa=True)[:, :, 0]

    return run


def in_place_way(cache: ssm.PagedKVCache, lengths: list[int], tables: list[list[int]]) -> Callable[..., torch.Tensor]:
    blocks, count, group, device = cache.num_blocks, len(lengths), HEADS // KV_HEADS, cache.device
    owner = torch.zeros(blocks, dtype=torch.int64)
    valid = torch.zeros(blocks, BLOCK, dtype=torch.bool)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        for j, block in enumerate(table):
            owner[block] = i
            valid[block, : min(BLOCK, n - j * BLOCK)] = True
    owner, hidden = owner.to(device), (~valid)[:, :, None].to(device)
    keys = cache.keys_pool.view(blocks, BLOCK, KV_HEADS * D_HEAD)  # views of the pools: nothing copied
    values = cache.values_pool.view(blocks, BLOCK, KV_HEADS * D_HEAD)

    def run(q: torch.Tensor) -> torch.Tensor:
        mine = q.index_select(0, owner).view(blocks, KV_HEADS, group, D_HEAD)  # each block's sequence's queries
        diagonal = q.new_zeros(blocks, KV_HEADS, D_HEAD, KV_HEADS, group)
        diagonal.diagonal(dim1=1, dim2=3).copy_(mine.permute(0, 3, 2, 1))  # KV head h's queries meet its keys only
        scores = torch.bmm(keys, diagonal.view(blocks, KV_HEADS * D_HEAD, HEADS)) * D_HEAD**-0.5
        scores = scores.masked_fill(hidden, float("-inf"))  # (blocks, block_size, heads)
        top = q.new_full((count, HEADS), float("-inf")).index_reduce_(0, owner, scores.amax(1), "amax")
        weights = torch.exp(scores - top.index_select(0, owner)[:, None])
        total = q.new_zeros(count, HEADS).index_add_(0, owner, weights.sum(1))
        summed = torch.bmm(weights.transpose(1, 2), values).view(blocks, KV_HEADS, group, KV_HEADS, D_HEAD)
        mine = summed.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(blocks, HEADS, D_HEAD)
        return q.new_zeros(count, HEADS, D_HEAD).index_add_(0, owner, mine) / total[:, :, None]

    return run


def flex_way(cache: ssm.PagedKVCache, lengths: list[int], tables: list[list[int]]) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    blocks, count, device = cache.num_blocks, len(lengths), cache.device
    owner = torch.full((blocks * BLOCK,), -1, dtype=torch.int64)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        for j, block in enumerate(table):
            owner[block * BLOCK : block * BLOCK + min(BLOCK, n - j * BLOCK)] = i
    owner = owner.to(device)

    def own(b: torch.Tensor, h: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return owner[key] == query

    mask = create_block_mask(own, 1, None, count, blocks * BLOCK, device=device)
    keys = cache.keys_pool.view(1, blocks * BLOCK, KV_HEADS, D_HEAD).transpose(1, 2)
    values = cache.values_pool.view(1, blocks * BLOCK, KV_HEADS, D_HEAD).transpose(1, 2)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q: torch.Tensor) -> torch.Tensor:
        out = compiled(q.transpose(0, 1)[None], keys, values, block_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # pyright: ignore[reportIndexIssue]

    return run


def timed(run: Callable[..., torch.Tensor], q: torch.Tensor, sync: Callable[[], None]) -> Callable[[], object]:
    """`run(q)`, waited for (a GPU's kernels finish inside the timed call)."""

    def call() -> object:
        out = run(q)
        sync()
        return out

    return call


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--flex", action="store_true", help="also FlexAttention, compiled (a compile per row)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="index_reduce")  # (beta, says torch 2.13; it is what reads by owner)
    rounds = settle(args)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    table = Table(title=f"a paged decoding step's attention, ways / gather ({args.device}, side by side)")
    for column in ("way", "sizes", "ratio", "ms", "gather ms", "largest error"):
        table.add_column(column, justify="left" if column in ("way", "sizes") else "right")
    ratios = []
    with torch.no_grad():
        for count in args.counts:
            cache, lengths, tables = filled(count, args.device)
            q = torch.randn(count, HEADS, D_HEAD, device=args.device)
            expected = reference(cache, lengths, tables, q)
            ways = {"gather": gather_way, "in place": in_place_way} | ({"flex": flex_way} if args.flex else {})
            runs = {name: make(cache, lengths, tables) for name, make in ways.items()}
            errors = {}
            for name, run in runs.items():
                got = run(q)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
                errors[name] = float((got - expected).abs().max())
            sizes = f"{count} seqs, {min(lengths)}..{max(lengths)} tokens"
            for name, run in runs.items():
                if name == "gather":
                    continue
                ratio, ours, theirs = measure(timed(run, q, sync), timed(runs["gather"], q, sync), rounds, 8)
                ratios.append(ratio)
                times = f"{ours * 1e3:.3f}", f"{theirs * 1e3:.3f}"
                table.add_row(name, sizes, f"{ratio:.2f}", *times, f"{errors[name]:.1e}")
    Console(width=140).print(table)
    print(f"median ratio to gather: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
