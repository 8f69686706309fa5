"""How long `check_hf_attention` takes on real transformers classes, and on each planted bug, and what it says.

    python -m benchmarks.toolkit_reports [--examples N] [--quick]

Prints, per class and implementation and dtype, pass/fail and the time; per planted bug
(`tests/hf_bugs.py`), whether it was caught, the time, and the first line of the report. Nothing is
asserted about time (`tests/test_benchmarks.py` only checks the rows are printed).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from hypothesis import settings
from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hf_bugs import BUGS, REAL

from shapesafe_mha.testing.hf import check_hf_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=None, help="examples per property (default: hypothesis')")
    parser.add_argument("--quick", action="store_true", help="one class and two bugs, 10 examples")
    args = parser.parse_args()
    examples = 10 if args.quick and args.examples is None else args.examples
    budget = settings(max_examples=examples) if examples else settings()
    classes = REAL[:1] if args.quick else REAL
    runs = [(cls, config, "eager", torch.float32) for cls, config in classes]
    if not args.quick:
        llama, llama_config = REAL[0]
        runs += [(llama, llama_config, impl, dtype) for impl, dtype in [
            ("sdpa", torch.float32), ("eager", torch.float64), ("sdpa", torch.float64)]]  # fmt: skip

    console = Console(width=200)
    table = Table(title=f"real classes ({budget.max_examples} examples per property)")
    for column in ("class", "implementation", "dtype", "result", "seconds"):
        table.add_column(column)
    for cls, config, implementation, dtype in runs:
        start = time.perf_counter()
        try:
            check_hf_attention(cls, config, attn_implementation=implementation, dtype=dtype, settings=budget)
            result = "pass"
        except AssertionError as error:
            result = "FAIL: " + str(error).splitlines()[0]
        seconds = time.perf_counter() - start
        table.add_row(cls.__name__, implementation, str(dtype).removeprefix("torch."), escape(result), f"{seconds:.1f}")
    console.print(table)

    table = Table(title="planted bugs")
    for column in ("bug", "caught", "seconds", "first line of the report", "bug class"):
        table.add_column(column, overflow="fold")
    for bug in BUGS[:2] if args.quick else BUGS:
        start = time.perf_counter()
        try:
            with bug.patch():
                check_hf_attention(bug.attention_cls, bug.config_cls, settings=budget)
            caught, first, named = "no", "", ""
        except AssertionError as error:
            lines = str(error).splitlines()
            caught, first = "yes", lines[0]
            named = next((line.strip() for line in lines if line.strip().startswith("bug class:")), "")
        seconds = time.perf_counter() - start
        table.add_row(escape(bug.name), caught, f"{seconds:.1f}", escape(first), escape(named))
    console.print(table)


if __name__ == "__main__":
    main()
