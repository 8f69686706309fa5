"""The generated mutation run's score per module, from mutmut's own results (docs/contributors.md).

    mutmut run --max-children 2                 # hours on 2 cores: [tool.mutmut] in pyproject.toml
    python -m tools.mutmut_scores [--record]    # the table; --record writes docs/mutmut-scores.json

A survivor is triaged one of two ways: a test that kills it (then it is killed at the next run), or an
entry of `EQUIVALENT` below saying why no test can (the mutant computes what the original computes).
The score counts every mutant mutmut ran, `no tests` included (no test covers that function: a gap too),
equivalent ones excluded: (killed + timeout) / (killed + timeout + survived + no tests).
"""

import argparse
import datetime
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tools.mkdocs_hooks import scores_markdown

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "mutmut-scores.json"

# mutant name -> why it computes the same as the original (mutmut's names: `mutmut show NAME`).
_ARANGE = "the pair indices kept int64 (over d_head they become float32 all the same) or made float32: the same values"
_EDGE = (
    "a strict comparison at a band edge made loose (or the reverse): they differ only where 2 pi / inv_freq equals "
    "context / factor exactly in float32, which no (theta, d_head) reaches; transformers compares the same way"
)
_ROTARY = "shapesafe_mha._compute.rotary.x_inverse_frequencies__mutmut_"
EQUIVALENT: dict[str, str] = {
    **{f"{_ROTARY}{n}": _ARANGE for n in (22, 26, 30)},
    **{f"{_ROTARY}{n}": _EDGE for n in (84, 102, 105)},
}

KILLED, TIMEOUT, SURVIVED, NO_TESTS = "killed", "timeout", "survived", "no tests"


def results(cwd: Path) -> dict[str, str]:
    """mutant name -> status, as `mutmut results --all true` prints them."""
    command = [sys.executable, "-m", "mutmut", "results", "--all", "true"]
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status
    return found


def module_of(mutant: str) -> str:
    """`shapesafe_mha._compute.cache.xǁKVCacheǁappend__mutmut_3` -> `shapesafe_mha._compute.cache`."""
    parts = mutant.split(".")
    return ".".join(parts[: next(i for i, p in enumerate(parts) if p.startswith("x"))])


def scores(statuses: dict[str, str]) -> dict[str, dict[str, float | int]]:
    table: dict[str, Counter[str]] = {}
    for name, status in statuses.items():
        counts = table.setdefault(module_of(name), Counter())
        counts["equivalent" if name in EQUIVALENT and status == SURVIVED else status] += 1
    rows = {}
    for module, counts in sorted(table.items()):
        caught = counts[KILLED] + counts[TIMEOUT]
        ran = caught + counts[SURVIVED] + counts[NO_TESTS]
        if ran == 0:
            continue  # not run yet (mutmut lists every generated mutant)
        rows[module] = {
            KILLED: counts[KILLED],
            TIMEOUT: counts[TIMEOUT],
            SURVIVED: counts[SURVIVED],
            NO_TESTS: counts[NO_TESTS],
            "equivalent": counts["equivalent"],
            "score": round(caught / ran, 3),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cwd", type=Path, default=ROOT, help="where mutmut ran (its mutants/ folder)")
    parser.add_argument("--record", action="store_true", help="write docs/mutmut-scores.json")
    parser.add_argument("--note", default="", help="what the run covered, for the record")
    args = parser.parse_args()
    import torch

    statuses = results(args.cwd)
    record = {
        "modules": scores(statuses),
        "run": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "where": "2-core CPU machine, mutmut --max-children 1-2",
            "note": args.note,
        },
        "survivors": sorted(n for n, s in statuses.items() if s == SURVIVED and n not in EQUIVALENT),
    }
    print(scores_markdown(record))
    if args.record:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
