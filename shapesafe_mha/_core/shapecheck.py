"""Checks for the code users write: `shapecheck`, `expect` and `shape_scope`.

A user annotates their own function with jaxtyping dimension names (ours, from `shapesafe_mha.dims`, or
their own) and gets what our stages get: jaxtyping+beartype decide, the one formatter (`messages`)
explains, verdicts are remembered (`Verdicts`, the memo our stages and modules use). Sizes known before
any tensor bind first: `shape_scope`'s, then int arguments named like a dimension (`num_heads: int`),
then, in a method, int attributes of `self` so named (a module's sizes). So an alias with arithmetic
(`"batch seq num_heads*d_head"`) works as an argument annotation wherever its names are bound.
"""

import contextlib
import contextvars
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from jaxtyping import AnnotationError, Shaped
from torch import nn

from . import trace as _trace
from .contract import (
    COVERED,
    OFF,
    OWN,
    SHAPE_FAILURES,
    UNCACHEABLE,
    UNROLLED,
    Covering,
    Session,
    Verdicts,
    checks_enabled,
    compiling,
    mode,
    recheck,
    signature_key,
    signature_of,
    witness,
)
from .errors import ConfigError
from .messages import ExplainedError, arrays_of, axes

P = ParamSpec("P")
R = TypeVar("R")

# The session of the innermost checked call (where `expect` binds), a `_Replay` inside a method's call whose verdict
# is remembered, or None. (Inside a function's, `mode` is COVERED: its expectations held for these shapes.)
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("shapesafe_mha_current", default=None)
# The innermost checked call's contract and bound arguments, while its body runs: what `expect` binds its names from.
_binding: contextvars.ContextVar[Any] = contextvars.ContextVar("shapesafe_mha_binding", default=None)


def _reads_values(hint: Any) -> bool:
    """Whether an annotation's verdict depends on values, not only on types and shapes: `Annotated` metadata
    (a beartype validator, `Annotated[Tensor, Is[lambda t: ...]]`) anywhere in it."""
    if typing.get_origin(hint) is typing.Annotated:
        return True
    return any(_reads_values(part) for part in typing.get_args(hint) if part is not ...)


def dims_of(hint: Any) -> set[str]:
    """Every dimension name an annotation uses (its array types', arithmetic included)."""
    names: set[str] = set()
    for array in arrays_of(hint):
        for axis in axes(array):
            names.update(n for n in re.findall(r"[A-Za-z_]\w*", axis.name) if n != "_")
    if typing.get_origin(hint) is tuple:
        for part in typing.get_args(hint):
            names |= dims_of(part)
    return names


@functools.lru_cache(maxsize=256)
def _names_of(hint: Any) -> frozenset[str]:
    return frozenset(dims_of(hint))


@functools.lru_cache(maxsize=256)
def _sizes_hint(names: tuple[str, ...]) -> Any:
    return Shaped[torch.Tensor, " ".join(names)]


@functools.lru_cache(maxsize=256)
def _shape_hint(shape: str) -> Any:
    return Shaped[torch.Tensor, shape]


def _seed(session: Session, sizes: dict[str, tuple[int, str]], owner: str) -> None:
    """Bind known sizes before any tensor; a size that disagrees with one bound already is named."""
    fresh: dict[str, list[str]] = {}
    for name, (size, source) in sizes.items():
        bound = session.memo.get(name)
        if bound is not None and bound.size != size:
            raise session.fail(
                ExplainedError(f"{source} is {name}={size}, but {bound.source} set {name}={bound.size}.", dim=name)
            )
        if bound is None:
            fresh.setdefault(source, []).append(name)
    for source, names in fresh.items():
        session.seed(_sizes_hint(tuple(names)), witness(tuple(sizes[n][0] for n in names)), source)


def _is_size(value: Any) -> typing.TypeGuard[int]:
    return type(value) is int and value >= 0


def _attribute(owner: Any, name: str) -> Any:
    """`getattr(owner, name, None)`, without the exception a missing one costs on an `nn.Module` (its `__getattr__`
    formats a message, about a microsecond; a method's key reads every dimension name of its annotations, most of
    them no attribute of `self`): the class's attribute (a property, a constant) as getattr reads it, else the
    instance's own. (`nn.Module.__getattr__` finds only parameters, buffers and submodules, never an int; a class
    with a `__getattr__` of its own is asked as it is.)"""
    kind = type(owner)
    if hasattr(kind, name) or getattr(kind, "__getattr__", _MODULE_GETATTR) is not _MODULE_GETATTR:
        return getattr(owner, name, None)
    own = getattr(owner, "__dict__", None)
    return None if own is None else own.get(name)


_MODULE_GETATTR = nn.Module.__getattr__


class _Checked:
    """What `shapecheck` reads of a function once, at decoration; `__call__` checks one call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if isinstance(fn, functools.partial) or not callable(fn) or not isinstance(getattr(fn, "__qualname__", 0), str):
            what = "a functools.partial" if isinstance(fn, functools.partial) else f"a {type(fn).__name__}"
            raise ConfigError(
                f"shapecheck: {what} is no function with annotations of its own to check; decorate the function "
                "itself (def, or a method), and bind arguments afterwards: functools.partial(shapecheck(fn), ...)."
            )
        self.fn = fn
        self.owner = f"{fn.__qualname__}()"
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            kind = "a generator" if inspect.isgeneratorfunction(fn) else "an async"
            raise ConfigError(
                f"shapecheck: {fn.__qualname__} is {kind} function, whose call returns before its body runs, so its "
                "result cannot be checked; decorate the function that computes the tensors, or check them inside "
                "with shapesafe_mha.expect()."
            )
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except NameError as failure:  # a string annotation (`from __future__ import annotations`) naming a local
            raise ConfigError(
                f"shapecheck: {fn.__qualname__}'s annotations cannot be read at decoration ({failure}): an annotation "
                "that is a string (as under `from __future__ import annotations`) is looked up in the module's "
                "globals, so every name it uses must be defined at module level when the function is decorated."
            ) from None
        self.returns = hints.pop("return", None)
        self.hints = hints
        self.signature = inspect.signature(fn)
        parameters = list(self.signature.parameters.values())
        arrays = [h for h in [*hints.values(), self.returns] if arrays_of(h) or dims_of(h)]
        if not arrays:
            raise ConfigError(
                f"shapecheck: {fn.__qualname__} has no shape annotation to check; annotate its tensors with "
                'jaxtyping (Float[Tensor, "batch seq d_model"]) or an alias of shapesafe_mha.dims.'
            )
        names = set().union(*(dims_of(h) for h in arrays))
        self.names = frozenset(names)
        self.int_dims = tuple(p.name for p in parameters if p.name in names)
        self.method = bool(parameters) and parameters[0].name == "self"
        self.self_dims = tuple(sorted(names)) if self.method else ()
        # what a method's key reads of `self`: its annotations' names, and every name an `expect` inside bound
        self.key_dims = self.self_dims
        self.widened = 0  # how often `key_dims` grew (a call in flight then keeps no verdict)
        self.variadic = {p.name: p.kind for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        # every parameter a torch array (a jaxtyping class over Tensor, not a union), passed positionally: keyed
        # unrolled (`UNROLLED`, the same key)
        plain = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        arrays_only = len(plain) == len(parameters) and all(
            isinstance(hints.get(p.name), type) and [a.array_type for a in arrays_of(hints[p.name])] == [torch.Tensor]
            for p in plain
        )
        self.arity = len(plain) if arrays_only and not self.method and len(plain) in UNROLLED else -1
        self.verdicts = Verdicts()
        # a value validator (beartype's `Annotated[..., Is[...]]`) decides by values no key holds: never remembered
        # (nor a function whose result's signature differed between two calls of one key, see `shapecheck`)
        self.remembers = not any(_reads_values(h) for h in [*hints.values(), self.returns])

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the check reads, exactly: the arguments' signatures, and a method's sizes on `self`."""
        if not self.method or not args:
            return signature_key(args, kwargs)
        owner = args[0]
        held = tuple(_attribute(owner, name) for name in self.key_dims)
        return (type(owner), *(h if type(h) is int else None for h in held), *signature_key(args[1:], kwargs))

    def sizes(self, bound: inspect.BoundArguments, names: frozenset[str] | None = None) -> dict[str, tuple[int, str]]:
        """Sizes known before any tensor: int arguments named like a dimension, then int attributes of `self`; of
        the annotations' dimension names, or of `names` (an expectation's, `expecting`)."""
        int_dims, self_dims = self.int_dims, self.self_dims
        if names is not None:
            int_dims = tuple(n for n in self.signature.parameters if n in names)
            self_dims = tuple(sorted(names)) if self.method else ()
        sizes: dict[str, tuple[int, str]] = {}
        for name in int_dims:
            value = bound.arguments.get(name)
            if _is_size(value):
                sizes[name] = (value, f"the argument {name}")
        if self.method:
            owner = bound.arguments["self"]
            where = "the module" if isinstance(owner, nn.Module) else f"self ({type(owner).__name__})"
            for name in self_dims:
                value = _attribute(owner, name)
                if name not in sizes and _is_size(value):
                    sizes[name] = (value, where)
        return sizes

    def run(self, session: Session, args: tuple[Any, ...], kwargs: dict[str, Any], shared: bool = False) -> Any:
        """The call checked in `session` (its own, or a scope's), arguments first, then the result."""
        with session.calling(self.owner, shared):
            bound = self.fit_arguments(session, args, kwargs)
            token, binding = _current.set(session), _binding.set((self, bound))
            try:
                result = self.fn(*args, **kwargs)
            finally:
                _binding.reset(binding)
                _current.reset(token)
            self.fit_result(session, result)
            return result

    def fit_arguments(self, session: Session, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as failure:
            raise TypeError(f"{self.owner}: {failure}") from None
        bound.apply_defaults()
        _seed(session, self.sizes(bound), self.owner)
        values = list(self.arguments(bound))
        session.called_with = [(label, value, hint) for label, value, hint in values]
        for label, value, hint in values:
            self.fit(session, label, value, hint, label + session.where)
        return bound

    def expecting(self, session: Session, bound: inspect.BoundArguments, hint: Any) -> None:
        """Before an `expect` in the call: its dimension names that no annotation uses bound as an annotation's
        would be (`sizes`, the one rule: an int argument so named, else an int attribute of `self`). A method's
        key reads those of `self` from now on (a verdict that did not hold them is forgotten), so a remembered
        call of an instance with another size is checked as a fresh one."""
        extra = _names_of(hint) - self.names
        if not extra:
            return
        if self.method and not extra.issubset(self.key_dims):
            self.key_dims = tuple(sorted({*self.key_dims, *extra}))
            self.widened += 1
            self.verdicts.forget()
        _seed(session, self.sizes(bound, extra), self.owner)

    def fit_result(self, session: Session, result: Any) -> None:
        parts = typing.get_args(self.returns) if typing.get_origin(self.returns) is tuple else None
        if parts and isinstance(result, tuple) and ... not in parts:
            for index, (value, hint) in enumerate(zip(result, parts, strict=False)):
                self.fit(session, f"the result[{index}]", value, hint, f"the result of {self.owner}")
        else:
            self.fit(session, "the result", result, self.returns, f"the result of {self.owner}")

    def remembered(self, note: tuple[Any, ...], key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A method's call whose verdict is known. Its body reads `self` (parameters, flags, submodules), which the
        key does not hold, so each `expect` inside and what it returns are compared with what the checked call's
        expected and returned (`signature_of`, in order); from the first that differs on, they are checked, in the
        call's dimensions (the arguments and the expectations before it checked again), as a fresh call's would
        be, and the new signatures are remembered. The body runs once either way."""
        returned, expected = note
        widened = self.widened
        replay = _Replay(self, args, kwargs, expected)
        token = _current.set(replay)
        try:
            result = self.fn(*args, **kwargs)
            now = signature_of(result)
            if replay.session is None and now == returned and now is not UNCACHEABLE:
                return result
            self.fit_result(replay.session or replay.begin(), result)
        except BaseException as failure:
            replay.end(failure)
            raise
        finally:
            _current.reset(token)
        replay.end(None)
        if widened == self.widened:  # else `key` lacks a size on self that an expectation bound
            self.verdicts.remember(key, note=(now, tuple(replay.signatures)))
        return result

    def report(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call, its annotated arguments, expectations and result reported to the active observer (for
        `prove`, which checks them against torch's symbolic shapes): one group of names per call."""
        observer = _trace.current_observer()
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        group = _Reporting(observer, self.owner, {n: size for n, (size, _) in self.sizes(bound).items()})
        for label, value, hint in self.arguments(bound):
            group.add(label, value, hint)
        before = _trace.guards_so_far(bound.arguments.values())
        token = _current.set(group)
        try:
            result = self.fn(*args, **kwargs)
        finally:
            _current.reset(token)
            after = _trace.guards_so_far(bound.arguments.values())
            if before is not None and after is not None:
                _trace.note_guards(self.owner, before, after)  # a size-specific branch or slice made here
        parts = typing.get_args(self.returns) if typing.get_origin(self.returns) is tuple else None
        if parts and isinstance(result, tuple) and ... not in parts:
            for index, (value, hint) in enumerate(zip(result, parts, strict=False)):
                group.add(f"the result[{index}]", value, hint)
        else:
            group.add("the result", result, self.returns)
        return result

    def arguments(self, bound: inspect.BoundArguments) -> Iterator[tuple[str, Any, Any]]:
        for name, value in bound.arguments.items():
            hint = self.hints.get(name)
            kind = self.variadic.get(name)
            if kind is inspect.Parameter.VAR_POSITIONAL:
                yield from ((f"{name}[{i}]", v, hint) for i, v in enumerate(value))
            elif kind is inspect.Parameter.VAR_KEYWORD:
                yield from ((f"{name}[{k!r}]", v, hint) for k, v in value.items())
            elif hint is not None:
                yield name, value, hint

    def fit(self, session: Session, label: str, value: Any, hint: Any, source: str) -> None:
        failure = fits(session, label, value, hint, source)
        if failure is not None:
            raise session.fail(failure) from None


class _Reporting:
    """One decorated call reporting its values to an observer (under `prove`): its own group of names."""

    def __init__(self, observer: Any, owner: str, seed: dict[str, int]) -> None:
        self.observer, self.owner, self.seed, self.expectations = observer, owner, seed, 0

    def add(self, label: str, value: Any, hint: Any) -> None:
        if self.observer is None or not isinstance(value, torch.Tensor):
            return
        shapes = [a.dim_str for a in arrays_of(hint) if len(a.dim_str.split()) == value.ndim]
        if shapes:
            self.observer(f"{self.owner}: {label}", shapes[0], value, group=self, seed=self.seed)


def fits(session: Session, label: str, value: Any, hint: Any, source: str) -> ExplainedError | None:
    """`session.fits`, with an annotation whose arithmetic uses names nothing has bound explained too."""
    try:
        return session.fits(label, value, hint, source)
    except AnnotationError:
        arithmetic = [axis.name for array in arrays_of(hint) for axis in axes(array) if axis.symbolic]
        symbolic = {n for name in arithmetic for n in re.findall(r"[A-Za-z_]\w*", name)}
        names = sorted(n for n in symbolic if n not in session.memo)
        listed = ", ".join(names)
        return ExplainedError(
            f"{label}'s annotation uses {listed} in arithmetic, but nothing has bound {listed} yet: bind "
            "them first (an earlier argument, an int argument of that name, an attribute of self, or "
            f"shapesafe_mha.shape_scope({', '.join(f'{n}=...' for n in names)})).",
            arg=label,
        )


def shapecheck(fn: Callable[P, R]) -> Callable[P, R]:
    """Check a function's (or method's, or `nn.Module.forward`'s) shape annotations on every new kind of call.

    `jaxtyping`+`beartype` decide; a failure is a `ShapeError` whose first line names the function, the
    argument (or "the result"), the dimension, the axis, both sizes and what bound the expected one.
    Int arguments named like a dimension of the annotations bind it, and so do int attributes of `self`
    in a method (a module's sizes). Verdicts are remembered per exact signature, as our stages' are (a
    method's expectations and result are compared with its checked call's, since its body reads `self`, and
    checked from the first that differs); `ssm.unchecked()`, `SHAPESAFE_MHA_UNCHECKED=1` and `torch.compile`
    turn the checks off.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> from jaxtyping import Float
        >>> from torch import Tensor
        >>> @ssm.shapecheck
        ... def scale_heads(q: Float[Tensor, "batch num_heads seq d_head"],
        ...                 temperature: Float[Tensor, " num_heads"]) -> Float[Tensor, "batch num_heads seq d_head"]:
        ...     return q * temperature[:, None, None]
        >>> scale_heads(torch.ones(2, 6, 5, 8), torch.ones(6)).shape
        torch.Size([2, 6, 5, 8])
        >>> scale_heads(torch.ones(2, 6, 5, 8), torch.ones(2))
        Traceback (most recent call last):
        ...
        shapesafe_mha.ShapeError: scale_heads(): temperature has num_heads=2 (axis 0), but q set num_heads=6.
        ...

    Raises:
        ConfigError: at decoration, when nothing of `fn` has a shape annotation to check.
        ShapeError: at a call, when an argument, the result or an `expect` inside does not fit.
    """
    if isinstance(fn, classmethod | staticmethod):
        return type(fn)(shapecheck(fn.__func__))  # type: ignore[return-value]
    contract = _Checked(fn)
    verdicts, run, owner = contract.verdicts, contract.run, contract.owner
    method = contract.method
    coverable = not method  # a method's body reads `self`, which no caller's key holds (see `route`)
    key_of = contract.key if method else signature_key  # a method's key holds its sizes on self
    arity, unrolled, exact = contract.arity, UNROLLED.get(contract.arity), verdicts.exact

    def unchecked_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _trace._active:  # prove() or a trace: the call reports its annotated values instead
            return contract.report(args, kwargs)
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        # checks_enabled(), spelled out: this runs on every call (is_compiling folds to a constant under dynamo)
        if compiling():  # first: dynamo folds it to a constant and never traces the ContextVar
            return unchecked_call(args, kwargs)
        shared = mode.get()
        if shared is not None:
            shared = shared.answer[coverable]  # (`route`, spelled out: this runs on every call)
            if shared is OFF:
                return unchecked_call(args, kwargs)
            if shared is OWN:  # in a covering call: a method by its own verdict, outside it
                token = mode.set(None)
                try:
                    return checked(*args, **kwargs)
                finally:
                    mode.reset(token)
            if shared is not None:
                return run(shared, args, kwargs, True)  # in a shape_scope: checked in its dimensions, every time
        # our stages' key (`signature_key`, unrolled where every argument is a tensor): what the checks read
        if unrolled is not None and len(args) == arity:
            try:
                key = unrolled(args)
            except (AttributeError, TypeError):  # not tensors after all: the general key says why
                key = key_of(args, kwargs)
        else:
            key = key_of(args, kwargs)
        expects = exact.get(key)  # remembered: what the checked call checked inside, and returned
        if expects is False:
            return fn(*args, **kwargs)
        if type(expects) is _Covers:  # what it checked inside held for these shapes too: covered, unchecked
            token = mode.set(COVERED)
            try:
                result = fn(*args, **kwargs)
            except SHAPE_FAILURES as failure:  # explained as a fresh call would (the body runs again, checked)
                if isinstance(failure, torch.OutOfMemoryError):
                    raise
                mode.reset(token)
                token = None
                recheck(lambda: fresh(args, kwargs), failure)
                raise  # (recheck raises)
            finally:
                if token is not None:
                    mode.reset(token)
            returned = expects.result  # (a result no signature holds, a list: as the verdict found it, unseen)
            if returned is UNCACHEABLE or signature_of(result) == returned:
                return result
            # Another result for the same arguments' shapes: the body reads more than them (a value, a global's
            # shape), so no verdict of this function covers anything: each call is checked in full from now on.
            contract.remembers = False
            verdicts.forget()
            return fresh(args, kwargs)[1]
        if expects is not None:  # a method's: its expectations and result are compared
            return contract.remembered(expects, key, args, kwargs)
        widened = contract.widened
        covering = Covering()
        token = mode.set(covering)
        try:
            session, result = fresh(args, kwargs)
        finally:
            mode.reset(token)
        if not contract.remembers:
            return result
        if method:
            if widened == contract.widened:  # else `key` lacks a size on self that an expectation bound
                verdicts.remember(key, note=(signature_of(result), tuple(getattr(session, "signatures", ()))))
        elif covering.used or getattr(session, "expectations", 0) > 0:  # it covers what it checked inside
            verdicts.remember(key, note=_Covers(signature_of(result)))
        else:
            verdicts.remember(key, note=False)
        return result

    def fresh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Session, Any]:
        with Session(owner) as session:
            return session, run(session, args, kwargs)

    checked.__shapecheck__ = contract  # type: ignore[attr-defined]
    return checked


def expect(tensor: torch.Tensor, shape: Any, name: str | None = None) -> torch.Tensor:
    """Check `tensor` against `shape` inside a function, and return it: `ssm.expect(q @ k.mT, "batch seq kv_seq")`.

    `shape` is a string of dimension names or a jaxtyping annotation. Inside a `shapecheck`ed call (or a
    `shape_scope`) it binds into that call's dimensions: it must agree with the arguments, and binds
    new names for what follows; outside one it checks alone.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> ssm.expect(torch.zeros(2, 8, 5, 5), "batch num_heads seq kv_seq").shape
        torch.Size([2, 8, 5, 5])

    Raises:
        ShapeError: `tensor` does not fit; the message names the enclosing function and the expectation
            (`name`, or its position among the call's expectations).
    """
    if torch.compiler.is_compiling() or not checks_enabled():  # the first folds to a constant under dynamo
        reporting = _current.get() if _trace._active else None
        if isinstance(reporting, _Reporting):  # under prove(): reported, to be checked symbolically
            reporting.expectations += 1
            hint = _hint_of(shape)
            reporting.add(name or f"expectation {reporting.expectations}", tensor, hint)
        return tensor
    shared = mode.get()
    if shared is not None and shared.answer[True] is OFF:  # in a remembered call (`route`): it held for these shapes
        return tensor
    session = _current.get()
    hint = _hint_of(shape)
    if type(session) is _Replay:
        session.expect(tensor, hint, name)
        return tensor
    if session is None:
        key = (id(hint), *signature_key((tensor,), {}))
        if hint in _alone and key in _alone[hint]:
            return tensor
        with Session("expect()") as alone:
            _expect_in(alone, tensor, hint, name, None)
        _alone.setdefault(hint, set()).add(key)
        if len(_alone[hint]) > 4096:
            _alone[hint].clear()
        return tensor
    _expect_in(session, tensor, hint, name, _binding.get())
    return tensor


_alone: dict[Any, set[Any]] = {}  # verdicts of expectations checked outside any call


def _hint_of(shape: Any) -> Any:
    """`expect`'s `shape` as an annotation: a string's (cached), or a type or typing form as given."""
    if isinstance(shape, str):
        try:
            return _shape_hint(shape)
        except Exception as failure:  # jaxtyping refuses the string itself (two variadic names, ...)
            raise ConfigError(f"expect(): shape={shape!r} is not a jaxtyping shape string: {failure}") from None
    if isinstance(shape, type) or typing.get_origin(shape) is not None:
        return shape
    raise ConfigError(
        'expect(): shape must be a string of dimension names ("batch seq d_model") or a jaxtyping annotation '
        f'(Float[Tensor, "batch seq d_model"]), but got {shape!r}.'
    )


def _expect_in(session: Session, tensor: Any, hint: Any, name: str | None, binding: Any) -> None:
    """One expectation checked in `session`; `binding`: the enclosing checked call's (contract, bound arguments)."""
    if binding is not None:
        contract, bound = binding
        contract.expecting(session, bound, hint)
    count = getattr(session, "expectations", 0) + 1
    session.expectations = count  # type: ignore[attr-defined]
    label = name or f"expectation {count}"
    failure = fits(session, label, tensor, hint, label + session.where)
    if failure is not None:
        raise session.fail(failure) from None
    if count == 1:
        session.signatures = []  # type: ignore[attr-defined]
    session.signatures.append((label, signature_of(tensor)))  # type: ignore[attr-defined]  (for `_Replay`)


class _Covers:
    """A function's remembered verdict that covers what its checked call checked inside (expectations, our public
    stages, decorated functions): those run unchecked (`COVERED`) and the result's signature is compared with
    the checked call's."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


class _Replay:
    """A remembered method's call in progress (`_Checked.remembered`): its expectations compared, in order, with
    its checked call's, and checked from the first that differs on, in a session of the call's own."""

    __slots__ = ("args", "binding", "contract", "expected", "kwargs", "seen", "session", "signatures", "stack")

    def __init__(self, contract: _Checked, args: tuple[Any, ...], kwargs: dict[str, Any], expected: Any) -> None:
        self.contract, self.args, self.kwargs, self.expected = contract, args, kwargs, expected
        self.seen: list[tuple[Any, Any, str | None]] = []
        self.signatures: list[tuple[str, Any]] = []
        self.session: Session | None = None
        self.binding: Any = None  # (contract, bound arguments), once begun
        self.stack: contextlib.ExitStack | None = None  # the session's, once begun

    def expect(self, tensor: Any, hint: Any, name: str | None) -> None:
        index = len(self.seen)
        signature = (name or f"expectation {index + 1}", signature_of(tensor))
        session = self.session
        if session is None:
            if index < len(self.expected) and self.expected[index] == signature and signature[1] is not UNCACHEABLE:
                self.seen.append((tensor, hint, name))
                self.signatures.append(signature)
                return
            session = self.begin()
        self.seen.append((tensor, hint, name))
        _expect_in(session, tensor, hint, name, self.binding)
        self.signatures = list(session.signatures)  # type: ignore[attr-defined]

    def begin(self) -> Session:
        """Check the call as a fresh one would have up to here: its arguments, then the expectations so far."""
        owner = self.contract.owner
        self.stack = stack = contextlib.ExitStack()
        session = stack.enter_context(Session(owner))
        stack.enter_context(session.calling(owner, False))
        self.session = session
        self.binding = (self.contract, self.contract.fit_arguments(session, self.args, self.kwargs))
        for tensor, hint, name in self.seen:
            _expect_in(session, tensor, hint, name, self.binding)
        return session

    def end(self, failure: BaseException | None) -> None:
        """Close the call's session, if one was begun (as its `with` would, with the call's failure)."""
        if self.stack is None:
            return
        if failure is None:
            self.stack.close()
        else:
            self.stack.__exit__(type(failure), failure, failure.__traceback__)


@contextlib.contextmanager
def shape_scope(**sizes: int) -> Iterator[None]:
    """Share one set of dimensions among every `shapecheck`ed call and `expect` inside, seeded with `sizes`.

    Outside a scope each decorated call has its own dimensions (a helper's `seq` may be its caller's
    `kv_seq`); inside one, a dimension bound anywhere holds everywhere, as our stages share one
    within a forward. Our public stages (`split_heads`, `scaled_dot_product_attention`, ...) called
    inside a scope join it too. Calls in a scope are always checked in full.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> with ssm.shape_scope(num_heads=8):
        ...     ssm.split_heads(torch.zeros(2, 5, 64), 8).shape
        torch.Size([2, 8, 5, 8])

    Raises:
        ConfigError: a size is not a non-negative int.
    """
    for dim, size in sizes.items():
        if not _is_size(size):
            raise ConfigError(f"shape_scope(): {dim} must be a non-negative int, but got {size!r}.")
    if not checks_enabled():
        yield
        return
    with Session("shape_scope()") as session:
        _seed(session, {d: (s, "shape_scope") for d, s in sizes.items()}, "shape_scope()")
        tokens = mode.set(session), _current.set(session)
        try:
            yield
        finally:
            _current.reset(tokens[1])
            mode.reset(tokens[0])
