"""Every code block in README.md and docs/ runs, and every docstring example holds, so examples cannot rot."""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import shapesafe_mha

ROOT = Path(__file__).resolve().parent.parent
# errors.md shows code that fails on purpose; tests/test_errors.py runs and checks it.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "errors.md")]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


PRINTED = re.compile(r"^(print\(.*\))\s+# (.*)$")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run_and_their_printed_comments_hold(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run a page's python blocks in order; `print(...)  # text` must print `text` (up to " -- ")."""
    namespace: dict[str, object] = {}
    for block in BLOCK.findall(page.read_text()):
        if "torchrun" in block:  # a torchrun script: it must be the example file tests/test_parallel.py runs
            assert block == (ROOT / "examples" / "head_parallel.py").read_text()
            continue
        expected = []
        for line in block.splitlines():
            match = PRINTED.match(line)
            if match:
                expected.append(match.group(2).split(" -- ")[0].strip())
        capsys.readouterr()
        exec(compile(block, str(page), "exec"), namespace)
        printed = capsys.readouterr().out
        for text in expected:
            assert text in printed, f"{page.name}: expected {text!r} in the output:\n{printed}"


def _modules() -> list[str]:
    """Every module of the package, those of its folders (`_core`, `_interop`, ...) included."""
    names = [shapesafe_mha.__name__]
    for info in pkgutil.walk_packages(shapesafe_mha.__path__, prefix=f"{shapesafe_mha.__name__}."):
        if not info.name.endswith(".__main__"):
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    """The runnable example in each public docstring prints what it says."""
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
