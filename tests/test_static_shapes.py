"""Static shapes: the shipped stub is what the runtime annotations generate; pyrefly flags the catalogue."""

import subprocess
import sys

from tools.static_stubs import STUB, generate


def test_the_shipped_stub_is_generated_from_the_runtime_annotations() -> None:
    """`shapesafe_mha/__init__.pyi` is exactly what `tools/static_stubs.py` writes from today's annotations."""
    assert STUB.read_text() == generate(), "the stub is stale: run `python -m tools.static_stubs`"


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
