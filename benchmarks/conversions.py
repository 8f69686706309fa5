"""What verifying a conversion costs: `from_hf` with and without its probe, measured side by side.

    python -m benchmarks.conversions [--d-model 4096] [--num-heads 32] [--num-kv-heads 8] [--rounds 5]

Each round builds the transformers layer (its load: random init, as `from_config` does), then converts
it with `verify=True` and with `verify=False`, in alternating order; the table gives the median times,
the median of the per-round ratios and their spread.
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(
        hidden_size=args.d_model, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads
    )
    times: dict[str, list[float]] = {"layer built": [], "from_hf verified": [], "from_hf, verify=False": []}
    ratios = []
    for round_ in range(args.rounds):
        start = time.perf_counter()
        layer = LlamaAttention(config, layer_idx=0)
        times["layer built"].append(time.perf_counter() - start)
        order = [True, False] if round_ % 2 == 0 else [False, True]
        took = {}
        for verify in order:
            start = time.perf_counter()
            ssm.MultiHeadAttention.from_hf(layer, verify=verify)
            took[verify] = time.perf_counter() - start
        times["from_hf verified"].append(took[True])
        times["from_hf, verify=False"].append(took[False])
        ratios.append(took[True] / took[False])
    table = Table(title=f"from_hf of LlamaAttention ({args.d_model} wide, {args.num_heads}/{args.num_kv_heads} heads, "
                  f"float32, {args.threads} thread(s), {args.rounds} rounds)")  # fmt: skip
    table.add_column("what")
    table.add_column("median s", justify="right")
    for name, values in times.items():
        table.add_row(name, f"{statistics.median(values):.3f}")
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
    table.add_row("verified / verify=False (ratio)", f"{statistics.median(ratios):.2f} (spread {spread})")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
