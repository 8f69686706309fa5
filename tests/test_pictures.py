"""The docs' pictures are drawn from code and current; `trace --format svg` draws the traced stages."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.__main__ import record
from shapesafe_mha import TraceConfig, trace_forward
from shapesafe_mha._tools.cli import app
from shapesafe_mha._tools.svg import gqa_groups, head_split, pipeline
from tools.pictures import DOCS, PICTURES, overhead_chart

runner = CliRunner()
ARGS = ["--d-model", "64", "--num-heads", "8", "--num-kv-heads", "2", "--seq", "4"]
CONFIG = TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4)


@pytest.mark.parametrize("name", sorted(PICTURES))
def test_committed_picture_is_what_the_code_draws_now(name: str) -> None:
    """Each picture in docs/ equals a fresh drawing (regenerate: python -m tools.pictures)."""
    assert (DOCS / name).read_text() == PICTURES[name](), f"docs/{name} is stale: run python -m tools.pictures"


def test_every_picture_the_docs_show_is_drawn_by_the_script() -> None:
    """No picture in docs/ is drawn by hand: every image a page links is one the script draws."""
    images = r"!\[[^\]]*\]\(([^)]+)\)|<img [^>]*src=\"([^\"]+)\"|<source [^>]*srcset=\"([^\"]+)\""
    shown = {m for page in DOCS.glob("*.md") for ms in re.findall(images, page.read_text()) for m in ms if m}
    assert shown, "the docs show no picture"
    assert shown <= set(PICTURES), f"pictures not drawn by tools/pictures.py: {sorted(shown - set(PICTURES))}"
    assert not [p.name for p in DOCS.iterdir() if p.suffix in (".png", ".jpg", ".gif")]


def test_trace_format_svg_draws_every_stage_with_its_storage() -> None:
    """`trace --format svg` prints the pipeline of the traced stages: names, named shapes, views."""
    result = runner.invoke(app, ["trace", "--format", "svg", *ARGS])
    assert result.exit_code == 0, result.output
    svg = result.output
    assert svg == pipeline(trace_forward(CONFIG))
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for stage in trace_forward(CONFIG).stages:
        assert f">{stage.name}</text>" in svg
        assert str(tuple(stage.shape)) in svg
    assert "view of qkv_proj" in svg and "new allocation" in svg


def test_trace_pipeline_bars_show_kv_at_num_kv_heads() -> None:
    """The bytes bars are to scale: K's bar is num_kv_heads/num_heads of Q's (GQA 8/2: a quarter)."""
    svg = pipeline(trace_forward(CONFIG))
    widths = {}
    for name in ("split_q", "split_k"):
        row = svg[svg.index(f">{name}</text>") :]
        widths[name] = float(re.search(r'<rect x="[\d.]+" y="[\d.]+" width="([\d.]+)" height="12.0"', row)[1])  # type: ignore[index]
    assert widths["split_k"] == pytest.approx(widths["split_q"] / 4, abs=0.1)


@pytest.mark.parametrize("fmt", ["svg", "json", "table"])
def test_trace_output_writes_what_it_would_print(fmt: str, tmp_path: Path) -> None:
    """`--output FILE` writes the same document to the file, and prints nothing."""
    out = tmp_path / f"trace.{fmt}"
    written = runner.invoke(app, ["trace", "--format", fmt, "--output", str(out), *ARGS])
    assert written.exit_code == 0, written.output
    assert written.output == ""
    text = out.read_text()
    assert text == runner.invoke(app, ["trace", "--format", fmt, *ARGS]).output  # what a pipe gets
    if fmt == "table":  # plain, as in the README: no box drawing
        assert "split_q" in text and "view of qkv_proj" in text and "━" not in text and "│" not in text
    if fmt == "json":
        assert json.loads(text)["config"]["d_model"] == 64


def test_trace_output_to_an_unwritable_place_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A directory or a missing folder for --output is a usage error, not a traceback."""
    for target in (tmp_path, tmp_path / "missing" / "x.svg"):
        result = runner.invoke(app, ["trace", "--format", "svg", "--output", str(target), *ARGS])
        assert result.exit_code == 2
        assert "--output" in result.output and "Traceback" not in result.output


def test_head_split_picture_reads_offsets_from_the_view() -> None:
    """The head-split picture shows split_heads' real strides, and head 1's first row starts at d_head."""
    svg = head_split(seq=2, num_heads=3, d_head=4)
    assert "strides (24, 4, 12, 1)" in svg  # (batch, heads, seq, d_head) over a (1, 2, 12) buffer
    assert "[0, 1]: head 1" in svg


def test_gqa_picture_groups_consecutive_query_heads() -> None:
    """Query heads 0..3 read K/V head 0 and 4..7 read K/V head 1 (h // group), as group_queries lays them out."""
    svg = gqa_groups(8, 2)
    assert "K/V head 0: query heads 0..3" in svg and "K/V head 1: query heads 4..7" in svg


def test_performance_page_table_is_the_recorded_sweep() -> None:
    """docs/performance.md's checks-on/off table shows docs/overhead.json, the data the chart is drawn from."""
    page = (DOCS / "performance.md").read_text()
    for point in json.loads((DOCS / "overhead.json").read_text()):
        us = float(point["unchecked_us"])
        time = f"{us:.0f} us" if us < 1000 else f"{us / 1000:.1f} ms" if us < 10_000 else f"{us / 1000:.0f} ms"
        assert f"| {point['size']} | {point['ratio']:.3f} | {time} |" in page


def test_benchmark_records_the_sweep_the_chart_is_drawn_from(tmp_path: Path) -> None:
    """`python -m benchmarks --record FILE` writes what tools/pictures.py draws: size, ratio, unchecked time."""
    path = tmp_path / "overhead.json"
    record([("tiny (1, 16, 64)", 1.0641, 122.04e-6), ("long (1, 1024, 512)", 0.9987, 48.1e-3)], path)
    sweep = json.loads(path.read_text())
    assert sweep == [
        {"size": "tiny (1, 16, 64)", "ratio": 1.0641, "unchecked_us": 122.0},
        {"size": "long (1, 1024, 512)", "ratio": 0.9987, "unchecked_us": 48100.0},
    ]
    chart = overhead_chart(sweep)
    assert "tiny (1, 16, 64): +6.4%" in chart and "long (1, 1024, 512): -0.1%" in chart
