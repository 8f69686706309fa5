"""The benchmarks run (small sizes) and print their ratios; no timing is asserted."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_memory_benchmark_prints_ratios_and_repeat_kv_allocates_more() -> None:
    """benchmarks.memory prints one row per variant; repeat-KV allocates more per step than our GQA."""
    command = [sys.executable, "-m", "benchmarks.memory", "--d-model", "64", "--num-heads", "8", "--num-kv-heads", "2"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert {"MHA", "GQA (2 KV heads)", "MQA", "GQA, repeat-KV (2 KV heads)"} <= set(rows)
    repeat_vs_ours = float(rows["GQA, repeat-KV (2 KV heads)"].split("│")[-2])
    assert repeat_vs_ours > 1.0


def test_serving_benchmark_prints_every_row_and_a_paged_step_never_copies_its_pool() -> None:
    """`python -m benchmarks.serving` (2 rounds, small counts: the output is tested, not the figures) prints the
    packed/padded and paged/contiguous rows, and each decoding step allocates less than its pool holds."""
    command = [sys.executable, "-m", "benchmarks.serving", "--rounds", "2", "--counts", "1", "3", "--markdown"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = (
        "packed prefill / padded (ours)",
        "packed prefill / padded (torch)",
        "paged decode / contiguous decode",
        "MLA paged decode / contiguous decode",
    )
    for name in rows:
        assert sum(f"| {name} |" in line for line in out.splitlines()) == 2, name
    steps = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "seqs," in line]
    memory = [row for row in steps if len(row) == 6 and row[1].strip().replace(",", "").isdigit()]
    assert len(memory) == 2
    for row in memory:
        largest, pool = int(row[2].replace(",", "")), int(row[5].replace(",", ""))
        assert largest < pool  # the gathered keys, never the pool


def test_paged_kernels_benchmark_checks_each_way_against_the_per_sequence_reference() -> None:
    """`python -m benchmarks.paged_kernels` (2 rounds, small counts) runs each way of attending a paged decoding step
    only after it matched the per-sequence reference (the script asserts it: a way that reads another sequence's
    block exits non-zero), and prints a row per way and size with its ratio to the gather."""
    command = [sys.executable, "-m", "benchmarks.paged_kernels", "--rounds", "2", "--counts", "1", "3"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [(row[0].strip(), row[1].strip().split(",")[0]) for row in rows] == [
        ("in place", "1 seqs"),
        ("in place", "3 seqs"),
    ]
    for row in rows:
        assert float(row[2]) > 0 and float(row[5]) <= 1e-5  # a ratio, and the largest error against the reference


def test_performance_benchmark_prints_every_comparison() -> None:
    """`python -m benchmarks --quick` (4 rounds: what is tested is the output, not the figures) prints each
    comparison with its ratio and goal (no timing asserted)."""
    command = [sys.executable, "-m", "benchmarks", "--quick", "--rounds", "4", "--no-compile"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    names = (
        "decode: checked / unchecked",
        "RoPE decode: checked / unchecked",
        "padded generation: checked / unchecked",
        "prefill: ours checked / nn.MHA",
        "checks off / no checks",
        "training step: ours / nn.MHA",
        "LoRA q/v: ours / unfused path",
    )
    for name in names:
        assert name in out
    assert "long (1, 1024, 512)" in out


def test_toolkit_reports_benchmark_prints_classes_and_bugs() -> None:
    """`python -m benchmarks.toolkit_reports --quick` prints a row per class and per planted bug (no timing checked)."""
    command = [sys.executable, "-m", "benchmarks.toolkit_reports", "--quick"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "LlamaAttention" in out and "pass" in out
    assert "repeat_kv tiles" in out and "yes" in out and "[heads]" in out


def test_contenders_benchmark_prints_every_row() -> None:
    """`python -m benchmarks.contenders --quick` (2 rounds, the fewest a spread needs) prints each row against its
    contenders, ratio, spread and verdict (no timing asserted)."""
    command = [sys.executable, "-m", "benchmarks.contenders", "--quick", "--rounds", "2", "--markdown"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): line for line in lines}
    for kind in ("MHA", "GQA", "MQA"):
        for masking in ("causal", "non-causal", "key-padded"):
            assert f"{kind} {masking} prefill" in rows
    assert {"GQA decode, 16 cached, batch 2", "GQA decode, 16 cached, batch 2, padding mask"} <= set(rows)
    assert {"MHA training step (forward + backward)", "GQA training step (forward + backward)"} <= set(rows)
    assert {"public stages composed", "MHA per-call cost (meta)", "GQA per-call cost (cpu)"} <= set(rows)
    assert {"torch's GQA kernel / folded: causal prefill", "torch's GQA kernel / folded: decode"} <= set(rows)
    cells = {name: [c.strip() for c in line.split("|")[1:-1]] for name, line in rows.items() if name != "row"}
    assert cells["MHA causal prefill"][5] != "-" and cells["GQA causal prefill"][5] == "-", "nn.MHA on MHA rows only"
    for row in cells.values():
        assert row[-1].split()[-1] in ("met", "tie", "NO", "faster"), row


def test_whole_models_benchmark_prints_both_pairs() -> None:
    """`python -m benchmarks.hf_models` prints shapesafe / sdpa and replace_attention / original, each with its
    median ratio and spread (no timing asserted; it exits non-zero if any contender generates other tokens)."""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "benchmarks.hf_models", "--rounds", "2", "--tokens", "4"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert {"shapesafe / sdpa (goal <= 1.05)", "replace_attention / original (goal <= 1.10)"} <= set(rows)
    for row in rows.values():
        low, high = (float(x) for x in row.split("│")[-2].strip().split("-"))
        assert 0 < low <= float(row.split("│")[-3]) <= high
