"""The contract machinery: stages annotated with named shapes, checked by jaxtyping+beartype.

A *stage* is a function whose signature carries its jaxtyping annotations, result included. A
*session* runs stages against one jaxtyping memo (`jaxtyped("context")`), so a dimension bound by
one stage must hold at every later one: `num_heads` bound at the query split holds at the mask and
at attention. Each stage reports its result once, to the session, which checks it and passes it
on to an observer (the trace). jaxtyping+beartype decide every check; `messages` only explains.

Checking costs microseconds, so verdicts are remembered: a public stage remembers the exact
signatures it accepted; `MultiHeadAttention` remembers whole forwards by the relations between
their sizes (see `relational`). A call whose verdict is not known is always checked in full.
"""

import contextlib
import contextvars
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Generic, ParamSpec, TypeVar

import torch
from jaxtyping import jaxtyped

from .errors import ConfigError
from .messages import ExplainedError, Memo, bearable, bind, explain, named_shape_of, not_dense, shape_error

P = ParamSpec("P")
R = TypeVar("R")

ENV_VAR = "SHAPESAFE_MHA_UNCHECKED"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_switch(value: str) -> bool:
    """Whether `SHAPESAFE_MHA_UNCHECKED=value` turns the checks off.

    Raises:
        ConfigError: `value` is none of 1/true/yes/on or 0/false/no/off/empty (any case).
    """
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(
        f"{ENV_VAR}={value!r} is not a switch: use 1, true, yes or on to turn the checks off, "
        "or 0, false, no, off or nothing to keep them."
    )


OFF_BY_ENV = parse_switch(os.environ.get(ENV_VAR, ""))


class _Mode:
    """A constant value of `mode`, with the one dispatcher's answers under it (see `route`)."""

    __slots__ = ("answer", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.answer: tuple[Any, Any] = (None, None)

    def __repr__(self) -> str:
        return self.name


OFF = _Mode("OFF")
COVERED = _Mode("COVERED")
OWN = _Mode("OWN")


class Covering:
    """The mode while a decorated function's call is checked for the first time: the public stages and decorated
    functions called inside it check themselves, as anywhere, and mark `used`, so the call's verdict, once
    remembered, says that it covers them (`COVERED`)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = False

    @property
    def answer(self) -> "Covering":
        return self

    def __getitem__(self, coverable: bool) -> None:
        if coverable:
            self.used = True


# The one dispatcher: what a checked call made while `mode` is set does, for every checked callable (our stages,
# users' decorated functions and methods, `expect`, the modules' forwards), is `route(mode.get(), coverable)`.
# `coverable`: whether the callable's verdict depends on its arguments' shapes only, so that a remembered call
# whose key held them covers it (a plain stage, a decorated function, an expectation); not so a method (its body
# reads `self`), a stage with a plan (its remembered plan costs less than its function), a module (its parameters).
# The answer is one of:
# - OFF: run the plain function, unchecked;
# - OWN: checked by the callable's own verdicts, outside the covering call;
# - None: checked by its own verdicts;
# - a `Session`: checked in that `shape_scope`'s dimensions (a module's forward keeps a session of its own).
# Each value of `mode` holds its answers, indexed by `coverable` (callers index them inline: `route`, spelled out):
OFF.answer = (OFF, OFF)  # inside `unchecked()`, or everywhere under SHAPESAFE_MHA_UNCHECKED
COVERED.answer = (OWN, OFF)  # inside a remembered call whose verdict covers what it calls
# a `Covering`: None, and a coverable call marks it as covering what it calls; a `Session` (`Session.answer`): itself


def route(shared: Any, coverable: bool) -> Any:
    """What a checked call does under `shared`, a value of `mode` other than None (see the table above)."""
    return shared.answer[coverable]


# What the checks do now, in one context variable (a remembered call reads one): None, the usual; OFF inside
# `unchecked()` (or everywhere, under SHAPESAFE_MHA_UNCHECKED); the session of an open `shape_scope`, which our
# public stages and users' decorated calls inside it share; a `Covering` while a decorated function's call is
# checked; or COVERED inside a decorated function's call whose verdict is remembered: the stages, decorated
# functions and expectations inside it held for these arguments' shapes, and run unchecked (one key, not nine).
mode: contextvars.ContextVar[Any] = contextvars.ContextVar("shapesafe_mha_mode", default=OFF if OFF_BY_ENV else None)

MAX_VERDICTS = 4096


def checks_enabled() -> bool:
    """Whether runtime checks run now (see `unchecked`).

    Example:
        >>> import shapesafe_mha as ssm
        >>> with ssm.unchecked():
        ...     print(ssm.checks_enabled())
        False
    """
    # is_compiling first: dynamo folds it to a constant and never traces the ContextVar. (A call that is never
    # covered, such as a module's or the Hugging Face backend's, is checked unless `route` says OFF.)
    if torch.compiler.is_compiling():
        return False
    shared = mode.get()
    return shared is None or route(shared, False) is not OFF


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Turn shapesafe_mha's runtime checks off inside a `with` block.

    The switch is a context variable: it holds for this thread (or asyncio task) only, and a
    generator that is suspended inside the block keeps it off when resumed elsewhere.
    `SHAPESAFE_MHA_UNCHECKED=1` (or true/yes/on) in the environment before import turns the
    checks off for the whole process.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> with ssm.unchecked():
        ...     print(ssm.split_heads(torch.zeros(1, 3, 8), 2).shape)
        torch.Size([1, 2, 3, 4])
    """
    token = mode.set(OFF)
    try:
        yield
    finally:
        mode.reset(token)


class Verdicts:
    """Calls known to pass their checks: the one memo of stages, modules and users' decorated functions.

    A call is known by its exact key (what the check read, exactly: one hash) or, where a caller can
    abstract it soundly, by its relations key (sizes replaced by how they relate, see `relational`),
    asked for only when the exact key misses. At most `MAX_VERDICTS` of each, then forgotten at once.
    """

    __slots__ = ("exact", "relations")

    def __init__(self) -> None:
        self.exact: dict[Any, Any] = {}
        self.relations: dict[Any, Any] = {}

    def known(self, exact: Any, relations: Callable[[], Any] | None = None) -> bool:
        if exact in self.exact:
            return True
        if relations is not None and relations() in self.relations:
            _add(self.exact, exact)
            return True
        return False

    def remember(self, exact: Any, relations: Any = None, note: Any = True) -> None:
        """Remember `exact` (and `relations`); `note` is what `exact[key]` holds (a caller's detail of the call)."""
        if _UNCACHEABLE in exact if isinstance(exact, tuple) else exact is _UNCACHEABLE:
            return  # a value whose check cannot be keyed: every such call is checked in full
        _add(self.exact, exact, note)
        if relations is not None:
            _add(self.relations, relations)

    def forget(self) -> None:
        self.exact.clear()
        self.relations.clear()


def _add(memo: dict[Any, Any], key: Any, note: Any = True) -> None:
    if len(memo) >= MAX_VERDICTS:
        memo.clear()
    memo[key] = note


Precheck = Callable[[dict[str, Any]], None]
Validate = Callable[[dict[str, Any], dict[str, int]], None]
Explain = Callable[[dict[str, Any], ExplainedError], str | None]
Observer = Callable[[str, str, torch.Tensor], None]
Plan = Callable[[dict[str, Any]], Callable[..., Any] | None]


class Stage(Generic[P, R]):
    """A function whose annotations are its contract. Calling it checks the call (see `stage`)."""

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str,
        public: tuple[str, ...],
        trace: tuple[str, ...],
        sources: dict[str, str],
        precheck: Precheck | None,
        validate: Validate | None,
        explain: Explain | None,
        raw: Callable[..., Any] | None = None,
        plan: Plan | None = None,
    ) -> None:
        hints = typing.get_type_hints(fn, include_extras=True)
        self.returns = hints.pop("return", None)
        self.hints = hints
        self.signature = inspect.signature(fn)
        self.fn = fn
        self.raw: Callable[..., Any] = fn if raw is None else raw  # what a remembered forward calls (see `stage`)
        self.name = name
        self.public = public
        self.trace = trace
        self.sources = sources
        self.precheck, self.validate, self.explain = precheck, validate, explain
        self.plan = plan
        self.coverable = plan is None  # (see `route`: a stage with a plan runs its remembered plan, keyed)
        self.verdicts = Verdicts()
        self.exact = self.verdicts.exact  # key -> what a remembered call runs (Verdicts.forget clears it in place)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Called on its own (a public stage): checked on first sight of each exact signature."""
        if compiling():  # checks_enabled(), spelled out: this runs on every call
            return self.fn(*args, **kwargs)
        shared = mode.get()
        if shared is not None:
            shared = shared.answer[self.coverable]  # (`route`, spelled out: this runs on every call)
            if shared is OFF:
                return self.fn(*args, **kwargs) if kwargs else self.raw(*args)
            if shared is not None and shared is not OWN:
                with shared.calling(f"{self.name}()"):  # inside a shape_scope: checked in its dimensions, every time
                    return shared.call(self, *args, **kwargs)
        key = signature_key(args, kwargs)
        run = self.exact.get(key)  # Verdicts.known, inlined: a stage has no relations key
        if run is not None:
            try:
                return run(*args, **kwargs)
            except SHAPE_FAILURES as failure:  # what the key does not hold (a sparse tensor's layout): explained
                if isinstance(failure, torch.OutOfMemoryError):
                    raise
                recheck(lambda: self.checked(args, kwargs), failure)
        result = self.checked(args, kwargs)
        self.verdicts.remember(key, note=self.remembered_call(args, kwargs))
        return result

    def checked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call checked in a session of its own (a fresh call's)."""
        with Session(f"{self.name}()") as session:
            return session.call(self, *args, **kwargs)

    def remembered_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        """What a call of this exact signature runs once its checks passed: `plan(arguments)` where the stage
        has one and it applies, else `fn` (`raw`, the same computation in one frame fewer, where all arguments
        are positional). A plan may decide from anything the key holds: shapes, dtypes, devices, flags."""
        if self.plan is not None:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            planned = self.plan(dict(bound.arguments))
            if planned is not None:
                return planned
        return self.fn if kwargs else self.raw

    def result_names(self) -> list[tuple[str, Any]]:
        """(trace name, annotation) of each tensor the stage returns."""
        returns = self.returns
        parts = list(typing.get_args(returns)) if typing.get_origin(returns) is tuple else [returns]
        names = self.trace or (self.name,)
        return list(zip(names, parts, strict=False))


def stage(
    *,
    name: str | None = None,
    public: tuple[str, ...] = (),
    trace: tuple[str, ...] = (),
    sources: dict[str, str] | None = None,
    precheck: Precheck | None = None,
    validate: Validate | None = None,
    explain: Explain | None = None,
    raw: Callable[..., Any] | None = None,
    plan: Plan | None = None,
) -> Callable[[Callable[P, R]], Stage[P, R]]:
    """Make `fn` a stage: its annotations, arguments and result, are checked by jaxtyping+beartype.

    `precheck(arguments)` runs before the annotations (dtypes and devices, which need no
    dimensions); `validate(arguments, dims)` after them, for what an annotation cannot say
    (divisibility, a cache's capacity); both raise `mismatch(...)`. `explain(arguments, failure)`
    may return the usual fix, appended to the message. `public` names the arguments a user passed
    as they are (messages name them plainly); `trace` names the results for the trace; `sources`
    names who set a dimension this stage binds (`{"kv_seq": "the cache plus key"}`). `raw`: where `fn`'s body is
    only `return raw(<fn's arguments, in order>)`, the function a remembered forward calls instead of `fn`
    (one frame fewer; `tests/test_contract.py` shows each such body is that call). `plan(arguments)`: what a
    remembered call with these arguments runs instead of `fn`, or None (see `Stage.remembered_call`).
    """

    def decorate(fn: Callable[P, R]) -> Stage[P, R]:
        return Stage(
            fn,
            name=name or fn.__name__,
            public=public,
            trace=trace,
            sources=sources or {},
            precheck=precheck,
            validate=validate,
            explain=explain,
            raw=raw,
            plan=plan,
        )

    return decorate


_ONE = torch.empty((), device="meta")  # made at import: a trace never sees it allocated


@functools.lru_cache(maxsize=64)
def witness(sizes: tuple[int, ...]) -> torch.Tensor:
    """A `meta` tensor whose shape is a module's sizes, for `Session.seed`: binds them before any argument.

    One element broadcast to that shape, so it costs nothing anywhere (no allocation to record).
    """
    return _ONE.expand(sizes)


class Session:
    """Stages run against one jaxtyping memo, checked (if `check`) and reported to `observer`."""

    def __init__(self, owner: str, *, check: bool = True, observer: Observer | None = None) -> None:
        self.owner = owner
        self.check = check
        self.observer = observer
        self.memo: Memo = {}
        self.called_with: list[tuple[str, Any, Any]] = []
        self.where = ""  # in a shared session, which call bound a dimension: " (in split_heads())"
        self._context: Any = None

    @property
    def answer(self) -> tuple["Session", "Session"]:
        """The dispatcher's answer inside the `shape_scope` this session is (see `route`): checked in it."""
        return self, self

    def __enter__(self) -> "Session":
        if self.check:
            self._context = jaxtyped("context")  # pyright: ignore[reportCallIssue,reportArgumentType]
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)

    @contextlib.contextmanager
    def calling(self, owner: str, shared: bool = True) -> Iterator[None]:
        """One call checked in this session: messages name `owner` and list only its arguments; in a session
        shared by several calls (a `shape_scope`), what a call binds is said to come from it."""
        saved = self.owner, self.called_with, self.where
        self.owner, self.called_with, self.where = owner, [], f" (in {owner})" if shared else ""
        try:
            yield
        finally:
            self.owner, self.called_with, self.where = saved

    def stages(self, **stages: Stage[..., Any]) -> SimpleNamespace:
        """The stages as plain callables that run in this session."""
        return SimpleNamespace(**{n: functools.partial(self.call, s) for n, s in stages.items()})

    def seed(self, hint: Any, witness: torch.Tensor, source: str) -> None:
        """Bind dimensions known before any argument (a module's sizes) from a `meta` witness tensor."""
        failure = self.fits("witness", witness, hint, source)
        if failure is not None:
            raise self.fail(failure)

    def fits(self, label: str, value: Any, hint: Any, source: str) -> ExplainedError | None:
        """Check one value against its annotation in this session's memo: None, or why it fails."""
        if hint is None or not self.check:  # only observing: nothing to bind (sizes may be symbolic)
            return None
        if isinstance(value, torch.Tensor) and (value.is_nested or value.layout is not torch.strided):
            return not_dense(label, value)
        if not bearable(value, hint):
            return explain(label, value, hint, self.memo) or ExplainedError(
                f"{label} does not satisfy its annotation {hint}.", arg=label
            )
        bind(label, value, hint, self.memo, source)
        return None

    def fail(self, failure: ExplainedError, where: str = "", fix: str | None = None) -> Exception:
        sentence = f"{where}{failure.sentence}" + (f" {fix}" if fix else "")
        return shape_error(self.owner, sentence, self.called_with, self.memo)

    def call(self, stage: Stage[..., R], *args: Any, **kwargs: Any) -> R:
        """Run `stage` in this session: arguments checked, then the stage, then its result."""
        if self.check:
            self.check_arguments(stage, args, kwargs)
        result = stage.fn(*args, **kwargs)
        if self.check or self.observer is not None:
            self.report(stage, result)
        return result

    def check_arguments(
        self, stage: Stage[..., Any], args: Any, kwargs: Any, hints: dict[str, Any] | None = None
    ) -> None:
        """Check a call's arguments against the stage's annotations (or `hints`, where given)."""
        try:
            bound = stage.signature.bind(*args, **kwargs)
        except TypeError as failure:
            raise TypeError(f"{self.owner}: {failure}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        hints = stage.hints if hints is None else hints
        top_level = not self.called_with
        if top_level:
            self.called_with = [(n, v, hints.get(n)) for n, v in arguments.items()]
        try:
            if stage.precheck is not None:
                stage.precheck(arguments)
            for name, value in arguments.items():
                plain = top_level or name in stage.public
                source = stage.sources.get(name, name if plain else stage.name) + self.where
                failure = self.fits(name, value, hints.get(name), source)
                if failure is not None:
                    raise failure
            if stage.validate is not None:
                stage.validate(arguments, {k: b.size for k, b in self.memo.items()})
        except ExplainedError as failure:
            fix = stage.explain(arguments, failure) if stage.explain is not None else None
            plain = top_level or failure.arg is None or failure.arg in stage.public
            raise self.fail(failure, "" if plain else f"at {stage.name}, ", fix) from None
        except ConfigError as failure:
            raise ConfigError(f"{self.owner}: {failure}") from None

    def report(self, stage: Stage[..., Any], result: Any) -> None:
        values = result if isinstance(result, tuple) else (result,)
        for (trace_name, hint), value in zip(stage.result_names(), values, strict=False):
            failure = self.fits("the result", value, hint, stage.sources.get("result", stage.name))
            if failure is not None:
                raise self.fail(failure, f"{stage.name} returned a wrong value: ")
            if self.observer is not None and trace_name and isinstance(value, torch.Tensor):
                self.observer(trace_name, named_shape_of(hint, value), value)


# What torch raises for a shape, dtype or device that does not fit: only these are run again checked to be
# explained (`recheck`). Anything else passes through as raised: a hook's own error, and the exceptions torch
# uses for control flow, such as the one non-reentrant activation checkpointing stops its recomputation with.
SHAPE_FAILURES = (RuntimeError, ValueError, IndexError, TypeError)


def recheck(checked: Callable[[], Any], failure: BaseException) -> None:
    """A call whose verdict was remembered failed unchecked: run it `checked()` to explain it, as a fresh
    module would (something it depends on changed that its key did not hold, such as a parameter
    replaced by one of another shape or dtype). Raises the checked failure, else `failure` itself."""
    from .errors import ShapesafeError

    try:
        checked()
    except ShapesafeError as explained:
        raise explained from None
    raise failure


def raw(**stages: Stage[..., Any]) -> SimpleNamespace:
    """The stages' functions themselves: what a forward runs once its verdict is known."""
    return SimpleNamespace(**{n: s.raw for n, s in stages.items()})


# --- verdicts ------------------------------------------------------------------------------------------


class _Uncacheable:
    """Marks an argument whose verdict cannot be remembered (it is always checked in full)."""


_UNCACHEABLE = _Uncacheable
UNCACHEABLE = _UNCACHEABLE  # what `signature_of` gives a value nothing can stand for


class _Keywords:
    """Marks where a key's keyword arguments begin (no value's signature is a class: `signature_of` one is
    uncacheable), so `f(x, weight=w)` and `f(x, "weight", w)` are two keys."""


KEYWORDS = _Keywords
_ITSELF = frozenset({int, str, type(None), torch.dtype, torch.device})  # hashable, no two kinds collide


def signature_of(value: Any) -> Any:
    """What a check depends on: a tensor's type, shape, dtype and device; a plain value with its type."""
    if isinstance(value, torch.Tensor):  # the common case first: this runs on every remembered call
        return (type(value), value.shape, value.dtype, value.device)
    kind = type(value)
    if kind in _ITSELF:
        return value
    if kind is bool or kind is float:
        return (kind, value)  # True == 1 == 1.0 would collide with the int
    if kind is tuple:
        parts = tuple(signature_of(v) for v in value)
        return _UNCACHEABLE if _UNCACHEABLE in parts else (kind, parts)  # seen by `remember`, not hidden inside
    return _UNCACHEABLE


def signature_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The exact signature of a call, keyword names included: `signature_of` each value, a tensor's four
    parts inlined into one flat tuple. The one key of our stages' calls and of users' decorated functions and
    methods (a method's with its sizes on `self` before it): what their checks read (an annotation reads a
    tensor's type, shape and dtype; a stage's precheck its device too) and no more. Flat is unambiguous:
    only a tensor gives a `torch.Size`, and a tensor always gives one (`signature_of` a Size is uncacheable);
    the keywords follow `KEYWORDS`, so a keyword's name is never a text argument in its place. (This runs on
    every remembered call: the usual stage calls, of one or two tensors or a tensor and a head count, are unrolled;
    `UNROLLED` holds it, less the devices, for one to six tensors, for callers that know the count before the
    call and whose checks read no device.)"""
    if not kwargs:
        count = len(args)
        if count == 2:
            first, second = args
            if isinstance(first, _Tensor):
                if type(second) is int:
                    return (type(first), first.shape, first.dtype, first.device, second)
                if isinstance(second, _Tensor):
                    return (
                        type(first), first.shape, first.dtype, first.device,
                        type(second), second.shape, second.dtype, second.device,
                    )  # fmt: skip
        elif count == 1:
            first = args[0]
            if isinstance(first, _Tensor):
                return (type(first), first.shape, first.dtype, first.device)
    key: list[Any] = []
    for value in args:
        if isinstance(value, _Tensor):
            key += (type(value), value.shape, value.dtype, value.device)
        elif type(value) is int:  # signature_of(value), without its call: a head count is the other common case
            key.append(value)
        else:
            key.append(signature_of(value))
    if kwargs:
        key.append(KEYWORDS)
        for name, value in kwargs.items():
            key.append(name)
            if isinstance(value, _Tensor):
                key += (type(value), value.shape, value.dtype, value.device)
            elif type(value) is bool:  # signature_of(value), without its call: a flag is the usual keyword
                key.append((bool, value))
            else:
                key.append(signature_of(value))
    return tuple(key)


def _key1(args: tuple[Any, ...]) -> tuple[Any, ...]:
    (a,) = args
    return (type(a), a.shape, a.dtype)


def _key2(args: tuple[Any, ...]) -> tuple[Any, ...]:
    a, b = args
    return (type(a), a.shape, a.dtype, type(b), b.shape, b.dtype)


def _key3(args: tuple[Any, ...]) -> tuple[Any, ...]:
    a, b, c = args
    return (type(a), a.shape, a.dtype, type(b), b.shape, b.dtype, type(c), c.shape, c.dtype)


def _key4(args: tuple[Any, ...]) -> tuple[Any, ...]:
    a, b, c, d = args
    return (type(a), a.shape, a.dtype, type(b), b.shape, b.dtype, type(c), c.shape, c.dtype, type(d), d.shape, d.dtype)


def _key5(args: tuple[Any, ...]) -> tuple[Any, ...]:
    a, b, c, d, e = args
    return (
        type(a), a.shape, a.dtype, type(b), b.shape, b.dtype, type(c), c.shape, c.dtype,
        type(d), d.shape, d.dtype, type(e), e.shape, e.dtype,
    )  # fmt: skip


def _key6(args: tuple[Any, ...]) -> tuple[Any, ...]:
    a, b, c, d, e, f = args
    return (
        type(a), a.shape, a.dtype, type(b), b.shape, b.dtype, type(c), c.shape, c.dtype,
        type(d), d.shape, d.dtype, type(e), e.shape, e.dtype, type(f), f.shape, f.dtype,
    )  # fmt: skip


# `signature_key(args, {})` of 1-6 tensors, unrolled, less each tensor's device: what a jaxtyping annotation reads
# (its type, shape and dtype; `.device` makes a new object each read, whose hash and compare cost more than the rest:
# 1.4% of a user's layer in `benchmarks.user_code`), for a caller whose checks read no device, a decorated function
# whose every parameter is annotated `X[Tensor, ...]` (tests/test_verdicts.py draws calls and compares with the key's
# definition). A call of anything else raises AttributeError, and is keyed by `signature_key`, device and all.
UNROLLED = {1: _key1, 2: _key2, 3: _key3, 4: _key4, 5: _key5, 6: _key6}  # (a layer's x and its weights)

_Tensor = torch.Tensor
compiling = torch.compiler.is_compiling  # dynamo folds it to a constant, by identity


def relational(sizes: tuple[int, ...], constants: frozenset[int]) -> tuple[int, ...]:
    """Sizes abstracted to what a shape check can see of them.

    A check compares sizes with each other, with the module's constants and with 0 and 1 (to
    broadcast), and nothing else. So a size that is 0, 1 or a constant is kept; any other is
    replaced by the index of its first occurrence (negated). Two calls with the same result agree
    on every equality a check can test, so they pass or fail together: `kv_seq` growing by one a
    decoding step keeps the key.
    """
    first: dict[int, int] = {}
    return tuple(s if s < 2 or s in constants else -1 - first.setdefault(s, len(first)) for s in sizes)


class CallKey(typing.NamedTuple):
    """What a module's verdict for one call depends on: its structure (kinds, dtypes, devices, flags,
    submodules), the shapes of its tensors, and `kv_seq` where a mask is checked against it."""

    structure: tuple[Any, ...]
    shapes: tuple[Any, ...]
    kv_seq: int | None

    def relations(self, constants: frozenset[int]) -> Any:
        """The key with sizes replaced by their relations (`relational`): covers decoding step after step."""
        sizes = [size for shape in self.shapes if shape is not None for size in shape]
        if self.kv_seq is not None:
            sizes.append(self.kv_seq)
        ranks = tuple(None if shape is None else len(shape) for shape in self.shapes)
        return self.structure, ranks, self.kv_seq is None, relational(tuple(sizes), constants)


def remembered_forward(
    verdicts: Verdicts,
    constants: frozenset[int],
    key: Callable[[], CallKey | None],
    cache: Any,
    run: Callable[[], R],
    checked: Callable[[bool, Any], R],
    observer: Any,
    compiling: bool,
) -> R:
    """A module's forward under its remembered verdicts (`MultiHeadAttention` and `LatentAttention` both).

    `cache` is the call's cache (with `state()` and `restore(state)`) or None; `compiling`: whether dynamo traces it
    (`torch.compiler.is_compiling()`, asked once by the caller: no check then).

    A call whose key (exact, or by relations) is known runs `run()` unchecked; any other runs `checked(check,
    observer)`, every stage checked, and is remembered if it passes. An unchecked call that fails is run again
    checked to explain it (`recheck`); a call that fails leaves `cache` as it was.
    """
    # checks_enabled(), spelled out: this runs on every call (a module is never covered: see `route`)
    check = not compiling and ((shared := mode.get()) is None or shared.answer[False] is not OFF)
    keys = None
    if check and observer is None:
        try:
            found = keys = key()
            known = found is not None and (
                found in verdicts.exact or verdicts.known(found, lambda: found.relations(constants))
            )
        except (AttributeError, TypeError, IndexError):  # not tensors, or a value no key can hold (a list): checked
            keys, known = None, False
        if known:
            check = False  # (the exact lookup first, inlined: a decoding step's key is exact after the first)
    state = None if cache is None else cache.state()
    try:
        if not check and observer is None:
            try:
                return run()
            except SHAPE_FAILURES as failure:
                if keys is None or isinstance(failure, torch.OutOfMemoryError):  # torch's error as it is
                    raise
                if state is not None and cache is not None:
                    cache.restore(state)
                recheck(lambda: checked(True, None), failure)
        result = checked(check, observer)
    except BaseException:
        if state is not None and cache is not None:
            cache.restore(state)  # a failed call changes nothing
        raise
    if check and keys is not None:
        verdicts.remember(keys, keys.relations(constants))
    return result
