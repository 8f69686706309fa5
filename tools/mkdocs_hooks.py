"""mkdocs hooks (mkdocs.yml loads this file): text that the docs take from the code, not from a copy.

`<!-- dimensions -->` on a page becomes the notation table of `shapesafe_mha._core.dims`, the one place
where every dimension name is declared, so the API page lists exactly the names the code knows.
`<!-- aliases -->` becomes the table of every shape alias `shapesafe_mha.dims` exports, each with its dtype and
named shape, read from the aliases themselves. `<!-- mutmut-scores -->` becomes the table of the last generated
mutation run (docs/mutmut-scores.json).
"""

import json
import math
from pathlib import Path
from typing import Any

MARKER = "<!-- dimensions -->"
ALIASES = "<!-- aliases -->"
SCORES = "<!-- mutmut-scores -->"  # the generated mutation run's table, from docs/mutmut-scores.json


def dimensions_table() -> str:
    """The markdown table in `shapesafe_mha._core.dims`'s docstring."""
    from shapesafe_mha._core import dims as _dims

    lines = [line for line in (_dims.__doc__ or "").splitlines() if line.startswith("|")]
    if not lines:
        raise ValueError("shapesafe_mha._core.dims's docstring has no notation table")
    return "\n".join(lines)


def aliases_table() -> str:
    """Every alias of `shapesafe_mha.dims` as a row: its name, then each shape it accepts (a union, such as
    `AttnMask`, one per alternative) as `dtype[Tensor, "dims"]`, from jaxtyping's public `dtype` and `dim_str`."""
    import shapesafe_mha.dims as public
    from shapesafe_mha._core.messages import arrays_of

    lines = ["| alias | annotation |", "|---|---|"]
    for name in public.__all__:
        if name == "DIMS":
            continue
        arrays = arrays_of(getattr(public, name))
        if not arrays:
            raise ValueError(f"shapesafe_mha.dims.{name} is not a jaxtyping array annotation")
        shapes = " or ".join(f'`{a.__name__.split("[")[0]}[Tensor, "{a.dim_str}"]`' for a in arrays)
        lines.append(f"| `{name}` | {shapes} |")
    return "\n".join(lines)


def wilson(caught: int, ran: int) -> tuple[float, float]:
    """The 95% Wilson interval of a score `caught / ran` measured on a uniform sample of the mutants."""
    if ran == 0:
        return (0.0, 1.0)
    z = 1.959964
    p = caught / ran
    centre = (p + z * z / (2 * ran)) / (1 + z * z / ran)
    half = z * math.sqrt(p * (1 - p) / ran + z * z / (4 * ran * ran)) / (1 + z * z / ran)
    return (max(0.0, centre - half), min(1.0, centre + half))


def scores_markdown(record: dict[str, Any]) -> str:
    """The table docs/contributors.md shows (through the mkdocs hook).

    A row's `generated` is how many mutants mutmut makes of the module's code now; `how` says which of them
    the row counts: `all`, `sample` (a seeded uniform sample: its score comes with a 95% interval) or
    `partial` (a run stopped early, fastest functions first, or code added since: not a uniform sample, so
    no interval).
    """
    lines = [
        "| module | run of generated | killed | timeout | survived | no tests | equivalent | score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for module, row in record["modules"].items():
        ran = row["killed"] + row["timeout"] + row["survived"] + row["no tests"] + row["equivalent"]
        how = row.get("how", "all")
        score = f"{row['score']:.1%}"
        if how == "sample":
            caught = row["killed"] + row["timeout"]
            low, high = wilson(caught, ran - row["equivalent"])
            score += f" (95%: {low:.1%} to {high:.1%})"
        coverage = f"{ran} of {row['generated']} ({how})" if "generated" in row else str(ran)
        lines.append(
            f"| `{module}` | {coverage} | {row['killed']} | {row['timeout']} | {row['survived']} | "
            f"{row['no tests']} | {row['equivalent']} | {score} |"
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
    if ALIASES in markdown:
        markdown = markdown.replace(ALIASES, aliases_table())
    if SCORES in markdown:
        markdown = markdown.replace(SCORES, scores_table())
    return markdown
