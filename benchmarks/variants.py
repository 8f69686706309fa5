"""The attention variants, measured side by side: checks on vs off per variant, and latent attention against a
K/V cache at every head (cache bytes and decode time).

    python -m benchmarks.variants [--quick] [--threads 1]
"""

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm
from benchmarks.__main__ import Comparison, measure, unchecked
from shapesafe_mha._modules.latent import LatentAttention

CACHED = 256


@contextlib.contextmanager
def rebuilding() -> Iterator[None]:
    """Latent attention decoding by rebuilding every cached position's keys and values (no absorption)."""
    original = LatentAttention._absorbs
    LatentAttention._absorbs = lambda self, query: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        LatentAttention._absorbs = original  # type: ignore[method-assign]


def decode_step(module: Any, capacity: int, cached: int = CACHED) -> Callable[[], object]:
    """One token against a cache that has seen `cached` positions (the cache is rewound each call).

    A sliding-window cache is filled by decoding, so it is in the state a long generation leaves it in.
    """
    cache = module.new_cache(1, capacity)
    with torch.no_grad():
        module(torch.randn(1, cached, module.d_model), is_causal=True, kv_cache=cache)
    state = cache.state()
    x = torch.randn(1, 1, module.d_model)

    def step() -> object:
        cache.restore(state)
        return module(x, is_causal=True, kv_cache=cache)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: least noise)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds = 15 if args.quick else 60
    gqa: dict[str, Any] = {"d_model": 512, "num_heads": 8, "num_kv_heads": 2, "rope_theta": 10000.0}
    variants: dict[str, tuple[dict[str, Any], int]] = {
        "QK-norm (Qwen3)": ({"qk_norm": True}, CACHED + 1),
        "sliding window 128, cache 256 (Mistral)": ({"window": 128}, 2 * 128),
        "softcap 50, scalar 256 (Gemma 2)": ({"logit_softcap": 50.0, "query_pre_attn_scalar": 256}, CACHED + 1),
    }
    results: list[Comparison] = []
    with torch.no_grad():
        for name, (options, capacity) in variants.items():
            module = ssm.MultiHeadAttention(**gqa, **options).eval()
            step = decode_step(module, capacity)
            ratio, a, b = measure(step, unchecked(step), rounds, 20)
            results.append(
                Comparison(f"decode {name}: checked / unchecked", "GQA 512, 8/2, RoPE", ratio, a, b, "<= 1.05")
            )
        mla = ssm.LatentAttention(512, 8, q_lora_rank=192, kv_lora_rank=128, d_nope=64, d_rope=32, d_value=64).eval()
        step = decode_step(mla, CACHED + 1)
        ratio, a, b = measure(step, unchecked(step), rounds, 20)
        sizes = "512, 8 heads, latent 128+32"
        results.append(Comparison("decode latent attention: checked / unchecked", sizes, ratio, a, b, "<= 1.05"))
        mha = ssm.MultiHeadAttention(512, 8, d_head=96, rope_theta=10000.0).eval()  # K as wide as MLA's (64 + 32)
        mla_step, mha_step = decode_step(mla, CACHED + 1), decode_step(mha, CACHED + 1)
        ratio, a, b = measure(mla_step, mha_step, rounds, 20)
        results.append(
            Comparison("decode: latent (absorbed) / K/V cache", f"{sizes} vs MHA d_head 96", ratio, a, b, "-")
        )
        rebuilt_step = lambda: mla_step()  # noqa: E731  (a distinct contender)
        ratio, a, b = measure(mla_step, (rebuilt_step, rebuilding), rounds, 20)
        results.append(Comparison("decode: latent absorbed / rebuilt", sizes, ratio, a, b, "<= 1.00"))
    latent_bytes = mla.new_cache(1, CACHED + 1).nbytes
    kv_bytes = mha.new_cache(1, CACHED + 1).nbytes

    console = Console(width=150)
    table = Table(title=f"variants ({args.threads} thread(s), median of {rounds} alternating rounds)")
    for column in ("comparison", "sizes", "ratio", "goal", "ours (median)", "baseline (median)"):
        table.add_column(
            column, justify="right" if column in ("ratio", "ours (median)", "baseline (median)") else "left"
        )
    for c in results:
        goal = c.goal if c.goal == "-" else f"{c.goal} {'met' if c.met else 'NOT met'}"
        table.add_row(c.name, c.sizes, f"{c.ratio:.3f}", goal, f"{c.ours * 1e6:.1f} us", f"{c.baseline * 1e6:.1f} us")
    console.print(table)
    console.print(
        f"cache for {CACHED + 1} positions: latent {latent_bytes} bytes, K/V at 8 heads {kv_bytes} bytes "
        f"(latent / K/V = {latent_bytes / kv_bytes:.3f})"
    )


if __name__ == "__main__":
    main()
