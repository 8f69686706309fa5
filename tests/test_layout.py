"""The package's layout holds: folders by concern, imports one way (down the floors), no circles.

Read from the `import` statements (the `ast` of every module), not from running them: a deferred
import inside a function counts too, since it runs back up the same way when it runs.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shapesafe_mha"

# Bottom to top. A module may import its own floor and those below, never above.
FLOORS = ("_core", "_compute", "_modules", "_interop", "testing", "_tools")
SURFACE = len(FLOORS)  # the thin public modules at the top: shapesafe_mha, .dims, .hf, .parallel, .reference

# The only imports that run up a floor, each deferred (inside the function that needs it) and why.
UPWARD = {
    ("_modules.conversions", "_interop.hf"): "MultiHeadAttention.from_hf/to_hf: public classmethods, done by interop",
    ("_modules.conversions", "_interop.torch_nn"): "MultiHeadAttention.from_torch/to_torch/from_weights, the same",
    ("_modules.latent", "_interop.hf"): "LatentAttention.from_hf, the same",
    ("_compute.reference", "_modules.config"): "per_head_attention's config= annotation, for type checkers only",
}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    top = module.split(".")[0]
    return FLOORS.index(top) if top in FLOORS else SURFACE


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module of ours, deferred) for every import statement of `path`."""
    return _imports_of(path.read_text(), _name(path), path.name == "__init__.py")


def _imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, bool]]:
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "shapesafe_mha" or node.module.startswith("shapesafe_mha.")):
                target = node.module.removeprefix("shapesafe_mha").lstrip(".")
            else:
                continue
            names = [f"{target}.{a.name}".lstrip(".") for a in node.names]
            submodules = [n for n in names if _exists(n)]
            targets = submodules or [target]
        elif isinstance(node, ast.Import):
            ours = [a.name for a in node.names if a.name.startswith("shapesafe_mha")]
            targets = [name.removeprefix("shapesafe_mha").lstrip(".") for name in ours]
        else:
            continue
        deferred = id(node) not in top_level or _guarded(tree, node)
        found += [(t, deferred) for t in targets]
    return found


def _guarded(tree: ast.Module, node: ast.AST) -> bool:
    """Under `if TYPE_CHECKING:` at the top level: read by type checkers only."""
    for statement in tree.body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            if any(child is node for child in ast.walk(statement)):
                return True
    return False


def _exists(module: str) -> bool:
    path = PACKAGE.joinpath(*module.split(".")) if module else PACKAGE
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def test_every_private_module_lives_in_a_folder_by_concern() -> None:
    """No flat private module: a new one goes into the folder of its concern (docs/contributors.md)."""
    flat = [m for m, p in MODULES.items() if p.parent == PACKAGE and m.startswith("_") and m != "__main__"]
    assert flat == []
    assert {m.split(".")[0] for m in MODULES if "." in m} <= set(FLOORS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_floors(module: str) -> None:
    """Each import goes to the importer's floor or below; the three deferred conversions are the only exceptions."""
    upward = [
        target
        for target, deferred in _imports(MODULES[module])
        if _floor(target) > _floor(module) and not (deferred and (module, target) in UPWARD)
    ]
    assert upward == [], f"{module} imports {upward}, above its floor ({FLOORS[_floor(module)]})"


def test_the_upward_exceptions_are_still_needed() -> None:
    """An exception nobody uses any more is removed, so the list says what is true."""
    used = {(m, t) for m in MODULES for t, deferred in _imports(MODULES[m]) if deferred}
    assert set(UPWARD) <= used


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of `graph` (module -> modules it imports at load), as a path, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            circle = visit(target, [*path, node])
            if circle:
                return circle
        done.add(node)
        return None

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_no_circle_among_the_modules_imported_at_load() -> None:
    """Module-level imports form no circle (a circle is an import order that works by luck)."""
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    # importing a package's module runs its __init__ first: that edge is Python's, not a circle of ours
    graph = {
        m: {t for t, deferred in _imports(p) if not deferred and t in MODULES and t != m and t not in packages}
        for m, p in MODULES.items()
    }
    assert _circle(graph) is None


def test_the_checks_see_an_upward_import_a_deferred_one_and_a_circle() -> None:
    """The checker itself, on sources written for it: what it must report, it reports."""
    up = _imports_of("from .._modules.multihead import MultiHeadAttention\n", "_core.bad", is_package=False)
    assert up == [("_modules.multihead", False)] and _floor("_modules.multihead") > _floor("_core.bad")
    inside = _imports_of("def f():\n    from ..testing import _toolkit\n", "_compute.bad", is_package=False)
    assert inside == [("testing._toolkit", True)]
    absolute = _imports_of("import shapesafe_mha._tools.cli as cli\n", "_core.bad", is_package=False)
    assert absolute == [("_tools.cli", False)]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


CONTRIBUTORS = PACKAGE.parent / "docs" / "contributors.md"


def _tree_files() -> set[str]:
    """The files the tree of docs/contributors.md shows, as paths relative to the package."""
    block = CONTRIBUTORS.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    files, folder = set(), ""
    for line in block.splitlines()[1:]:
        nested = line.startswith(" " * 8)  # a file inside a folder: indented under the folder's line
        names = re.findall(r"\b\w+\.py\b|\b\w+/", line)
        if not nested:
            folder = names[0] if names and names[0].endswith("/") else ""
        files |= {(folder if nested else "") + n for n in names if n.endswith(".py")}
    return files


def test_the_contributors_page_shows_the_tree_as_it_is() -> None:
    """docs/contributors.md's tree lists every module of the package and no other (a private folder's
    `__init__` holds only its docstring, and is not listed)."""
    actual = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and not (p.name == "__init__.py" and p.parent.name.startswith("_"))
    }
    assert _tree_files() == actual


def test_the_path_of_one_call_names_functions_where_they_are() -> None:
    """Each "`name` in `file`" or "`name` (`file`)" of the page is defined in that file."""
    text = CONTRIBUTORS.read_text().split("## The path of one call", 1)[1]
    pairs = re.findall(r"`(\w+)`\s+(?:in\s+|\()`(_\w+/\w+\.py)`", text.replace("\n   ", " "))
    assert len(pairs) >= 6
    for name, file in pairs:
        tree = ast.parse((PACKAGE / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert name in defined, f"{name} is not defined in {file}"
