"""Draw every picture of the docs from code: `python -m tools.pictures` rewrites them in docs/.

None is drawn by hand. The stage pipeline is `shapesafe-mha trace --format svg` of one config;
the head split and the GQA grouping are read from what `split_heads` and `group_queries` return;
the overhead chart is drawn from the sweep `python -m benchmarks --record docs/overhead.json`
measured. tests/test_pictures.py draws them again in memory and fails when a committed one differs.
"""

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

from shapesafe_mha import LatentTraceConfig, TraceConfig, trace_forward, trace_latent
from shapesafe_mha._tools.svg import INK, LINE, MUTED, Canvas, gqa_groups, head_split, pipeline, serving_layout

DOCS = Path(__file__).resolve().parent.parent / "docs"
# The README's example layer: small enough to read, GQA so that K and V are visibly smaller.
STAGES = TraceConfig(d_model=512, num_heads=8, num_kv_heads=2, seq=16)
POINT = "#0969da"


def overhead_chart(sweep: list[dict[str, float | str]]) -> str:
    """Overhead of the checks (percent) against the unchecked forward's time (log scale)."""
    xs = [math.log10(float(p["unchecked_us"])) for p in sweep]
    ys = [(float(p["ratio"]) - 1) * 100 for p in sweep]
    x_lo, x_hi = math.floor(min(xs)), math.ceil(max(xs))
    y_lo, y_hi = min(0, math.floor(min(ys))), max(1, math.ceil(max(ys)))
    left, top, w, h = 80.0, 70.0, 560.0, 280.0

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x_lo) / (x_hi - x_lo) * w, top + (y_hi - y) / (y_hi - y_lo) * h

    c = Canvas()
    c.text(16, 28, "What the shape checks cost, by size of the forward", size=16, bold=True)
    c.text(16, 50, "checked / unchecked time - 1, median of alternating rounds; one thread, 2-core CPU", MUTED, 12)
    for y in range(y_lo, y_hi + 1):
        _, py = at(x_lo, y)
        c.line(left, py, left + w, py, stroke=INK if y == 0 else "#eaeef2")
        c.text(left - 10, py + 4, f"{y}%", MUTED, 12, "end")
    for x in range(x_lo, x_hi + 1):
        px, _ = at(x, y_lo)
        c.line(px, top, px, top + h, stroke="#eaeef2")
        c.text(px, top + h + 18, f"{10**x:,} us".replace(",", " "), MUTED, 12, "middle")
    c.line(left, top, left, top + h, stroke=LINE)
    c.line(left, top + h, left + w, top + h, stroke=LINE)
    c.text(left + w / 2, top + h + 42, "unchecked forward time (log scale)", MUTED, 12, "middle")
    points = [at(x, y) for x, y in zip(xs, ys, strict=True)]
    for (x1, y1), (x2, y2) in itertools.pairwise(points):
        c.line(x1, y1, x2, y2, stroke=POINT, width=2)
    for i, ((px, py), p, y) in enumerate(zip(points, sweep, ys, strict=True)):
        c.rect(px - 4, py - 4, 8, 8, POINT, rx=4)
        last = i == len(points) - 1  # labelled below and to its left, inside the frame, clear of the line
        c.text(
            px - 10 if last else px + 10,
            py + 22 if last else py - 14,
            f"{p['size']}: {y:+.1f}%",
            INK,
            12,
            "end" if last else "start",
        )
    return c.svg("Overhead of the shape checks against the size of the forward")


PICTURES: dict[str, Callable[[], str]] = {
    "stages.svg": lambda: pipeline(trace_forward(STAGES)),
    # The same stages in one column, for a phone: docs/index.md shows it below 600 px.
    "stages-narrow.svg": lambda: pipeline(trace_forward(STAGES), narrow=True),
    "head-split.svg": head_split,
    "gqa.svg": gqa_groups,
    "serving.svg": serving_layout,
    # DeepSeek-V3's latent attention decoding one token: the cache attended as it is.
    "latent-decode.svg": lambda: pipeline(trace_latent(LatentTraceConfig(decode=4095))),
    "overhead.svg": lambda: overhead_chart(json.loads((DOCS / "overhead.json").read_text())),
}


def main() -> None:
    for name, draw in PICTURES.items():
        (DOCS / name).write_text(draw())
        print(f"docs/{name}")


if __name__ == "__main__":
    main()
