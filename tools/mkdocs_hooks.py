"""mkdocs hooks (mkdocs.yml loads this file): text that the docs take from the code, not from a copy.

`<!-- dimensions -->` on a page becomes the notation table of `shapesafe_mha._core.dims`, the one place
where every dimension name is declared, so the API page lists exactly the names the code knows.
`<!-- mutmut-scores -->` becomes the table of the last generated mutation run (docs/mutmut-scores.json).
"""

import json
from pathlib import Path
from typing import Any

MARKER = "<!-- dimensions -->"
SCORES = "<!-- mutmut-scores -->"  # the generated mutation run's table, from docs/mutmut-scores.json


def dimensions_table() -> str:
    """The markdown table in `shapesafe_mha._core.dims`'s docstring."""
    from shapesafe_mha._core import dims as _dims

    lines = [line for line in (_dims.__doc__ or "").splitlines() if line.startswith("|")]
    if not lines:
        raise ValueError("shapesafe_mha._core.dims's docstring has no notation table")
    return "\n".join(lines)


def scores_markdown(record: dict[str, Any]) -> str:
    """The table docs/contributors.md shows (through the mkdocs hook)."""
    lines = [
        "| module | killed | timeout | survived | no tests | equivalent | score |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for module, row in record["modules"].items():
        lines.append(
            f"| `{module}` | {row['killed']} | {row['timeout']} | {row['survived']} | {row['no tests']} | "
            f"{row['equivalent']} | {row['score']:.1%} |"
        )
    run = record["run"]
    lines.append("")
    lines.append(f"Run of {run['date']}: torch {run['torch']}, {run['where']}; {run['note']}")
    return "\n".join(lines)


def scores_table() -> str:
    """The per-module scores of the last generated mutation run (tools/mutmut_scores.py --record)."""
    record = Path(__file__).resolve().parent.parent / "docs" / "mutmut-scores.json"
    return scores_markdown(json.loads(record.read_text()))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, dimensions_table())
    if SCORES in markdown:
        markdown = markdown.replace(SCORES, scores_table())
    return markdown
