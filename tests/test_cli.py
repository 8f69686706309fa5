"""`shapesafe-mha trace`: the table and the JSON report every stage as observed."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from shapesafe_mha._tools.cli import app

runner = CliRunner()


def _trace_json(*args: str) -> dict:  # type: ignore[type-arg]
    result = runner.invoke(app, ["trace", "--format", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_default_trace_is_a_llama_style_gqa_layer_on_meta() -> None:
    """The default config: d_model 4096, 32 heads, 8 KV heads, on meta; every stage has the JSON fields."""
    report = _trace_json()
    assert (report["config"]["d_model"], report["config"]["num_heads"], report["config"]["num_kv_heads"]) == (
        4096,
        32,
        8,
    )
    assert report["config"]["device"] == "meta"
    names = [s["name"] for s in report["stages"]]
    assert names[:5] == ["query", "qkv_proj", "split_q", "split_k", "split_v"]
    for stage in report["stages"]:
        assert set(stage) >= {"name", "named_shape", "shape", "strides", "aliases", "allocated_bytes"}
    split_q = report["stages"][names.index("split_q")]
    assert split_q["named_shape"] == "batch num_heads seq d_head"
    assert split_q["shape"] == [1, 32, 128, 128] and split_q["aliases"] == "qkv_proj"
    assert report["totals"]["kv_cache_ratio_vs_mha"] == pytest.approx(8 / 32)


def test_table_shows_views_and_allocations() -> None:
    """The table names each stage, its named shape, and 'view of …' or 'new allocation'; it fits the terminal."""
    args = ["trace", "--d-model", "64", "--num-heads", "8", "--num-kv-heads", "2", "--seq", "4"]
    result = runner.invoke(app, args, env={"COLUMNS": "200", "TTY_COMPATIBLE": "1"})
    assert result.exit_code == 0, result.output
    assert "split_q" in result.output and "view of qkv_proj" in result.output and "new allocation" in result.output
    assert "batch num_heads seq d_head" in result.output and "┃" in result.output
    narrow = runner.invoke(app, args, env={"COLUMNS": "90", "TTY_COMPATIBLE": "1"})
    assert max(len(re.sub(r"\x1b\[[\d;]*m", "", line)) for line in narrow.output.splitlines()) <= 90


def test_trace_into_a_pipe_is_the_readmes_plain_table_at_full_width() -> None:
    """`shapesafe-mha trace | less`: no box, no cell cut, whatever COLUMNS says; every README row is a line of it."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"```text\n\$ shapesafe-mha (trace .*?)\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("TTY_COMPATIBLE", None), env.pop("FORCE_COLOR", None)
    command = [sys.executable, "-m", "shapesafe_mha", *block[1].split()]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    assert not re.search("[┏┓┗┛┃━│─…]", out) and max(len(line) for line in out.splitlines()) > 80
    header, *rows = block[2].strip("\n").splitlines()
    printed = out.splitlines()
    for row in [header, *rows]:  # the README's abridged columns are the first five of the printed ones
        assert any(line.startswith(row) for line in printed), f"not printed: {row!r}"


def test_decode_trace_attends_over_the_cache() -> None:
    """--decode N: one query against N cached positions plus the new one, read as views of the cache."""
    report = _trace_json(
        "--d-model", "64", "--num-heads", "8", "--num-kv-heads", "1", "--decode", "10", "--device", "cpu"
    )
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["query"]["shape"] == [1, 1, 64]
    assert stages["cache_k"]["shape"] == [1, 1, 11, 8] and stages["cache_k"]["aliases"] == "cache_keys_buffer"


def test_impossible_config_is_an_error_not_a_traceback() -> None:
    """A config that cannot work exits 2 with the library's message."""
    result = runner.invoke(app, ["trace", "--num-heads", "32", "--num-kv-heads", "5"])
    assert result.exit_code == 2
    assert "num_kv_heads" in result.output and "Traceback" not in result.output


def test_console_script_and_module_are_the_same_entry() -> None:
    """`shapesafe-mha` and `python -m shapesafe_mha` both run the trace."""
    commands = [[sys.executable, "-m", "shapesafe_mha", "trace", "--format", "json", "--seq", "2"]]
    script = shutil.which("shapesafe-mha")
    if script:
        commands.append([script, "trace", "--format", "json", "--seq", "2"])
    for command in commands:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["config"]["seq"] == 2


def test_check_runs_the_property_suite_and_prints_a_table() -> None:
    """`shapesafe-mha check` runs every property, shows progress and a pass table, and exits 0."""
    result = runner.invoke(app, ["check", "--examples", "3", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "module == per-head reference (GQA)" in result.output and "KV-cache decoding" in result.output
    assert result.output.count("pass") >= 8 and "FAIL" not in result.output


def test_check_exits_nonzero_when_a_property_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing property is reported with its first line, and the exit code is 1."""
    import shapesafe_mha.testing._suite as suite

    def broken(config: object, data: object, device: str, dtype: object) -> float:
        raise AssertionError("planted: differs by 1 (tolerance 1e-08)")

    monkeypatch.setattr(suite, "PROPERTIES", [("planted failure", broken, ("mha",), False)])
    result = runner.invoke(app, ["check", "--examples", "2"])
    assert result.exit_code == 1
    assert "FAIL" in result.output and "planted: differs by 1" in result.output


def test_trace_tp_shows_per_rank_shapes_and_all_reduce_bytes() -> None:
    """--tp W: one rank's stages with local head counts, what each rank holds, and the all-reduce's bytes."""
    report = _trace_json("--tp", "4")
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["split_q"]["shape"] == [1, 8, 128, 128]
    assert stages["split_q"]["named_shape"] == "batch local_heads seq d_head"
    assert stages["split_k"]["shape"] == [1, 2, 128, 128]
    totals = report["totals"]
    assert totals["all_reduce_bytes"] == 1 * 128 * 4096 * 2
    assert totals["per_rank_kv_cache_bytes"] * 4 == totals["kv_cache_bytes"]
    assert [r["q_heads"] for r in totals["ranks"]] == [[0, 8], [8, 16], [16, 24], [24, 32]]
    table = runner.invoke(app, ["trace", "--tp", "4"])
    assert table.exit_code == 0 and "all-reduces" in table.output


def test_trace_tp_with_an_unsplittable_config_gets_the_runtime_error() -> None:
    """The same ConfigError as HeadParallelAttention.from_module, with the world sizes that work."""
    result = runner.invoke(app, ["trace", "--tp", "5"])
    assert result.exit_code == 2
    assert "cannot be split over world_size=5" in result.output


BAD_VALUES = [
    ("trace", "--seq", "0"),
    ("trace", "--batch", "0"),
    ("trace", "--tp", "0"),
    ("trace", "--device", "tpu"),
    ("trace", "--dtype", "int8"),
    ("check", "--examples", "0"),
    ("check", "--device", "meta"),
    ("prove", "--seq-max", "0"),
    ("trace", "--bogus"),
]
if not torch.cuda.is_available():
    BAD_VALUES += [("trace", "--device", "cuda"), ("check", "--device", "cuda")]


@pytest.mark.parametrize("args", BAD_VALUES, ids=" ".join)
def test_every_bad_value_is_one_line_and_exit_code_2(args: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, "-m", "shapesafe_mha", *args], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shapesafe-mha {args[0]}: error: "), out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def _help(*command: str) -> str:
    out = subprocess.run([sys.executable, "-m", "shapesafe_mha", *command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())


def test_help_has_no_completion_options_and_keeps_bracketed_defaults() -> None:
    text = _help("trace")
    assert "--install-completion" not in text
    assert "[default: (d_model // num_heads); x>=1]" in text


def test_flags_read_as_flags_never_as_bool_values() -> None:
    """Booleans are `--qk-norm / --no-qk-norm`; no option shows a `<bool>` value."""
    for command in ("trace", "check", "prove"):
        assert "bool" not in _help(command), command
    assert "--qk-norm / --no-qk-norm" in _help("trace") and "--causal / --no-causal" in _help("prove")


def _options() -> dict[str, dict[str, tuple[str, str]]]:
    """Each command's options: name -> (help text, how its default is shown)."""
    import typer

    group: Any = typer.main.get_command(app)
    return {
        name: {
            opt: (param.help or "", str(param.show_default))
            for param in command.params
            for opt in param.opts + param.secondary_opts
        }
        for name, command in group.commands.items()
    }


def test_an_option_means_one_thing_in_every_command() -> None:
    """An option two commands take has one help text and one wording of its default (`--d-head`, `--module`, ...)."""
    options = _options()
    names = {opt for command in options.values() for opt in command}
    for name in names:
        meanings = {command: spec[name] for command, spec in options.items() if name in spec}
        helps = {h for h, _ in meanings.values()}
        defaults = {d for _, d in meanings.values()}
        assert len(helps) == 1 and len(defaults) == 1, f"{name} differs between commands: {meanings}"
    assert "--decode" in options["trace"] and "--decode" not in options["prove"]  # prove's is --decode-max N


def test_help_and_a_bad_value_answer_before_torch_is_imported() -> None:
    """Parsing needs no torch (a second or more to import): --help and usage errors never load it."""
    for argv in (["--help"], ["trace", "--help"], ["prove", "--help"], ["trace", "--seq", "0"], ["check", "--bogus"]):
        code = (
            "import sys\nfrom shapesafe_mha._tools.cli import main\n"
            f"sys.argv = ['shapesafe-mha', *{argv!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stderr.strip().splitlines()[-1] == "False", (argv, out.stderr)


def test_trace_shows_the_variants_stages() -> None:
    """--qk-norm, --window and --logit-softcap trace those stages; K/V stay at num_kv_heads."""
    report = _trace_json("--d-model", "64", "--num-heads", "8", "--num-kv-heads", "2", "--seq", "6", "--qk-norm",
                         "--window", "4", "--logit-softcap", "30", "--rope-theta", "10000")  # fmt: skip
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["k_norm"]["named_shape"] == "batch num_kv_heads new d_head" and stages["k_norm"]["shape"][1] == 2
    assert (report["config"]["window"], report["config"]["logit_softcap"]) == (4, 30.0)


def test_trace_of_latent_attention_shows_the_latent_and_the_cache_per_position() -> None:
    """--kv-lora-rank traces multi-head latent attention: DeepSeek-V3's layer decoding after 4095 positions."""
    args = ["--d-model", "7168", "--num-heads", "128", "--q-lora-rank", "1536", "--kv-lora-rank", "512"]
    report = _trace_json(*args, "--decode", "4095")
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["keys_latent"]["named_shape"] == "batch 1 kv_seq kv_lora_rank+d_rope"
    assert stages["keys_latent"]["aliases"] == "cache_buffer"
    assert report["totals"]["kv_cache_bytes_per_position"] == 1152
    table = runner.invoke(app, ["trace", *args, "--decode", "4095"], terminal_width=200)
    assert table.exit_code == 0, table.output
    text = " ".join(table.output.split())
    assert "latent attention: d_model=7168 num_heads=128 q_lora_rank=1536 kv_lora_rank=512" in text
    assert "KV cache for 4096 positions: 4.5 MiB (MHA 320.0 MiB, MQA 2.5 MiB)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "0"], "--window"),
        (["--logit-softcap", "-1"], "logit softcap must be a finite positive number"),
        (["--kv-lora-rank", "512", "--d-rope", "3"], "d_rope=3 is odd"),
    ],
)
def test_bad_variant_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shapesafe_mha", "trace", *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_an_error_nobody_foresaw_is_one_line_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The console script turns an unexpected exception into one line and exit 1; the traceback on request."""
    import shapesafe_mha._tools.report as report
    from shapesafe_mha._tools.cli import main

    def broken(config: object) -> None:
        raise RuntimeError("invalid device ordinal\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(report, "trace_forward", broken)
    monkeypatch.setattr(sys, "argv", ["shapesafe-mha", "trace"])
    monkeypatch.delenv("SHAPESAFE_MHA_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "shapesafe-mha: error: unexpected RuntimeError: invalid device ordinal (SHAPESAFE_MHA_TRACEBACK=1 shows where)"
    ]
    monkeypatch.setenv("SHAPESAFE_MHA_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        main()


def test_check_without_hypothesis_names_the_extra_that_brings_it() -> None:
    """`pip install shapesafe_mha` brings no hypothesis: `check` says which install does, in one line, exit 1."""
    code = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'hypothesis':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "from shapesafe_mha._tools.cli import main\n"
        "sys.argv = ['shapesafe-mha', 'check', '--examples', '1']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "shapesafe-mha check: error: the property suite needs hypothesis, not installed here: "
        'pip install "shapesafe_mha[testing]"'
    ]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TRACE_ARGS = ["--rope-theta", "10000", "--qk-norm", "--window", "64"]


def _column_texts(rendered: str, columns: int) -> list[str]:
    """Each column of a boxed table's body, its cells' lines joined with every space and newline dropped."""
    lines = rendered.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("┡")) + 1 :]
    body = body[: next(i for i, line in enumerate(body) if line.startswith("└"))]
    texts = [""] * columns
    for line in body:
        cells = line.split("│")[1:-1]
        assert len(cells) == columns, line
        for index, cell in enumerate(cells):
            texts[index] += "".join(cell.split())
    return texts


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_trace_in_a_terminal_wraps_every_cell_at_any_width_and_cuts_none(width: int) -> None:
    """In a terminal of any width the table wraps (a long name folds): every stage name, named shape, shape,
    and stride is there whole, in order, once a cell's lines are joined; nothing is cut to '…'."""
    env = {"COLUMNS": str(width), "LINES": "50", "TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    result = runner.invoke(app, ["trace", *_TRACE_ARGS], env=env)
    assert result.exit_code == 0, result.output
    shown = _ANSI.sub("", result.output)
    assert "…" not in shown and "┡" in shown and max(len(line) for line in shown.splitlines()) <= width
    stages = _trace_json(*_TRACE_ARGS)["stages"]
    texts = _column_texts(shown, 7)
    for index, field in enumerate(["name", "named_shape", "shape", "strides"]):
        values = [s[field] for s in stages]
        if field in ("shape", "strides"):
            values = [str(tuple(v)) for v in values]
        assert texts[index] == "".join("".join(str(v).split()) for v in values), field


def test_prove_into_a_pipe_is_plain_text_without_box_characters() -> None:
    """`prove` sent to a pipe or a file prints its table as plain text, as `trace` does there."""
    args = ["prove", "--d-model", "16", "--num-heads", "4", "--num-kv-heads", "2", "--batch-max", "4", "--seq-max", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "named shape" in result.output and "proven for" in result.output
    assert not set(result.output) & set("─│┏┃┡└━╇┳┓┩┘┌┐"), result.output
