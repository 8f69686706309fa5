"""Runtime shape checking: jaxtyping annotations, beartype as the checker of record, readable errors.

A check depends only on the *signature* of a call: each tensor's shape, dtype and device and the
values of the plain arguments. So the first call with a given signature is checked in full (our
binder, which explains a mismatch in one sentence, then beartype+jaxtyping, which has the last word)
and the verdict is remembered; later calls with the same signature cost one dictionary lookup. A
call with a new signature, including a wrong one, is always checked in full.
"""

import contextlib
import contextvars
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
from beartype.door import is_bearable
from jaxtyping import AbstractArray, jaxtyped
from jaxtyping._array_types import _AnonymousDim, _FixedDim, _NamedDim

from ._dims import DIMS
from ._errors import ConfigError, ShapeError

P = ParamSpec("P")
R = TypeVar("R")

_ENV_VAR = "SHAPESAFE_MHA_UNCHECKED"
_OFF_BY_ENV = os.environ.get(_ENV_VAR, "") not in ("", "0")
_off: contextvars.ContextVar[bool] = contextvars.ContextVar("shapesafe_mha_unchecked", default=False)

_MAX_VERDICTS = 4096


def checks_enabled() -> bool:
    """Whether runtime checks run now (see `unchecked`).

    Example:
        >>> import shapesafe_mha as ssm
        >>> with ssm.unchecked():
        ...     print(ssm.checks_enabled())
        False
    """
    # is_compiling first: dynamo folds it to a constant and never traces the ContextVar.
    return not (torch.compiler.is_compiling() or _OFF_BY_ENV or _off.get())


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Turn shapesafe_mha's runtime checks off inside a `with` block (this thread/task only).

    Setting the environment variable `SHAPESAFE_MHA_UNCHECKED=1` before import turns them off
    for the whole process.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> with ssm.unchecked():
        ...     print(ssm.split_heads(torch.zeros(1, 3, 8), 2).shape)
        torch.Size([1, 2, 3, 4])
    """
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


# --- The binder: explains a mismatch as one sentence -------------------------------------------------


@dataclass
class _Bound:
    size: int
    source: str


def _short_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind_of(hint: Any) -> str:
    kinds: set[str] = set()
    for name in hint.dtypes:
        if name.startswith("bool"):
            kinds.add("bool")
        elif name.startswith(("float", "bfloat")):
            kinds.add("floating point")
        else:
            kinds.add(name)
    if kinds == {"floating point"}:
        return "floating point (float16, bfloat16, float32 or float64)"
    return " or ".join(sorted(kinds))


def _dim_label(dim: Any) -> str:
    if isinstance(dim, _NamedDim):
        return ("#" if dim.broadcastable else "") + dim.name
    if isinstance(dim, _FixedDim):
        return str(dim.size)
    return "_"


def _spec(hint: Any) -> str:
    return "(" + ", ".join(_dim_label(d) for d in hint.dims) + ")"


def _array_alternatives(hint: Any) -> list[Any] | None:
    """The jaxtyping array types a hint accepts, or None if it is not an array hint."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return [hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arrays = [a for a in typing.get_args(hint) if isinstance(a, type) and issubclass(a, AbstractArray)]
        return arrays or None
    return None


def _accepts_none(hint: Any) -> bool:
    return hint is None or hint is type(None) or type(None) in typing.get_args(hint)


class _MismatchError(Exception):
    """Internal: one failed hint, with its sentence."""

    def __init__(
        self,
        sentence: str,
        *,
        rank: int = 0,
        arg: str | None = None,
        dim: str | None = None,
        size: int | None = None,
        bound: int | None = None,
    ) -> None:
        super().__init__(sentence)
        self.sentence = sentence
        self.rank = rank  # how far the value got: used to pick the most telling union alternative
        self.arg, self.dim, self.size, self.bound = arg, dim, size, bound


class Mismatch(typing.NamedTuple):
    """What `explain` hooks see of a failed check: the argument, dimension, given and bound sizes."""

    arg: str | None
    dim: str | None
    size: int | None
    bound: int | None


def _bind_array(name: str, value: torch.Tensor, hint: Any, memo: dict[str, _Bound]) -> None:
    dims = tuple(hint.dims)
    dtype = _short_dtype(value.dtype)
    if dtype not in hint.dtypes:
        raise _MismatchError(f"{name} has dtype {dtype}, but it must be {_kind_of(hint)}.", rank=0, arg=name)
    if value.ndim != len(dims):
        spec = " ".join(_dim_label(d) for d in dims)
        leading = value.ndim == len(dims) - 1 and isinstance(dims[0], _NamedDim) and dims[0].name == "batch"
        raise _MismatchError(
            f"{name} must be {len(dims)}-D ({spec}), but it is {value.ndim}-D with shape {tuple(value.shape)}"
            + (f"; if the batch axis is missing, add it with {name}.unsqueeze(0)." if leading else "."),
            rank=1,
            arg=name,
        )
    for axis, (dim, size) in enumerate(zip(dims, value.shape, strict=True)):
        if isinstance(dim, _FixedDim):
            if size != dim.size and not (dim.broadcastable and size == 1):
                raise _MismatchError(
                    f"{name} has size {size} at axis {axis}, but it must be {dim.size}.", rank=2 + axis
                )
        elif isinstance(dim, _NamedDim):
            bound = memo.get(dim.name)
            if bound is None:
                if not (dim.broadcastable and size == 1):
                    memo[dim.name] = _Bound(size, name)
            elif size != bound.size and not (dim.broadcastable and size == 1):
                hint_1 = " (or 1, to broadcast)" if dim.broadcastable else ""
                raise _MismatchError(
                    f"{name} has {dim.name}={size} (axis {axis}), but {bound.source} set "
                    f"{dim.name}={bound.size}{hint_1}.",
                    rank=2 + axis,
                    arg=name,
                    dim=dim.name,
                    size=size,
                    bound=bound.size,
                )
        elif not isinstance(dim, _AnonymousDim):
            raise NotImplementedError(f"shapesafe_mha's binder does not handle {dim!r}")


def _bind(name: str, value: Any, hint: Any, memo: dict[str, _Bound], sources: dict[str, str] | None = None) -> None:
    """Check one value against its hint, binding dimensions in `memo`; raise `_MismatchError` on failure."""
    if value is None and _accepts_none(hint):
        return
    arrays = _array_alternatives(hint)
    if arrays is None:
        if isinstance(value, int) and name in DIMS:
            if isinstance(value, bool):
                raise _MismatchError(f"{name} must be an int, but got the bool {value}.", arg=name)
            _bind_int(name, value, memo, (sources or {}).get(name))
        if not is_bearable(value, hint):
            raise _MismatchError(f"{name} must be {_hint_name(hint)}, but got {type(value).__name__}.")
        return
    if not isinstance(value, torch.Tensor):
        raise _MismatchError(
            f"{name} must be a torch.Tensor, but got {type(value).__module__}.{type(value).__qualname__}; "
            f"convert it with torch.as_tensor({name}).".replace("builtins.", "")
        )
    failures: list[_MismatchError] = []
    for alternative in arrays:
        trial = dict(memo)
        try:
            _bind_array(name, value, alternative, trial)
        except _MismatchError as failure:
            failures.append(failure)
            continue
        memo.update(trial)
        return
    if len(arrays) == 1:
        raise failures[0]
    best = max(failures, key=lambda f: f.rank)
    if best.rank == 0:
        kinds = " or ".join(sorted({_kind_of(a).split(" (")[0] for a in arrays}))
        raise _MismatchError(f"{name} has dtype {_short_dtype(value.dtype)}, but it must be {kinds}.", arg=name)
    if best.rank == 1:
        shapes = " or ".join(dict.fromkeys(_spec(a) for a in arrays))
        raise _MismatchError(f"{name} must be {shapes}, but it is {value.ndim}-D {tuple(value.shape)}.", arg=name)
    raise best


def _bind_int(name: str, value: int, memo: dict[str, _Bound], source: str | None) -> None:
    if value <= 0:
        raise _MismatchError(f"{name} must be positive, but got {name}={value}.")
    bound = memo.get(name)
    if bound is None:
        memo[name] = _Bound(value, source or f"{name}={value}")
    elif bound.size != value:
        raise _MismatchError(f"{name}={value} was given, but {bound.source} set {name}={bound.size}.")


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def named_shape(value: Any, hint: Any = None) -> str:
    """`f32[batch=2, seq=5, d_model=32]` for a tensor, or a short repr for anything else."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    abbrev = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "bool": "bool"}
    dtype = _short_dtype(value.dtype)
    dtype = abbrev.get(dtype, dtype)
    names: tuple[str, ...] = ()
    for alternative in _array_alternatives(hint) or []:
        dims = tuple(alternative.dims)
        if len(dims) == value.ndim:
            names = tuple(_dim_label(d).lstrip("#") for d in dims)
            break
    if not names:
        return f"{dtype}{list(value.shape)}"
    return f"{dtype}[" + ", ".join(f"{n}={s}" for n, s in zip(names, value.shape, strict=True)) + "]"


# --- The decorator -----------------------------------------------------------------------------------

Validator = Callable[[dict[str, Any], dict[str, int]], None]
Precheck = Callable[[dict[str, Any]], None]
Explainer = Callable[[dict[str, Any], Mismatch], str | None]


class _Uncacheable:
    """Marks an argument whose verdict cannot be remembered (it is always checked in full)."""


_ITSELF = frozenset({int, str, type(None), torch.dtype, torch.device})  # hashable, and no two kinds collide


def _signature_of(value: Any) -> Any:
    """What a check depends on: a tensor's shape, dtype and device; a plain value itself."""
    kind = type(value)
    if kind in _ITSELF:
        return value
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    if kind is bool or kind is float:
        return (kind, value)  # True == 1 == 1.0 would collide with the int
    if kind is tuple:
        return (kind, tuple(_signature_of(v) for v in value))
    return _Uncacheable


@dataclass(frozen=True)
class CheckedFunction:
    """What `checked` knows about a function: its public name, parameters, hints and extra checks."""

    public_name: str
    signature: inspect.Signature
    hints: dict[str, Any]
    validate: Validator | None
    sources: dict[str, str]
    precheck: Precheck | None = None
    explain: Explainer | None = None

    def describe(self, arguments: dict[str, Any]) -> str:
        lines = []
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor):
                lines.append(f"  {name}: {named_shape(value, self.hints.get(name))}")
        return "\n".join(lines)

    def full_check(self, arguments: dict[str, Any]) -> dict[str, _Bound]:
        memo: dict[str, _Bound] = {}
        if self.precheck is not None:
            try:
                self.precheck(arguments)
            except _MismatchError as failure:
                raise self.error(failure.sentence, arguments, memo) from None
        for name, value in arguments.items():
            hint = self.hints.get(name)
            if hint is None:
                continue
            try:
                _bind(name, value, hint, memo, self.sources)
            except _MismatchError as failure:
                sentence = failure.sentence
                if self.explain is not None:
                    fix = self.explain(arguments, Mismatch(failure.arg, failure.dim, failure.size, failure.bound))
                    sentence = f"{sentence} {fix}" if fix else sentence
                raise self.error(sentence, arguments, memo) from None
        if self.validate is not None:
            try:
                self.validate(arguments, {k: b.size for k, b in memo.items()})
            except _MismatchError as failure:
                raise self.error(failure.sentence, arguments, memo) from None
            except ConfigError as failure:
                raise ConfigError(f"{self.public_name}: {failure}") from None
        # beartype (with jaxtyping's shared memo) is the checker of record.
        with jaxtyped("context"):  # pyright: ignore[reportCallIssue,reportArgumentType]
            for name, value in arguments.items():
                hint = self.hints.get(name)
                if hint is not None and not is_bearable(value, hint):
                    raise self.error(
                        f"{name} does not satisfy its annotation {_hint_name(hint)}.", arguments, memo
                    ) from None
        return memo

    def error(self, sentence: str, arguments: dict[str, Any], memo: dict[str, _Bound]) -> ShapeError:
        detail = self.describe(arguments)
        bound = ", ".join(f"{k}={b.size} ({b.source})" for k, b in memo.items())
        text = f"{self.public_name}: {sentence}"
        if detail:
            text += "\nCalled with:\n" + detail
        if bound:
            text += "\nBound so far: " + bound
        return ShapeError(text)


def mismatch(sentence: str) -> _MismatchError:
    """For validators: a failed check, reported with the call's detail by `checked`."""
    return _MismatchError(sentence)


def checked(
    fn: Callable[P, R] | None = None,
    *,
    validate: Validator | None = None,
    name: str | None = None,
    sources: dict[str, str] | None = None,
    precheck: Precheck | None = None,
    explain: Explainer | None = None,
) -> Any:
    """Decorate `fn` so each call is checked against its jaxtyping annotations (see module doc).

    `validate(arguments, dims)` runs after the annotations bind: it checks what an annotation
    cannot say (divisibility, matching dtypes) and raises `mismatch(...)` or `ConfigError`. Plain
    `int` parameters named after a dimension (`num_heads`) bind that dimension; `sources` names
    who set it in messages (`{"d_model": "the module"}`). `precheck(arguments)` runs first
    (dtypes and devices, which need no dimensions); `explain(arguments, mismatch)` may return
    the usual cause of a dimension mismatch, appended to the message.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        hints = typing.get_type_hints(fn, include_extras=True)
        returns = hints.pop("return", None)
        info = CheckedFunction(
            name or f"{fn.__name__}()", inspect.signature(fn), hints, validate, sources or {}, precheck, explain
        )
        verdicts: dict[Any, bool] = {}

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if torch.compiler.is_compiling() or _OFF_BY_ENV or _off.get():
                return fn(*args, **kwargs)
            key = tuple(map(_signature_of, args))
            if kwargs:
                key += tuple((k, _signature_of(v)) for k, v in kwargs.items())
            if key in verdicts:
                return fn(*args, **kwargs)
            try:
                bound = info.signature.bind(*args, **kwargs)
            except TypeError as failure:
                raise TypeError(f"{info.public_name}: {failure}") from None
            bound.apply_defaults()
            memo = info.full_check(dict(bound.arguments))
            result = fn(*args, **kwargs)
            if returns is not None:
                try:
                    _bind("the result", result, returns, memo)
                except _MismatchError as failure:  # a bug in the stage itself, not in the call
                    raise info.error(
                        f"returned a wrong value: {failure.sentence}", dict(bound.arguments), memo
                    ) from None
            if _Uncacheable not in key and not any(k[1] is _Uncacheable for k in key[len(args) :]):
                if len(verdicts) >= _MAX_VERDICTS:
                    verdicts.clear()
                verdicts[key] = True
            return result

        wrapper.__shapesafe__ = info  # pyright: ignore[reportAttributeAccessIssue]
        return wrapper

    if fn is not None:
        return decorate(fn)
    return decorate
