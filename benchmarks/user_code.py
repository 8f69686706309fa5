"""What `@ssm.shapecheck` costs a user's own attention, measured side by side after the first call.

    python -m benchmarks.user_code [--rounds 60] [--threads 1]

A user's GQA layer (d_model 256, 8/2 heads, (1, 16, 256)) made of four functions of their own plus our
public stages: decorated, and the same functions undecorated (their `__wrapped__`), alternating round
after round; the median of the per-round ratios and their spread.
"""

import argparse
import statistics
from collections.abc import Callable

import torch
from jaxtyping import Float
from rich.console import Console
from rich.table import Table
from torch import Tensor

import shapesafe_mha as ssm
from benchmarks.__main__ import rounds_of
from shapesafe_mha.dims import Heads, Inner, KVHeads, Tokens, Weight


@ssm.shapecheck
def project(x: Tokens, weight: Weight) -> Float[Tensor, "batch seq d_out"]:
    return x @ weight.T


@ssm.shapecheck
def scale_queries(q: Heads, log_temp: Float[Tensor, " num_heads"]) -> Heads:
    return q * log_temp.exp()[:, None, None]


@ssm.shapecheck
def attend(q: Heads, k: KVHeads, v: KVHeads) -> Heads:
    return ssm.scaled_dot_product_attention(q, k, v, is_causal=True)


@ssm.shapecheck
def output(merged: Inner, weight: Float[Tensor, "d_model d_inner"]) -> Tokens:
    return merged @ weight.T


def layer(decorated: bool, weights: dict[str, Tensor], x: Tensor) -> Callable[[], Tensor]:
    fns = [project, scale_queries, attend, output]
    p, s, a, o = fns if decorated else [f.__wrapped__ for f in fns]  # type: ignore[attr-defined]

    def run() -> Tensor:
        q = ssm.split_heads(p(x, weights["q"]), 8)
        k = ssm.split_heads(p(x, weights["k"]), 2)
        v = ssm.split_heads(p(x, weights["v"]), 2)
        return o(ssm.merge_heads(a(s(q, weights["t"]), k, v)), weights["o"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = {"q": torch.randn(256, 256), "k": torch.randn(64, 256), "v": torch.randn(64, 256),
               "o": torch.randn(256, 256), "t": torch.zeros(8)}  # fmt: skip
    x = torch.randn(1, 16, 256)
    decorated, undecorated = layer(True, weights, x), layer(False, weights, x)
    with torch.no_grad():
        torch.testing.assert_close(decorated(), undecorated())  # and the first call
        ratios, ours, plain = rounds_of(decorated, undecorated, args.rounds, args.calls)
    times = {"decorated": ours, "undecorated": plain}
    table = Table(title=f"a user's GQA layer, (1, 16, 256), 8/2 heads, {args.threads} thread(s), {args.rounds} rounds")
    table.add_column("contender")
    table.add_column("median us", justify="right")
    for name, values in times.items():
        table.add_row(name, f"{statistics.median(values) * 1e6:.1f}")
    quartiles = statistics.quantiles(ratios, n=4)
    table.add_row("decorated / undecorated (goal <= 1.05)",
                  f"{statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})")  # fmt: skip
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
