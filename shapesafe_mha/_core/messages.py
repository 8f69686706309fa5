"""Messages: the one place that turns a failed check into a sentence a user can act on.

jaxtyping and beartype decide whether a value fits its annotation; this module only *explains* a
failure they reported. It reads an annotation through jaxtyping's public surface (the array type's
`dim_str` and `dtypes`) and the dimensions bound so far in the call, and finds the first axis that
disagrees: "k has d_head=32 (axis 3), but q set d_head=64."
"""

import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch
from beartype.door import is_bearable
from jaxtyping import AbstractArray, Float

from .errors import ShapeError


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


def shown(values: list[int], limit: int = 8) -> str:
    """`{1, 2, 4, ...}`: a short list of sizes that would work."""
    return "{" + ", ".join(map(str, values[:limit])) + (", ...}" if len(values) > limit else "}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Bound:
    """A dimension's size in the current call, and who set it (an argument, a stage, "the module")."""

    size: int
    source: str


Memo = dict[str, Bound]


class ExplainedError(Exception):
    """Internal: a check failed; `sentence` says why. Turned into a `ShapeError` at the public boundary."""

    def __init__(self, sentence: str, *, arg: str | None = None, dim: str | None = None, size: int | None = None):
        super().__init__(sentence)
        self.sentence, self.arg, self.dim, self.size = sentence, arg, dim, size


def mismatch(sentence: str, **detail: Any) -> ExplainedError:
    """For a stage's explicit checks (what an annotation cannot say): a failure with its sentence."""
    return ExplainedError(sentence, **detail)


# --- reading an annotation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """One token of an annotation's dimension string."""

    name: str  # "batch", "num_heads*d_head", "8", or "_" (anything)
    broadcast: bool

    @property
    def symbolic(self) -> bool:
        return not self.name.isidentifier() and not self.name.isdigit()


def axes(hint: Any) -> tuple[Axis, ...]:
    """The axes of a jaxtyping array type, from its public `dim_str`."""
    tokens = hint.dim_str.split()
    return tuple(Axis(t.lstrip("#"), t.startswith("#")) for t in tokens)


def arrays_of(hint: Any) -> list[Any]:
    """The jaxtyping array types a hint accepts (several for a union); empty if it accepts no array."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in arrays_of(arg)]
    return []


def named_shape_of(hint: Any, value: Any) -> str:
    """The dimension names of the alternative of `hint` that `value` is (its rank and dtype), for a union the first
    that fits (`AttnMask` holds a 2-D and a 4-D mask); "" if the hint accepts no array."""
    arrays = arrays_of(hint)
    for array in arrays:
        dtypes = array.dtypes
        if len(array.dims) == value.ndim and (
            not isinstance(dtypes, tuple | list) or str(value.dtype).removeprefix("torch.") in dtypes
        ):
            return array.dim_str
    return arrays[0].dim_str if arrays else ""


def bearable(value: Any, hint: Any) -> bool:
    """`beartype.door.is_bearable`, but every item of a `tuple[X, ...]` or `list[X]` checked: beartype checks
    one item, drawn at random (its O(1) strategy; the linear one is not implemented), so a wrong item among
    right ones passed now and then, and a tuple's verdict, once remembered, admitted it for good."""
    origin = typing.get_origin(hint)
    if (origin is tuple or origin is list) and isinstance(value, origin):
        parts = typing.get_args(hint)
        if origin is tuple and len(parts) == 2 and parts[1] is ...:
            return all(bearable(item, parts[0]) for item in value)
        if origin is list and len(parts) == 1:
            return all(bearable(item, parts[0]) for item in value)
    return is_bearable(value, hint)  # a tuple of fixed length: beartype checks each of its items


def accepts_none(hint: Any) -> bool:
    return hint is None or hint is type(None) or type(None) in typing.get_args(hint)


def spec(hint: Any) -> str:
    return hint.dim_str


def kind_of(hint: Any) -> str:
    """What dtypes an array type accepts: "floating point" (every float, `Float`), "bool", "bool or floating
    point", or the dtypes it names ("float32" for `Float32`)."""
    if not isinstance(hint.dtypes, list | tuple):
        return "any dtype"
    names = set(hint.dtypes)
    kinds = set()
    if _FLOATING <= names:
        kinds.add("floating point")
        names -= _FLOATING
    kinds.update("bool" if name.startswith("bool") else name for name in names)
    return " or ".join(sorted(kinds))


_FLOATING = frozenset(typing.cast(Any, Float).dtypes)  # what `Float` accepts, in this jaxtyping


def _expected(axis: Axis, memo: Memo) -> tuple[int | None, str]:
    """The size an axis must have given the memo, and who set it; (None, "") when it is still free."""
    if axis.name.isdigit():
        return int(axis.name), "the annotation"
    if axis.name == "_":
        return None, ""
    if not axis.symbolic:
        bound = memo.get(axis.name)
        return (bound.size, bound.source) if bound else (None, "")
    names = re.findall(r"[A-Za-z_]\w*", axis.name)
    if not all(n in memo for n in names):
        return None, ""
    values = {n: memo[n].size for n in names}
    size = eval(axis.name, {"__builtins__": {}}, values)  # the same arithmetic jaxtyping evaluates
    sources = sorted({memo[n].source for n in names})
    return int(size), " and ".join(sources) + " (" + ", ".join(f"{n}={v}" for n, v in values.items()) + ")"


def _misfit(name: str, value: torch.Tensor, hint: Any, memo: Memo) -> tuple[int, ExplainedError] | None:
    """Why `value` does not fit one array type, ranked by how far it got; None if it fits."""
    if isinstance(hint.dtypes, list | tuple) and dtype_name(value.dtype) not in hint.dtypes:
        return 0, ExplainedError(
            f"{name} has dtype {dtype_name(value.dtype)}, but it must be {kind_of(hint)}.", arg=name
        )
    dims = axes(hint)
    if value.ndim != len(dims):
        missing_batch = value.ndim == len(dims) - 1 and dims[0].name == "batch"
        return 1, ExplainedError(
            f"{name} must be {len(dims)}-D ({spec(hint)}), but it is {value.ndim}-D with shape {tuple(value.shape)}"
            + (f"; if the batch axis is missing, add it with {name}.unsqueeze(0)." if missing_batch else "."),
            arg=name,
        )
    trial = dict(memo)
    for index, (axis, size) in enumerate(zip(dims, value.shape, strict=True)):
        if axis.broadcast and size == 1:
            continue
        expected, source = _expected(axis, trial)
        if expected is None:
            if not axis.symbolic and axis.name != "_":
                trial[axis.name] = Bound(size, name)
            continue
        if size != expected:
            either = " (or 1, to broadcast)" if axis.broadcast else ""
            return 2 + index, ExplainedError(
                f"{name} has {axis.name}={size} (axis {index}), but {source} set {axis.name}={expected}{either}.",
                arg=name,
                dim=axis.name,
                size=size,
            )
    return None


def explain(name: str, value: Any, hint: Any, memo: Memo) -> ExplainedError | None:
    """Why `value` fails `hint` given the dimensions bound in `memo`; None if no reason is visible here."""
    if value is None and accepts_none(hint):
        return None
    arrays = arrays_of(hint)
    origin = typing.get_origin(hint)
    if origin in (tuple, list) and isinstance(value, origin):  # the first part that fails, by its index
        parts = typing.get_args(hint)
        if origin is list or (len(parts) == 2 and parts[1] is ...):
            parts = parts[:1] * len(value)
        if len(parts) != len(value):
            return ExplainedError(f"{name} must be a tuple of {len(parts)}, but got a tuple of {len(value)}.", arg=name)
        # an array part is explained against the call's dimensions; any other only where it fails alone
        pairs = enumerate(zip(value, parts, strict=True))
        suspects = [(i, v, h) for i, (v, h) in pairs if arrays_of(h) or not bearable(v, h)]
        return next((f for i, v, h in suspects if (f := explain(f"{name}[{i}]", v, h, memo))), None)
    if not arrays:
        if accepts_none(hint) and len(typing.get_args(hint)) == 2:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        shown_type = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        return ExplainedError(f"{name} must be {shown_type}, but got {type(value).__name__} {value!r}.", arg=name)
    if not isinstance(value, torch.Tensor):
        if any(isinstance(value, a.array_type) for a in arrays if isinstance(a.array_type, type)):
            return None  # another library's array (numpy): no reason of ours to give
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        fix = "" if name.startswith("the result") else f"; convert it with torch.as_tensor({name})"
        return ExplainedError(f"{name} must be a torch.Tensor, but got {kind}{fix}.", arg=name)
    misfits = [m for m in (_misfit(name, value, a, memo) for a in arrays)]
    if any(m is None for m in misfits):
        return None
    ranked = [m for m in misfits if m is not None]
    if len(ranked) == 1:
        return ranked[0][1]
    best_rank, best = max(ranked, key=lambda m: m[0])
    if best_rank == 0:
        kinds = " or ".join(sorted({kind_of(a) for a in arrays}))
        return ExplainedError(f"{name} has dtype {dtype_name(value.dtype)}, but it must be {kinds}.", arg=name)
    if best_rank == 1:
        shapes = " or ".join(dict.fromkeys(f"({spec(a).replace(' ', ', ')})" for a in arrays))
        return ExplainedError(f"{name} must be {shapes}, but it is {value.ndim}-D {tuple(value.shape)}.", arg=name)
    return best


def bind(name: str, value: Any, hint: Any, memo: Memo, source: str) -> None:
    """Note in `memo` the dimensions that a value which passed its check has just bound."""
    if not isinstance(value, torch.Tensor):
        return
    for alternative in arrays_of(hint):
        if _misfit(name, value, alternative, memo) is not None:
            continue
        for axis, size in zip(axes(alternative), value.shape, strict=True):
            if axis.name.isidentifier() and axis.name != "_" and axis.name not in memo:
                if not (axis.broadcast and size == 1):
                    memo[axis.name] = Bound(int(size), source)
        return


# --- the message ---------------------------------------------------------------------------------------

_ABBREVIATIONS = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


def _layout(value: torch.Tensor) -> str | None:
    """"nested" or "sparse (torch.sparse_coo)" for a tensor that is not dense, else None."""
    if value.is_nested:
        return "nested"
    return None if value.layout is torch.strided else f"sparse ({value.layout})"


def not_dense(label: str, value: Any) -> ExplainedError | None:
    """A nested or sparse tensor, refused by name (every stage computes on dense tensors), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    layout = _layout(value)
    if layout is None:
        return None
    if layout == "nested":
        fix = f"pad it (torch.nested.to_padded_tensor({label}, 0.0)) and mask the padding"
    else:
        fix = f"make it dense ({label}.to_dense())"
    sentence = f"{label} is a {layout} tensor, but shapesafe_mha computes on dense tensors; {fix}."
    return ExplainedError(sentence, arg=label)


def named_shape(value: Any, hint: Any = None) -> str:
    """`f32[batch=2, seq=5, d_model=32]` for a tensor, or its type's name for anything else."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    layout = _layout(value)
    if layout is not None:
        return f"a {layout} tensor"
    dtype = _ABBREVIATIONS.get(dtype_name(value.dtype), dtype_name(value.dtype))
    for alternative in arrays_of(hint):
        names = [a.name for a in axes(alternative)]
        if len(names) == value.ndim:
            return f"{dtype}[" + ", ".join(f"{n}={s}" for n, s in zip(names, value.shape, strict=True)) + "]"
    return f"{dtype}{list(value.shape)}"


def shape_error(owner: str, sentence: str, called_with: list[tuple[str, Any, Any]], memo: Memo) -> ShapeError:
    """The library's `ShapeError`: the sentence on the first line, the call's named shapes and bound dims after."""
    text = f"{owner}: {sentence}"
    lines = [
        f"  {name}: {named_shape(value, hint)}" for name, value, hint in called_with if isinstance(value, torch.Tensor)
    ]
    if lines:
        text += "\nCalled with:\n" + "\n".join(lines)
    if memo:
        text += "\nBound so far: " + ", ".join(f"{k}={b.size} ({b.source})" for k, b in memo.items())
    return ShapeError(text)
