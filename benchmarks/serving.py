"""Serving shapes: packed prefill against the same sequences padded, paged decoding against a contiguous cache.

    python -m benchmarks.serving [--quick] [--rounds N] [--threads 1] [--markdown]

Rows at 1, 8 and 32 sequences of mixed lengths (drawn once, seeded). Each row runs its two contenders
alternately, round after round, and reports the median per-round ratio (as `python -m benchmarks` does):

- packed prefill (ours, `cu_seqlens`) / the same sequences padded to the longest, through ours
  (`key_padding_mask`) and through plain torch (`F.linear`, RoPE, `F.scaled_dot_product_attention(enable_gqa=True)`
  with the padding mask), each checked equal to ours first: goal <= 1.00;
- one decoding step of every sequence through a `PagedKVCache` / through a contiguous `KVCache` of the same
  sequences left-padded to the longest: goal <= 1.10; the same for a `LatentAttention` (MLA, one shared pool of
  latent entries / a contiguous `LatentCache`).

Then the bytes each decoding step allocates (every new storage, recorded at the dispatcher): a paged step
gathers the keys and values it attends to (the sequences' positions, not the pool) and never copies the pool.
"""

import argparse
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm
from benchmarks.__main__ import measure
from shapesafe_mha.testing import AllocationRecorder

D_MODEL, HEADS, KV_HEADS, BLOCK, THETA = 256, 8, 2, 16, 10000.0
LATENT = {"kv_lora_rank": 64, "d_nope": 32, "d_rope": 16, "d_value": 32}  # DeepSeek's proportions, scaled down


def lengths_of(count: int, seed: int = 0) -> list[int]:
    """Mixed prompt lengths, 16 to 256, the same every run."""
    draw = random.Random(seed + count)
    return [draw.randint(16, 256) for _ in range(count)]


def _padded(x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed tokens padded on the right to the longest, and the padding (True = padding)."""
    longest = max(lengths)
    padded = x.new_zeros(len(lengths), longest, x.shape[2])
    start = 0
    for i, n in enumerate(lengths):
        padded[i, :n] = x[0, start : start + n]
        start += n
    padding = torch.arange(longest)[None, :] >= torch.tensor(lengths)[:, None]
    return padded, padding


def torch_padded(module: ssm.MultiHeadAttention, x: torch.Tensor, padding: torch.Tensor) -> Callable[[], object]:
    """Plain torch on the padded batch, the module's computation written out: projections, views, RoPE (rotate-half;
    cos and sin made each call from the positions, as the module and transformers' rotary layers make them), SDPA
    with GQA and a causal & padding mask."""
    b, s, _ = x.shape
    w = module.weights()
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = (causal[None] & ~padding[:, None, :])[:, None]
    mask = mask | torch.eye(s, dtype=torch.bool)  # padded rows keep one key (their outputs are dropped anyway)
    d_head = D_MODEL // HEADS
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head))

    def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-second, first), dim=-1) * sin

    def run() -> object:
        angles = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq[None]
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos(), angles.sin()
        q = rotate(F.linear(x, w.w_q, w.b_q).view(b, s, HEADS, -1).transpose(1, 2), cos, sin)
        k = rotate(F.linear(x, w.w_k, w.b_k).view(b, s, KV_HEADS, -1).transpose(1, 2), cos, sin)
        v = F.linear(x, w.w_v, w.b_v).view(b, s, KV_HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(b, s, -1), w.w_o, w.b_o)

    return run


def decoders(
    module: ssm.MultiHeadAttention | ssm.LatentAttention, lengths: list[int]
) -> tuple[Callable[[], object], Callable[[], object]]:
    """One decoding step of every sequence, paged and contiguous (each undone after, so every round decodes the
    same step), the caches filled with the prompts first."""
    n, longest = len(lengths), max(lengths)
    blocks = sum(-(-(length + 1) // BLOCK) for length in lengths) + n
    paged = ssm.PagedKVCache.for_module(module, num_blocks=blocks, block_size=BLOCK)
    for _ in lengths:
        paged.add()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    prompts = torch.randn(1, sum(lengths), D_MODEL)
    contiguous = module.new_cache(n, longest + 1)
    with torch.no_grad():
        module(prompts, cu_seqlens=cu, is_causal=True, kv_cache=paged)
        padded, _ = _padded(prompts, lengths)
        left = torch.stack([padded[i].roll(longest - length, 0) for i, length in enumerate(lengths)])
        pads = torch.arange(longest + 1)[None, :] < (longest - torch.tensor(lengths))[:, None]
        positions = torch.tensor(lengths)[:, None]
        module(left, is_causal=True, kv_cache=contiguous, key_padding_mask=pads[:, :longest],
               positions=torch.arange(longest)[None] - (longest - torch.tensor(lengths))[:, None])  # fmt: skip
    x = torch.randn(n, 1, D_MODEL)

    def paged_step() -> object:
        state = paged.state()
        out = module(x, is_causal=True, kv_cache=paged)
        paged.restore(state)
        return out

    def contiguous_step() -> object:
        state = contiguous.state()
        out = module(x, is_causal=True, kv_cache=contiguous, key_padding_mask=pads, positions=positions)
        contiguous.restore(state)
        return out

    return paged_step, contiguous_step


def step_bytes(step: Callable[[], object]) -> tuple[int, int]:
    """Bytes one call allocates, in all and its largest single storage."""
    with torch.no_grad(), AllocationRecorder() as recorder:
        step()
    sizes = [a.nbytes for a in recorder.allocations]
    return sum(sizes), max(sizes, default=0)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every serving benchmark takes (rounds, threads, sequences per row); `settle` applies them."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per row (default 30; 8 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: least noise)")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 8, 32], help="sequences per row")
    return parser


def settle(args: argparse.Namespace) -> int:
    """Torch's threads and seed as `args` say; the rounds per row."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args.rounds or (8 if args.quick else 30)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown (for docs/serving.md)")
    args = parser.parse_args()
    rounds = settle(args)
    module = ssm.MultiHeadAttention(D_MODEL, HEADS, KV_HEADS, rope_theta=THETA, bias=False).eval()
    latent = ssm.LatentAttention(D_MODEL, HEADS, **LATENT).eval()
    rows: list[tuple[str, str, float, float, float, str]] = []
    memory: list[tuple[str, int, int, int, int, int]] = []
    with torch.no_grad():
        for count in args.counts:
            lengths = lengths_of(count)
            sizes = f"{count} seqs, {min(lengths)}..{max(lengths)} tokens"
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = torch.randn(1, sum(lengths), D_MODEL)
            padded, padding = _padded(x, lengths)

            def packed(x: torch.Tensor = x, cu: torch.Tensor = cu) -> object:
                return module(x, cu_seqlens=cu, is_causal=True)

            def ours_padded(padded: torch.Tensor = padded, padding: torch.Tensor = padding) -> object:
                return module(padded, is_causal=True, key_padding_mask=padding)

            inner = max(1, 64 // count)
            baseline = torch_padded(module, padded, padding)
            paged_step, contiguous_step = decoders(module, lengths)
            paged_latent, contiguous_latent = decoders(latent, lengths)
            # every pair computes the same thing (a ratio of two different computations measures nothing)
            unpadded = torch.cat([row[:n] for row, n in zip(baseline(), lengths, strict=True)])[None]
            torch.testing.assert_close(packed(), unpadded, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours_padded()[~padding], unpadded[0], atol=1e-4, rtol=1e-4)
            for step, other in ((paged_step, contiguous_step), (paged_latent, contiguous_latent)):
                torch.testing.assert_close(step(), other(), atol=1e-4, rtol=1e-4)
            for name, ours, theirs, calls, goal in (
                ("packed prefill / padded (ours)", packed, ours_padded, inner, "<= 1.00"),
                ("packed prefill / padded (torch)", packed, baseline, inner, "<= 1.00"),
                ("paged decode / contiguous decode", paged_step, contiguous_step, 8, "<= 1.10"),
                ("MLA paged decode / contiguous decode", paged_latent, contiguous_latent, 8, "<= 1.10"),
            ):
                rows.append((name, sizes, *measure(ours, theirs, rounds, calls), goal))
            paged_total, paged_largest = step_bytes(paged_step)
            contiguous_total, contiguous_largest = step_bytes(contiguous_step)
            pool = 2 * (sum(-(-(n + 1) // BLOCK) for n in lengths) + count) * BLOCK * KV_HEADS * (D_MODEL // HEADS) * 4
            memory.append((sizes, paged_total, paged_largest, contiguous_total, contiguous_largest, pool))
    _print(rows, memory, args.markdown)
    met = [float(r[2]) <= float(r[5].removeprefix("<= ")) for r in rows]
    print(f"goals met: {sum(met)} of {len(met)}; median ratio {statistics.median(r[2] for r in rows):.2f}")


def _print(rows: list, memory: list, markdown: bool) -> None:
    if markdown:
        print("| comparison | sizes | ratio | ours (ms) | baseline (ms) | goal |")
        print("|---|---|---|---|---|---|")
        for name, sizes, ratio, ours, baseline, goal in rows:
            print(f"| {name} | {sizes} | {ratio:.2f} | {ours * 1e3:.3f} | {baseline * 1e3:.3f} | {goal} |")
        print()
        print("| decoding step | paged: bytes allocated | largest | contiguous: bytes allocated | largest | pool |")
        print("|---|---|---|---|---|---|")
        for sizes, pt, pl, ct, cl, pool in memory:
            print(f"| {sizes} | {pt:,} | {pl:,} | {ct:,} | {cl:,} | {pool:,} |")
        return
    table = Table(title="serving shapes (ratios: ours / baseline, measured side by side)")
    for column in ("comparison", "sizes", "ratio", "ours ms", "baseline ms", "goal"):
        table.add_column(column, justify="left" if column in ("comparison", "sizes") else "right")
    for name, sizes, ratio, ours, baseline, goal in rows:
        table.add_row(name, sizes, f"{ratio:.2f}", f"{ours * 1e3:.3f}", f"{baseline * 1e3:.3f}", goal)
    Console(width=140).print(table)
    table = Table(title="bytes one decoding step allocates")
    for column in ("sizes", "paged", "largest", "contiguous", "largest", "paged pool"):
        table.add_column(column, justify="right")
    for sizes, pt, pl, ct, cl, pool in memory:
        table.add_row(sizes, f"{pt:,}", f"{pl:,}", f"{ct:,}", f"{cl:,}", f"{pool:,}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
