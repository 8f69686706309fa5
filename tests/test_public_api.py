"""The public surface: every name imports, errors are catchable as users expect, imports stay light."""

import subprocess
import sys

import pytest

import shapesafe_mha as ssm


def test_every_public_name_imports() -> None:
    """Everything in __all__ exists, and the sub-namespaces import."""
    for name in ssm.__all__:
        assert getattr(ssm, name) is not None, name
    from shapesafe_mha import parallel, reference, testing

    for name in parallel.__all__:
        assert getattr(parallel, name) is not None, name

    assert callable(reference.per_head_attention)
    for name in testing.__all__:
        assert getattr(testing, name) is not None, name
    from shapesafe_mha.testing import hf

    assert callable(hf.check_hf_attention)


STAGES = (
    "project",
    "split_heads",
    "merge_heads",
    "group_queries",
    "scaled_dot_product_attention",
    "attention_weights",
    "flex_attention",
)


def test_the_public_stages_are_exported_as_checked_stages() -> None:
    """Each public stage is in __all__ and is a checked Stage (its annotations are its contract)."""
    from shapesafe_mha._core.contract import Stage

    for name in STAGES:
        assert name in ssm.__all__, name
        assert isinstance(getattr(ssm, name), Stage), name


def test_error_hierarchy() -> None:
    """ShapeError is a TypeError, ConfigError a ValueError, both ShapesafeError, shown as shapesafe_mha.X."""
    assert issubclass(ssm.ShapeError, TypeError) and issubclass(ssm.ShapeError, ssm.ShapesafeError)
    assert issubclass(ssm.ConfigError, ValueError) and issubclass(ssm.ConfigError, ssm.ShapesafeError)
    assert ssm.ShapeError.__module__ == "shapesafe_mha"
    with pytest.raises(TypeError):
        ssm.split_heads("not a tensor", 2)  # type: ignore[arg-type]


def test_testing_namespace_needs_hypothesis_but_not_pytest() -> None:
    """`import shapesafe_mha.testing` works without pytest or transformers (hypothesis is its one extra)."""
    code = (
        "import sys, shapesafe_mha.testing\n"
        "print('pytest' in sys.modules, 'hypothesis' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "False"]


def test_import_does_not_pull_hypothesis_pytest_or_the_cli() -> None:
    """`import shapesafe_mha` loads neither hypothesis, pytest, nor the CLI framework (typer)."""
    code = (
        "import sys, shapesafe_mha\n"
        "heavy = [m for m in ('hypothesis', 'pytest', 'typer', 'shapesafe_mha._tools.cli') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_the_lazy_door_and_the_type_checkers_door_list_the_same_names() -> None:
    """`__init__` loads each name on first use (`--help` needs no torch); its TYPE_CHECKING imports,
    what pyright and the docs read, name the same objects from the same modules."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(ssm.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If))
    imported = {
        alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert imported == ssm._WHERE and set(imported) == set(ssm.__all__)
    code = "import sys, shapesafe_mha\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
