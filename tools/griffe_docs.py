"""A griffe extension for the API reference (mkdocs.yml loads it): our docstrings as readers meet them.

Three things, all at load time, none of them in the package:

- **Shapes on the signature.** A stage is annotated with a shape alias from `shapesafe_mha._core.dims`
  (`q: Heads`); a reader of the reference sees what it stands for,
  `q: Float[Tensor, "batch num_heads seq d_head"]`, as `help()` shows it.
- **`Example:`** (the house's singular) is read as google style's `Examples:` section, so the
  `>>>` lines render as code with their output.
- **`k, v: ...`** (one description for several arguments) becomes one entry per argument.
"""

import dataclasses
import re
from typing import Any

import griffe

DIMS_MODULE = "shapesafe_mha._core.dims"
EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
SHARED = re.compile(r"^(\s+)(\w+(?:, \w+)+):(.*)$")


def expand(expr: Any, dims: griffe.Module) -> Any:
    """`expr` with every name of a `_dims` shape alias replaced by the alias's own expression."""
    if isinstance(expr, griffe.ExprName):
        path = expr.canonical_path
        if path.startswith(DIMS_MODULE + "."):
            target = dims.members.get(path.removeprefix(DIMS_MODULE + "."))
            if isinstance(target, griffe.Attribute) and isinstance(target.value, griffe.Expr):
                return target.value
        return expr
    if isinstance(expr, griffe.Expr) and dataclasses.is_dataclass(expr):
        for field in dataclasses.fields(expr):
            value = getattr(expr, field.name)
            if isinstance(value, list):
                setattr(expr, field.name, [expand(item, dims) for item in value])
            elif isinstance(value, griffe.Expr):
                setattr(expr, field.name, expand(value, dims))
    return expr


def split_shared(text: str) -> str:
    """`k, v: desc` (and its indented continuation lines) -> one such entry per name."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = SHARED.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent, names, rest = match.groups()
        block = [lines[i]]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            block.append(lines[i])
            i += 1
        for name in names.split(", "):
            out.extend([f"{indent}{name}:{rest}", *block[1:]])
    return "\n".join(out)


def objects(obj: griffe.Object) -> list[griffe.Object]:
    """`obj` and every object defined under it (aliases left out: they point at these)."""
    found = [obj]
    for member in obj.members.values():
        if not isinstance(member, griffe.Alias):
            found.extend(objects(member))
    return found


class ShapesafeDocs(griffe.Extension):
    """Expand shape aliases on signatures and normalise two docstring idioms (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        dims = pkg.modules.get("_dims")
        for obj in objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = split_shared(EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
            if dims is None or obj.module is dims:
                continue
            if isinstance(obj, griffe.Function):
                for parameter in obj.parameters:
                    parameter.annotation = expand(parameter.annotation, dims)
                obj.returns = expand(obj.returns, dims)
            elif isinstance(obj, griffe.Attribute):
                obj.annotation = expand(obj.annotation, dims)
