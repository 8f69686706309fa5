"""`shapesafe-mha check --impl pkg.mod:fn` and `--module pkg.mod:factory`: the property suite on the user's code."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from shapesafe_mha._cli import app

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
