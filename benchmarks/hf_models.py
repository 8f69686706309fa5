"""Whole models, 32 generated tokens side by side: `attn_implementation="shapesafe"` against `"sdpa"`, and
`replace_attention(model)` against the model as built.

    python -m benchmarks.hf_models [--rounds 10] [--tokens 32] [--threads 1]

A tiny Llama (d 256, 8/2 heads, 4 layers, float32), the same weights in each contender, greedy
generation of 32 tokens from an 8-token prompt. Each pair runs in alternating rounds of its own
(`rounds_of`), one pair after the other in the same process: the median ratio and its spread.
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
    models["replace_attention"] = copy.deepcopy(models["sdpa"])
    done = shapesafe_mha.hf.replace_attention(models["replace_attention"])
    if done.left:
        raise SystemExit(f"replace_attention left layers: {done.left}")
    ids = torch.randint(1, 1000, (1, 8))
    with torch.no_grad():
        outputs = {n: m.generate(ids, max_new_tokens=args.tokens, do_sample=False) for n, m in models.items()}
        different = [n for n, out in outputs.items() if not torch.equal(out, outputs["sdpa"])]
        if different:
            raise SystemExit(f"{', '.join(different)} generated other tokens than sdpa")
        runs = {n: lambda m=m: m.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
                for n, m in models.items()}  # fmt: skip
        pairs = {
            "shapesafe / sdpa (goal <= 1.05)": rounds_of(runs["shapesafe"], runs["sdpa"], args.rounds, 1),
            "replace_attention / original (goal <= 1.10)": rounds_of(
                runs["replace_attention"], runs["sdpa"], args.rounds, 1
            ),
        }
    table = Table(title=f"generate {args.tokens} tokens, tiny Llama, {args.threads} thread(s), {args.rounds} rounds")
    for column in ("pair", "ours ms", "baseline ms", "median ratio", "spread"):
        table.add_column(column, justify="left" if column == "pair" else "right")
    for name, (ratios, ours, theirs) in pairs.items():
        table.add_row(
            name,
            f"{statistics.median(ours) * 1e3:.1f}",
            f"{statistics.median(theirs) * 1e3:.1f}",
            f"{statistics.median(ratios):.3f}",
            f"{min(ratios):.3f}-{max(ratios):.3f}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
