"""Four checkers on the same files: the static catalogue (`tests/static/`), caught / missed / false alarm each.

- **pyrefly** with shapesafe_mha's stub: an error on the mistake's marked line (or on another line: said so).
- **torchtyc**: traces each annotated function on meta tensors, a distinct prime for each named size.
- **prove**: shapesafe_mha's symbolic prover, on the function wrapped as a module (`forward(x)`), batch and seq
  symbolic over [2, 8] and [2, 16].
- **runtime**: the function called once on random tensors (batch 2, seq 5), shapesafe_mha's checks on.

A file is a mistake (`mistake_`, `miss_`: caught or missed) or correct code (`correct_`, `limit_`: ok or false
alarm). Usage: `python -m tools.static_compare` prints the markdown table of `docs/static-shapes.md`.
"""

import contextlib
import importlib.util
import io
import json
import logging
import shutil
import subprocess
import sys
import time
import typing
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

CATALOGUE = Path(__file__).resolve().parent.parent / "tests" / "static"
TOOLS = ("pyrefly", "torchtyc", "prove", "runtime")
SIZES = {"batch": 2, "seq": 5, "d_model": 64}  # the runtime call's sizes, by name
MARKED = ("# static: error", "# static: miss")


def files() -> list[Path]:
    return sorted(CATALOGUE.glob("*.py"), key=lambda p: (p.name.split("_")[0] != "mistake", p.name))


def is_mistake(path: Path) -> bool:
    return path.name.startswith(("mistake_", "miss_"))


def marked_lines(path: Path) -> set[int]:
    return {n for n, line in enumerate(path.read_text().splitlines(), 1) if line.rstrip().endswith(MARKED)}


def executable(name: str) -> str | None:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def pyrefly_errors() -> tuple[dict[str, set[int]], float]:
    """Each file's lines with a pyrefly error, and pyrefly's wall time over the catalogue."""
    exe = executable("pyrefly")
    if exe is None:
        raise SystemExit("pyrefly is not installed: pip install -e '.[static]'")
    config = str(CATALOGUE / "pyrefly.toml")
    start = time.perf_counter()
    out = subprocess.run(
        [exe, "check", "-c", config, "--python-interpreter-path", sys.executable, "--output-format", "json"],
        capture_output=True,
        text=True,
        cwd=CATALOGUE,
    )
    seconds = time.perf_counter() - start
    lines: dict[str, set[int]] = {}
    for entry in json.loads(out.stdout)["errors"]:
        if entry["severity"] == "error":
            lines.setdefault(Path(entry["path"]).name, set()).add(entry["line"])
    return lines, seconds


def torchtyc_errors() -> dict[str, set[int]]:
    """Each file's lines with a torchtyc error (`torchtyc check --format json`)."""
    exe = executable("torchtyc")
    if exe is None:
        raise SystemExit("torchtyc is not installed: pip install torchtyc")
    names = [p.name for p in files()]
    out = subprocess.run(
        [exe, "check", "--format", "json", "--python", sys.executable, *names],
        capture_output=True,
        text=True,
        cwd=CATALOGUE,
    )
    lines: dict[str, set[int]] = {}
    for entry in json.loads(out.stdout)["diagnostics"]:
        if entry["severity"] == "error":  # its JSON counts lines from 0 (its text output, from 1)
            lines.setdefault(Path(entry["path"]).name, set()).add(entry["line"] + 1)
    return lines


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"static_catalogue_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attention


def make(annotation: Any, sizes: dict[str, int]) -> torch.Tensor:
    """A random tensor of a jaxtyping annotation, its named sizes from `sizes`."""
    shape = [eval(d, {}, dict(sizes)) for d in annotation.dim_str.split()]  # a name, a number or `seq+1`
    dtypes = set(annotation.dtypes)
    if "bool" in dtypes:
        return torch.ones(shape, dtype=torch.bool).tril()
    if "int64" in dtypes:
        return torch.ones(shape, dtype=torch.int64).tril()
    return torch.randn(shape)


def arguments(fn: Any, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    hints = typing.get_type_hints(fn, include_extras=True)
    return {name: make(tp, sizes) for name, tp in hints.items() if name != "return"}


def runtime_verdict(fn: Any) -> str | None:
    """None where the call ran; else the exception's class."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the catalogue's reveal_type prints at run time
            fn(**arguments(fn, SIZES))
    except Exception as error:
        return type(error).__name__
    return None


def as_module(fn: Any) -> nn.Module:
    """The function as a module whose forward is the function itself (export reads its argument names)."""
    return type(f"{fn.__name__}_module", (nn.Module,), {"forward": staticmethod(fn)})()


def prove_verdict(fn: Any) -> str | None:
    """None where `prove` proved the function; else its first failure (or the exception it raised)."""
    from shapesafe_mha import prove

    hints = typing.get_type_hints(fn, include_extras=True)
    first = next(iter(hints))
    d_model = int(hints[first].dim_str.split()[-1]) if hints[first].dim_str.split()[-1].isdigit() else 64

    def builder(annotation: Any) -> Any:
        return lambda batch, seq: make(annotation, {**SIZES, "batch": batch, "seq": seq})

    kwargs = {n: builder(tp) for n, tp in hints.items() if n not in ("return", first)}
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a failing meta kernel's trace
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            proof = prove(as_module(fn), d_model=d_model, batch=(2, 8), seq=(2, 16), **kwargs)
    except Exception as error:
        return type(error).__name__
    return None if proof.ok else proof.failures[0].split("\n")[0][:80]


def measure() -> tuple[dict[str, dict[str, str]], float]:
    """`{file: {tool: verdict}}` and pyrefly's time over the catalogue."""
    pyrefly, seconds = pyrefly_errors()
    torchtyc = torchtyc_errors()
    table: dict[str, dict[str, str]] = {}
    for path in files():
        fn = load(path)
        marked = marked_lines(path)
        lines = {"pyrefly": pyrefly.get(path.name, set()), "torchtyc": torchtyc.get(path.name, set())}
        reported = {
            **{tool: bool(found) for tool, found in lines.items()},
            "prove": prove_verdict(fn) is not None,
            "runtime": runtime_verdict(fn) is not None,
        }
        verdicts = {}
        for tool, hit in reported.items():
            if not is_mistake(path):
                verdicts[tool] = "false alarm" if hit else "ok"
            elif tool in lines and hit and not lines[tool] & marked:
                verdicts[tool] = "caught, on another line"
            else:
                verdicts[tool] = "caught" if hit else "missed"
        table[path.name] = verdicts
    return table, seconds


def markdown(table: dict[str, dict[str, str]]) -> str:
    rows = ["| file | " + " | ".join(TOOLS) + " |", "|---|" + "---|" * len(TOOLS)]
    for name, verdicts in table.items():
        rows.append(f"| `{name}` | " + " | ".join(verdicts[t] for t in TOOLS) + " |")
    mistakes = [v for n, v in table.items() if n.startswith(("mistake_", "miss_"))]
    correct = [v for n, v in table.items() if not n.startswith(("mistake_", "miss_"))]
    totals = [
        f"{sum(v[t].startswith('caught') for v in mistakes)}/{len(mistakes)} caught, "
        f"{sum(v[t] == 'false alarm' for v in correct)} false alarm"
        for t in TOOLS
    ]
    rows.append("| **total** | " + " | ".join(totals) + " |")
    return "\n".join(rows)


def main() -> int:
    table, seconds = measure()
    print(markdown(table))
    print(f"\npyrefly over the {len(table)} catalogue files: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
