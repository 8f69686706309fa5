"""Static shapes: the shipped stub is what the runtime annotations generate; pyrefly flags the catalogue."""

import json
import re
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tools.static_stubs import STUB, generate

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "tests" / "static"
PAGE = ROOT / "docs" / "static-shapes.md"
MARKER = re.compile(r"#\s*static:\s*(error|miss|false-alarm|reveal)\b\s*(.*)$")

# What pyrefly cannot express: each a catalogue file whose marked mistake it must not flag (said, not silent).
# When pyrefly learns one, its test fails: make it a `mistake_` file.
EXPECTED_MISSES = {
    "miss_repeat_divides.py": "KV heads repeated by a factor that still divides num_heads: the shapes hold, the head "
    "pairing is wrong (no shape shows it; runtime misses it too)",
    "miss_module_heads.py": "MultiHeadAttention(64, 6): a constructor has no result shape for a shape function to "
    "check (the constructor raises ConfigError at run time)",
    "miss_mask_dtype.py": "an integer mask: pyrefly's tensors carry shapes, not dtypes (runtime: ShapeError)",
}
# Correct code pyrefly flags: a limit of its arithmetic, listed, so that correct files avoid it.
KNOWN_FALSE_ALARMS = {
    "limit_symbolic_width.py": "with a symbolic width, 8 * (d_model // 8) is not simplified to d_model",
}
KINDS = ("correct_", "mistake_", "miss_", "limit_")


def test_the_shipped_stub_is_generated_from_the_runtime_annotations() -> None:
    """`shapesafe_mha-stubs/__init__.pyi` is exactly what `tools/static_stubs.py` writes from today's annotations."""
    assert STUB.read_text() == generate(), "the stub is stale: run `python -m tools.static_stubs`"


def test_the_stub_is_lint_clean() -> None:
    """What the tool writes passes ruff as the package does (import order, no name defined twice)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    result = subprocess.run([ruff, "check", str(STUB)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout


def test_the_stub_names_every_public_name() -> None:
    """What a type checker reads (the stub) names the same public surface as `__all__`."""
    import shapesafe_mha as ssm

    text = STUB.read_text()
    for name in ssm.__all__:
        assert f" {name}(" in text or f" {name} as {name}" in text or f"class {name}(" in text, name


def test_import_never_loads_the_static_helpers() -> None:
    """`shape_extensions` is for type checkers: imported, it patches torch's classes, so a forward must not load it."""
    code = (
        "import sys, torch, shapesafe_mha as ssm\n"
        "ssm.MultiHeadAttention(16, 2)(torch.randn(1, 3, 16))\n"
        "print('shape_extensions' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def catalogue(kind: str) -> list[str]:
    return sorted(p.name for p in CATALOGUE.glob(f"{kind}*.py"))


def markers(name: str) -> dict[int, tuple[str, str]]:
    """`{line: (kind, rest)}` of the `# static: ...` comments of a catalogue file."""
    found = {}
    for number, line in enumerate((CATALOGUE / name).read_text().splitlines(), 1):
        match = MARKER.search(line)
        if match:
            found[number] = (match[1], match[2].strip())
    return found


def torch_stubs_installed() -> bool:
    return any((Path(p) / "torch-stubs").is_dir() for p in [*site.getsitepackages(), site.getusersitepackages()])


def run_pyrefly(config: Path) -> dict[str, list[dict[str, Any]]]:
    """pyrefly's errors and revealed types over the project `config` configures, by file name; skips without it."""
    exe = shutil.which("pyrefly", path=str(Path(sys.executable).parent)) or shutil.which("pyrefly")
    if exe is None:
        pytest.skip("pyrefly is not installed: pip install -e '.[static]' (in an environment pyright does not use)")
    if not torch_stubs_installed():
        pytest.skip("pyrefly-torch-stubs is not installed: pip install -e '.[static]'")
    command = [exe, "check", "-c", str(config), "--python-interpreter-path", sys.executable, "--output-format", "json"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=config.parent)
    print(f"pyrefly over {len(list(config.parent.glob('*.py')))} files: {time.perf_counter() - start:.2f} s")
    assert result.returncode in (0, 1), result.stderr
    by_file: dict[str, list[dict[str, Any]]] = {}
    for entry in json.loads(result.stdout)["errors"]:
        by_file.setdefault(Path(entry["path"]).name, []).append(entry)
    return by_file


@pytest.fixture(scope="module")
def pyrefly() -> dict[str, list[dict[str, Any]]]:
    """pyrefly over the catalogue."""
    return run_pyrefly(CATALOGUE / "pyrefly.toml")


def errors(report: dict[str, list[dict[str, Any]]], name: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for entry in report.get(name, []):
        if entry["severity"] == "error":
            lines.setdefault(entry["line"], []).append(entry["concise_description"])
    return lines


def test_the_stub_itself_has_no_static_error(tmp_path: Path) -> None:
    """pyrefly reads the stub without an error (an override its base class cannot take, a shape function that
    does not evaluate): a user never sees errors in an installed stub, so this is the only place they show."""
    (tmp_path / "pyrefly.toml").write_text(
        f'python-version = "3.11"\nsearch-path = ["{ROOT}"]\nproject-includes = ["{STUB}"]\n'
    )
    report = run_pyrefly(tmp_path / "pyrefly.toml")
    assert errors(report, STUB.name) == {}
    assert STUB.name in report or not report  # checked: no entry at all means no error and no note


def test_every_catalogue_file_is_of_a_kind_and_marked() -> None:
    """A file is correct code, a mistake, an expected miss or a known false alarm; all but correct code mark a line."""
    files = sorted(p.name for p in CATALOGUE.glob("*.py"))
    assert files and all(f.startswith(KINDS) for f in files), files
    for name in files:
        kinds = {kind for kind, _ in markers(name).values()}
        planted = {"mistake_": {"error"}, "miss_": {"miss"}, "limit_": {"false-alarm"}}
        expected = planted.get(name[: name.index("_") + 1])
        if expected is not None:
            assert expected <= kinds, name
    assert set(catalogue("miss_")) == set(EXPECTED_MISSES)
    assert set(catalogue("limit_")) == set(KNOWN_FALSE_ALARMS)


@pytest.mark.parametrize("name", catalogue("mistake_"))
def test_each_planted_mistake_is_flagged_on_its_line_and_nowhere_else(pyrefly: Any, name: str) -> None:
    planted = {line for line, (kind, _) in markers(name).items() if kind == "error"}
    assert set(errors(pyrefly, name)) == planted, errors(pyrefly, name)


@pytest.mark.parametrize("name", catalogue("correct_"))
def test_correct_code_has_no_static_error_and_reveals_its_shapes(pyrefly: Any, name: str) -> None:
    assert errors(pyrefly, name) == {}
    revealed = {e["line"]: e["concise_description"] for e in pyrefly.get(name, []) if e["name"] == "reveal-type"}
    for line, (kind, expected) in markers(name).items():
        if kind == "reveal":
            assert revealed.get(line) == f"revealed type: {expected}", (line, revealed.get(line))


@pytest.mark.parametrize("name", sorted(EXPECTED_MISSES))
def test_the_expected_misses_are_still_missed(pyrefly: Any, name: str) -> None:
    """What pyrefly cannot express, listed: if it starts flagging one, move the file to the mistakes."""
    assert errors(pyrefly, name) == {}, f"pyrefly now catches {name}: rename it mistake_ and mark `# static: error`"


@pytest.mark.parametrize("name", sorted(KNOWN_FALSE_ALARMS))
def test_the_known_false_alarms_are_exactly_those_listed(pyrefly: Any, name: str) -> None:
    listed = {line for line, (kind, _) in markers(name).items() if kind == "false-alarm"}
    assert set(errors(pyrefly, name)) == listed, errors(pyrefly, name)


def test_the_docs_example_has_no_static_error(tmp_path: Path) -> None:
    """The shape-typed python blocks of docs/static-shapes.md pass pyrefly as they pass the docs test."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL) if "static_jaxtyping" in b]
    assert blocks
    seen = "\nfrom typing import reveal_type\n\nreveal_type(gqa)\n"  # a revealed type: the file was checked
    (tmp_path / "example.py").write_text("\n".join(blocks) + seen)
    (tmp_path / "pyrefly.toml").write_text(
        f'python-version = "3.11"\nsearch-path = ["{ROOT}"]\nproject-includes = ["example.py"]\n'
    )
    generic = next(b for b in re.findall(r"```text\n(.*?)```", PAGE.read_text(), re.DOTALL) if "def gqa[" in b)
    (tmp_path / "generic").mkdir()
    (tmp_path / "generic" / "generic.py").write_text(generic + seen)  # PEP 695: pyrefly's generic form needs 3.12+
    (tmp_path / "generic" / "pyrefly.toml").write_text(f'python-version = "3.13"\nsearch-path = ["{ROOT}"]\n')
    for config, name in ((tmp_path, "example.py"), (tmp_path / "generic", "generic.py")):
        report = run_pyrefly(config / "pyrefly.toml")
        assert errors(report, name) == {}
        assert any(entry["name"] == "reveal-type" for entry in report[name])


def test_the_docs_comparison_lists_every_catalogue_file() -> None:
    """The page's table (measured by `python -m tools.static_compare`) has a row for each file, and no other."""
    rows = set(re.findall(r"^\| `(\w+\.py)` \|", PAGE.read_text(), re.MULTILINE))
    assert rows == {p.name for p in CATALOGUE.glob("*.py")}


def test_on_the_docs_and_examples_the_stub_flags_only_the_calls_they_expect_to_fail(tmp_path: Path) -> None:
    """Every python block of the docs (but errors.md's fragments) and every example, under pyrefly: an error that
    names shapesafe_mha is only ever a call the docs make wrong on purpose, the first line of a `try:` whose
    `except` catches `ssm.ShapeError` (the stub's shapes agree with the runtime checks; no false alarm)."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "errors.md")]
    block = re.compile(r"```python\n(.*?)```", re.DOTALL)
    sources = {p.stem.replace("-", "_") + ".py": "\n".join(block.findall(p.read_text())) for p in pages}
    sources |= {f"example_{p.name}": p.read_text() for p in (ROOT / "examples").glob("*.py")}
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pyrefly.toml").write_text(f'python-version = "3.11"\nsearch-path = ["{ROOT}"]\n')
    report = run_pyrefly(tmp_path / "pyrefly.toml")
    ours = [
        (name, entry)
        for name, entries in report.items()
        for entry in entries
        if entry["severity"] == "error" and "shapesafe_mha" in entry["description"]
    ]
    for name, entry in ours:
        lines = sources[name].splitlines()
        line = entry["line"]
        after = lines[line:]
        expects = next((text for text in after if text.strip().startswith("except")), "")
        assert lines[line - 2].strip() == "try:" and "ShapeError" in expects, (name, line, entry["description"])
    assert len(ours) >= 3  # README's, index.md's and from-hf.md's deliberate mistakes
