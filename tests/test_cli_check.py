"""`shapesafe-mha check --impl pkg.mod:fn` and `--module pkg.mod:factory`: the property suite on the user's code."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shapesafe_mha._tools.cli import app

runner = CliRunner()


USER_CODE = """
import torch.nn.functional as F
import shapesafe_mha as ssm


def attention(x, w, *, num_heads, num_kv_heads, is_causal, tiled=False):
    b, s, _ = x.shape
    q = F.linear(x, w.w_q, w.b_q).view(b, s, num_heads, -1).transpose(1, 2)
    k = F.linear(x, w.w_k, w.b_k).view(b, s, num_kv_heads, -1).transpose(1, 2)
    v = F.linear(x, w.w_v, w.b_v).view(b, s, num_kv_heads, -1).transpose(1, 2)
    group = num_heads // num_kv_heads
    if tiled:
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    else:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return F.linear(out.transpose(1, 2).reshape(b, s, -1), w.w_o, w.b_o)


def tiled(x, w, **kwargs):
    return attention(x, w, tiled=True, **kwargs)


def module(d_model, num_heads, num_kv_heads, d_head, bias):
    return ssm.MultiHeadAttention(d_model, num_heads, num_kv_heads, d_head=d_head, bias=bias)
"""


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_attention.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_attention"


def test_check_impl_and_module_run_the_properties_on_the_users_code(user_code: str) -> None:
    """--impl pkg.mod:fn and --module pkg.mod:factory: the same progress and table, on the user's code."""
    for option, name in (("--impl", "attention"), ("--module", "module")):
        result = runner.invoke(app, ["check", option, f"{user_code}:{name}", "--examples", "5"])
        assert result.exit_code == 0, result.output
        assert f"{user_code}:{name}: properties on cpu" in result.output
        assert "yours == per-head reference (GQA)" in result.output and result.output.count("pass") >= 4


def test_check_impl_reports_the_users_bug_with_its_class(user_code: str) -> None:
    """A tiled-KV bug in the user's function: exit 1, the report names the class."""
    result = runner.invoke(app, ["check", "--impl", f"{user_code}:tiled", "--examples", "20"])
    assert result.exit_code == 1
    assert "FAIL" in result.output and "KV heads tiled" in result.output


@pytest.mark.parametrize("spec", ["no_colon", "no_such_module_here:fn", "json:no_such_name", "json:__doc__"])
def test_check_impl_refuses_what_it_cannot_load(spec: str) -> None:
    """Not pkg.mod:name, not importable, no such name, not callable: a usage error (exit 2), no traceback."""
    result = runner.invoke(app, ["check", "--impl", spec])
    assert result.exit_code == 2


@pytest.fixture
def mygqa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's module file in the current directory, as a user runs `shapesafe-mha` beside their code."""
    (tmp_path / "mygqa.py").write_text(
        USER_CODE
        + "\n\ndef factory(d_model, num_heads, num_kv_heads, d_head, bias):\n    return module(d_model, num_heads, "
        "num_kv_heads, d_head, bias)\n\n\ndef broken(*sizes):\n    raise ValueError('no such layer in this build')\n"
        "\n\nNOT_CALLABLE = 3\n\n\ndef not_a_module(*sizes):\n    return 'attention'\n"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(*args: str) -> Any:
    """The command in this process (a subprocess would pay torch's import again): exit code, stdout, stderr."""
    result = runner.invoke(app, list(args))
    result.returncode = result.exit_code
    return result


def test_a_users_name_is_shown_as_written_not_as_markup(mygqa: Path) -> None:
    """`mygqa:factory` stays `mygqa:factory` (rich would turn `:factory:` into an emoji)."""
    result = runner.invoke(app, ["check", "--module", "mygqa:factory", "--examples", "2"])
    assert result.exit_code == 0, result.output
    assert "mygqa:factory: properties on cpu (float64)" in " ".join(result.output.split())
    assert "\N{FACTORY}" not in result.output


def _row(output: str, name: str) -> list[str]:
    line = next(line for line in output.splitlines() if name in line and "│" in line)
    return [cell.strip() for cell in line.strip("│ ").split("│")]


def test_a_failure_row_agrees_with_its_report_and_suggests_only_options_that_exist(user_code: str) -> None:
    """The table's deviation is the report's; its advice names this command's options, which then work."""
    result = runner.invoke(app, ["check", "--impl", f"{user_code}:tiled", "--examples", "20"], terminal_width=200)
    assert result.exit_code == 1
    cells = _row(result.output, "yours == per-head reference (GQA)")
    reported = float(re.search(r"differs from the per-head reference by ([\d.e+-]+)", result.output)[1])  # type: ignore[index]
    assert cells[2] == "FAIL" and int(cells[1]) >= 1
    assert float(cells[3]) == pytest.approx(reported, rel=1e-2)
    assert "--kv-heads interleaved" in result.output and 'kv_heads="' not in result.output
    suggested = set(re.findall(r"--[a-z][a-z-]+", result.output.split("FAIL")[-1]))
    assert suggested <= set(_options_of("check")), suggested
    args = ["check", "--impl", f"{user_code}:tiled", "--kv-heads", "interleaved", "--examples", "5"]
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output


def _options_of(command: str) -> list[str]:
    import typer

    group: Any = typer.main.get_command(app)
    return [opt for param in group.commands[command].params for opt in param.opts]


def test_kv_heads_and_atol_apply_to_the_users_code_only() -> None:
    result = _cli("check", "--kv-heads", "interleaved")
    assert result.returncode == 2 and "pass --impl or --module too" in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["check", "--module", "mygqa:broken", "--examples", "2"], 1, "mygqa:broken raised ValueError: no such layer"),
        (["prove", "--module", "mygqa:broken"], 1, "calling it raised ValueError: no such layer"),
        (["prove", "--module", "mygqa:NOT_CALLABLE"], 2, "mygqa:NOT_CALLABLE: int is not callable"),
        (["check", "--module", "mygqa:NOT_CALLABLE"], 2, "mygqa:NOT_CALLABLE: int is not callable"),
        (["prove", "--module", "no_colon"], 2, "--module must be pkg.mod:name"),
        (["prove", "--module", "mygqa:not_a_module"], 2, "mygqa:not_a_module: it returned a str, not an nn.Module"),
        (["prove", "--decode-max", "8", "--seq-max", "4"], 2, "drop --seq-max"),
    ],
)
def test_every_failure_of_the_users_code_is_one_line(mygqa: Path, args: list[str], code: int, message: str) -> None:
    """A factory that raises, a name that is no callable: one line on stderr, exit 1 or 2, no traceback."""
    result = _cli(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"shapesafe-mha {args[0]}: error: ") and message in lines[0], lines
    assert "Traceback" not in result.stdout + result.stderr


def test_prove_finds_a_module_in_the_current_directory_as_check_does(mygqa: Path) -> None:
    """One resolver: `prove --module mygqa:factory` from the folder of mygqa.py, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["prove", "--module", "mygqa:factory", "--d-model", "32", "--num-heads", "4", "--num-kv-heads", "2"]
    result = subprocess.run([sys.executable, "-m", "shapesafe_mha", *args], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "proven for batch in [1, 64], seq in [1, 2048]" in result.stdout


@pytest.mark.parametrize("args", [["--batch-max", "1"], ["--batch-max", "2"], ["--seq-max", "2", "--batch-max", "3"]])
def test_prove_at_small_or_fixed_sizes_proves_them(args: list[str]) -> None:
    """A range torch cannot make a symbol of (one or two sizes) is proven size by size, not a traceback."""
    result = _cli("prove", "--d-model", "32", "--num-heads", "4", *args)
    assert result.returncode == 0, result.stderr
    assert "proven for batch in [1, " in result.stdout and "Traceback" not in result.stderr


def test_prove_decoding_names_the_cache_fill() -> None:
    result = _cli("prove", "--d-model", "32", "--num-heads", "4", "--decode-max", "100")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "proven for batch in [1, 64], cached in [1, 100], seq = 1 (one decoding step)" in text
    assert "(batch, 2, cached + 1, 8)" in text and "cached + 1 is torch's s" in text
