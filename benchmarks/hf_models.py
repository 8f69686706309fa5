"""A whole model with `attn_implementation="shapesafe"` against `"sdpa"`: 32 generated tokens, side by side.

    python -m benchmarks.hf_models [--rounds 10] [--threads 1]

A tiny Llama (d 256, 8/2 heads, 4 layers, float32), the same weights under each implementation, greedy
generation of 32 tokens from an 8-token prompt, alternating rounds; the median ratio and its spread.
"""

import argparse
import copy
import statistics

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.__main__ import rounds_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shapesafe_mha.hf

    shapesafe_mha.hf.register()
    config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512,
                         num_hidden_layers=4, vocab_size=1000, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    models = {name: AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name).eval()
              for name in ("sdpa", "shapesafe")}  # fmt: skip
    models["shapesafe"].load_state_dict(models["sdpa"].state_dict())
    ids = torch.randint(1, 1000, (1, 8))
    with torch.no_grad():
        outputs = {n: m.generate(ids, max_new_tokens=args.tokens, do_sample=False) for n, m in models.items()}
        if not torch.equal(outputs["sdpa"], outputs["shapesafe"]):
            raise SystemExit("the two implementations generated different tokens")
        runs = [lambda m=m: m.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
                for m in (models["shapesafe"], models["sdpa"])]  # fmt: skip
        ratios, ours, theirs = rounds_of(runs[0], runs[1], args.rounds, 1)
    times = {"sdpa": theirs, "shapesafe": ours}
    table = Table(title=f"generate {args.tokens} tokens, tiny Llama, {args.threads} thread(s), {args.rounds} rounds")
    table.add_column("attn_implementation")
    table.add_column("median ms", justify="right")
    for name, values in times.items():
        table.add_row(name, f"{statistics.median(values) * 1e3:.1f}")
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    table.add_row("shapesafe / sdpa (goal <= 1.05)", f"{statistics.median(ratios):.3f} (spread {spread})")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
