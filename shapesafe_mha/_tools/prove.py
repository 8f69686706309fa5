"""`prove`: every stage's named shape, proven for all batch and sequence sizes in a range.

torch does the symbolic work: `torch.export` runs the module on fake tensors whose batch and
sequence sizes are symbols with the given ranges, and fails if the code specializes on them (a
branch on the size, a view with a hard-coded length). Our module's stages report themselves while
it runs, so each stage's jaxtyping annotation is checked against its symbolic shape: "split_q is
`batch num_heads seq d_head` = `(s0, 8, s1, 8)` for all s0, s1". The sizes export specializes
(1, and 0 where the range includes it) are proven concretely, on `meta` tensors.
"""

import contextlib
import inspect
import io
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.export import Dim, export

from .._core import trace as _trace
from .._core.contract import Verdicts
from .._core.errors import ConfigError


@dataclass
class ShapeProof:
    """The outcome of `prove`: `ok`, readable `failures`, and `(stage, named shape, symbolic shape)` rows."""

    ok: bool
    failures: list[str]
    stages: list[tuple[str, str, str]] = field(default_factory=list)
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    symbols: dict[str, str] = field(default_factory=dict)
    """Each size proven symbolically, by name, and torch's symbol for it (`{"batch": "s5", "seq": "s83"}`),
    the one its guards and errors print. The stages' shapes use the names: `(batch, 8, seq, 8)`. Decoding's
    symbol counts the cache's positions and the one being written: `{"batch": "s5", "cached + 1": "s83"}`."""
    decode: bool = False
    """One decoding step (seq 1) against a cache of `ranges["cached"]` positions."""

    def table(self) -> Table:
        ranges = ", ".join(f"{n} in [{lo}, {hi}]" for n, (lo, hi) in self.ranges.items())
        if self.decode:
            ranges += ", seq = 1 (one decoding step)"
        legend = ", ".join(f"{name} is torch's {symbol}" for name, symbol in self.symbols.items())
        table = Table(title=f"{'proven' if self.ok else 'NOT proven'} for {ranges}", caption=legend or None)
        for column in ("stage", "named shape", "symbolic shape"):
            table.add_column(column, overflow="fold")  # wrapped at any width, never cut
        for row in self.stages:
            table.add_row(*row)
        return table

    def __str__(self) -> str:
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(self.table())
        for failure in self.failures:
            console.print(failure, highlight=False)
        return console.export_text()


Seen = tuple[str, str, torch.Tensor, Any, dict[str, int] | None]  # name, named shape, tensor, group, seed


class _Observer:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.spans: list[tuple[str, int, int]] = []  # a user's decorated call, and the guards made during it

    def guarded(self, owner: str, before: int, after: int) -> None:
        self.spans.append((owner, before, after))

    def guarding_calls(self) -> list[str]:
        """The innermost decorated call in which each guard was made: where a size-specific branch is."""
        owners: list[str] = []
        for guard in sorted({g for _, lo, hi in self.spans for g in range(lo, hi)}):
            owner = min((s for s in self.spans if s[1] <= guard < s[2]), key=lambda s: s[2] - s[1])[0]
            if owner not in owners:
                owners.append(owner)
        return owners

    def add(
        self, name: str, named_shape: str, tensor: torch.Tensor, group: Any = None, seed: dict[str, int] | None = None
    ) -> None:
        self.seen.append((name, named_shape, tensor, group, seed))


@contextlib.contextmanager
def _observing() -> Iterator[_Observer]:
    observer = _Observer()
    _trace._active.append(observer)  # pyright: ignore[reportArgumentType]  (an observer, not a Tracer)
    try:
        yield observer
    finally:
        _trace._active.remove(observer)  # pyright: ignore[reportArgumentType]


def _expr(size: Any, rename: dict[str, Any] | None = None) -> Any:
    """A size as a sympy expression (a symbol for a symbolic size), torch's symbols named in `rename` replaced."""
    if not isinstance(size, torch.SymInt):
        return sympy.Integer(int(size))
    expr = size.node.expr
    if rename:
        expr = expr.xreplace({s: rename[s.name] for s in expr.free_symbols if s.name in rename})
    return expr


def _readable(guard: str, names: dict[str, str]) -> str:
    for source, name in names.items():
        guard = guard.replace(source, name)
    return guard


def _explain_export_failure(
    error: Exception | None, names: dict[str, str], dynamic: list[str], every: list[str]
) -> list[str]:
    """Export's report, in our words: which size, and what the code did with it."""
    text = str(error) if error is not None else ""
    failures = []
    for dim, constant in re.findall(
        r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)", text
    ):
        size = "cached + 1" if dim == "cached" else dim  # decoding's symbol counts the position written too
        failures.append(
            f"{dim}: the code fixes {size} to {constant} (a view, slice or buffer of that size where {dim} belongs)"
        )
    # torch's suggested range for a size is where the shapes hold; a guard alone may be one of several it made
    # there (`(16*seq) != 1024` beside `seq <= 64`), which "only where" would overstate
    suggested = {dim: (low, high) for dim, low, high in re.findall(_SUGGESTED, text) if low or high}
    for dim, (low, high) in suggested.items():  # a low end beside a high one: the range's own (as for a guard)
        size = "(cached + 1)" if dim == "cached" else dim
        where = f"{size} <= {high}" if high else f"{size} >= {low}"
        failures.append(f"{dim}: the shapes hold only where {where} (a branch, view or buffer that depends on {dim})")
    for dim, guard in re.findall(_GUARD, text):
        if dim in suggested:
            continue
        guard = _readable(re.sub(r"^\d+ <= (\S+) and ", "", guard), names)  # the range's own lower bound
        failure = f"{dim}: the shapes hold only where {guard} (a branch, view or buffer that depends on {dim})"
        if failure not in failures:
            failures.append(failure)
    if not failures:
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        symbolic = re.search(r"\bs\d+\b", first) is not None
        if len(dynamic) == 1 and symbolic:  # one symbol in play, and the error is about it: name it
            who = dynamic[0]
            first = re.sub(r"\bs\d+\b", who, first)
        else:  # no symbol in the error: the sizes held fixed are the ones it cannot take
            who = " or ".join(n for n in every if n not in dynamic) or " or ".join(dynamic)
        failures.append(f"{who}: the module fails at some {who}: {first[:180]}")
    return failures


_EXHAUSTIVE = 4_000_000  # sizes tried one by one at most (64 batches x 2,049 cache lengths is 131,136)


def _counterexample(condition: Any, ranges: dict[Any, tuple[int, int]]) -> dict[str, int] | None:
    """Sizes in `ranges` where `condition` (over torch's symbols) is false; None where it holds for all of them.

    First symbolically, each symbol written as its range's lower bound plus a nonnegative integer (sympy then
    decides `min(s + 1, 4*s + 4) == s + 1`, which torch leaves undecided); else size by size, every combination
    in the ranges. `{}`: undecided (a symbol without a range, or more combinations than `_EXHAUSTIVE`).
    """
    free = sorted(condition.free_symbols, key=str)
    if any(s not in ranges for s in free):
        return {}
    offsets = {s: ranges[s][0] + sympy.Symbol(f"_{s}", integer=True, nonnegative=True) for s in free}
    if sympy.simplify(condition.xreplace(offsets)) is sympy.true:
        return None
    axes = [np.arange(ranges[s][0], ranges[s][1] + 1) for s in free]
    if int(np.prod([len(a) for a in axes])) > _EXHAUSTIVE:
        return {}
    grid = np.meshgrid(*axes, indexing="ij")
    try:
        holds = np.broadcast_to(np.asarray(sympy.lambdify(free, condition, "numpy")(*grid), bool), grid[0].shape)
    except Exception:  # a function of torch's that numpy has no name for: undecided
        return {}
    if holds.all():
        return None
    where = np.argwhere(~holds)[0]
    return {str(s): int(axis[i]) for s, axis, i in zip(free, axes, where, strict=True)}


_GUARD = r"Not all values of (\w+) = \S+ in the specified range.*? satisfy the generated guard (.+?)\.?\n"
_SUGGESTED = r"(?m)^\s*(\w+) = Dim\('\w+'(?:, min=(\d+))?(?:, max=(\d+))?\)$"


def _only_guards_true_everywhere(error: Exception, sources: dict[str, tuple[int, int]]) -> bool:
    """Whether export refused only for guards that hold at every size in the ranges (torch could not prove them).

    Each guard is Python over the sizes of the inputs (`L['x'].size()[1]`), tried at every combination of
    their ranges; one over a size without a range, or with more combinations than `_EXHAUSTIVE`, is not.
    """
    text = str(error)
    guards = [guard for _, guard in re.findall(_GUARD, text)]
    listed = [line for line in text.splitlines() if line.startswith("  - ")]
    if not text.startswith("Constraints violated") or not guards or len(guards) != len(listed):
        return False
    for guard in guards:
        used = [source for source in sources if source in guard]
        for i, source in enumerate(used):
            guard = guard.replace(source, f"_{i}")
        names = set(re.findall(r"[A-Za-z_]\w*", guard))
        if not used or not names <= {f"_{i}" for i in range(len(used))} | {"min", "max", "and", "or", "not"}:
            return False
        axes = [range(sources[source][0], sources[source][1] + 1) for source in used]
        if math.prod(len(axis) for axis in axes) > _EXHAUSTIVE:
            return False
        arguments = ", ".join(f"_{i}" for i in range(len(used)))
        test = eval(f"lambda {arguments}: {guard}", {"__builtins__": {}, "min": min, "max": max})  # names checked
        if not all(test(*sizes) for sizes in itertools.product(*axes)):
            return False
    return True


def _deferred_failures(program: Any, symbols: dict[str, str]) -> list[str]:
    """The runtime asserts torch left in the program (guards it could not decide), each decided here for every
    size in the ranges: one that fails at some size, or that cannot be decided, is a failure."""
    ranges = {s: (int(r.lower), int(r.upper)) for s, r in program.range_constraints.items()}
    by_symbol = {symbol: name for name, symbol in symbols.items()}
    failures = []
    for node in program.graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default:
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else node.args[0]
        condition = value.node.expr if isinstance(value, torch.SymBool) else sympy.sympify(bool(value))
        example = _counterexample(condition, ranges)
        if example is None:
            continue
        names = [by_symbol.get(str(s), str(s)) for s in sorted(condition.free_symbols, key=str)]
        who = " or ".join(dict.fromkeys(n.split(" ")[0] for n in names)) or "batch or seq"
        guard = _named(str(condition), symbols)
        at = ", ".join(f"{by_symbol.get(s, s)} = {v}" for s, v in example.items())
        failures.append(
            f"{who}: the shapes hold only where {guard} ({f'false at {at}' if at else 'undecided for some sizes'}:"
            f" a branch, view or buffer that depends on {who})"
        )
    return failures


def _check_named(
    seen: list[Seen], known: dict[str, Any], rename: dict[str, Any] | None = None
) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Check each observed stage's named shape against its symbolic shape; bind names on first sight.

    Our stages share one set of names (`known`, the module's sizes, and what they bind); each call of a
    user's decorated function has its own (its `group`), seeded with the sizes it binds from int
    arguments and `self` (its `seed`), as at run time outside a `shape_scope`.
    """
    groups: dict[Any, dict[str, Any]] = {None: dict(known)}
    failures, rows = [], []
    for name, named_shape, tensor, group, seed in seen:
        if group not in groups:
            groups[group] = {k: sympy.Integer(v) for k, v in (seed or {}).items()}
        bound = groups[group]
        tokens = named_shape.split()
        shape = [_expr(s, rename) for s in tensor.shape]
        rows.append((name, named_shape, "(" + ", ".join(map(str, shape)) + ")"))
        if len(tokens) != len(shape):
            failures.append(f"{name}: {len(shape)}-D, but its annotation {named_shape!r} has {len(tokens)} axes")
            continue
        for axis, (token, actual) in enumerate(zip(tokens, shape, strict=True)):
            broadcast, token = token.startswith("#"), token.lstrip("#")
            names = re.findall(r"[A-Za-z_]\w*", token)
            if token.isidentifier() and token not in bound:
                if not (broadcast and actual == 1):
                    bound[token] = actual
                continue
            if not all(n in bound for n in names):
                continue
            expected = sympy.sympify(token, locals={n: bound[n] for n in names})  # pyright: ignore[reportCallIssue,reportArgumentType]
            if broadcast and actual == 1:
                continue
            if sympy.simplify(expected - actual) != 0:
                failures.append(
                    f"{token}: {name} has {actual} at axis {axis} where its annotation {named_shape!r} needs {expected}"
                )
    return failures, rows


def prove(
    module: nn.Module,
    *,
    d_model: int | None = None,
    batch: tuple[int, int] = (1, 64),
    seq: tuple[int, int] = (1, 2048),
    decode: bool = False,
    **forward_kwargs: Any,
) -> ShapeProof:
    """Prove the module's shapes for every `batch` and `seq` in the inclusive ranges, symbolically.

    `module(x, **forward_kwargs)` runs on `x` of shape `(batch, seq, d_model)` with batch and seq as
    symbols. The output must be `(batch, seq, d_model)` for all of them, with no guard that
    specializes on either; for a `MultiHeadAttention` every stage's annotation is checked too.
    `decode=True`: one decoding step against a `KVCache` holding any number of positions below `seq`'s
    upper bound. A tensor argument is passed as a function of the sizes, e.g.
    `key_padding_mask=lambda batch, seq: torch.zeros(batch, seq, dtype=torch.bool)`.

    Example:
        >>> import shapesafe_mha as ssm
        >>> proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2), is_causal=True)
        >>> proof.ok, [row[:2] for row in proof.stages if row[0] == "split_q"]
        (True, [('split_q', 'batch num_heads seq d_head')])

    Raises:
        ConfigError: `d_model` is neither given nor an attribute of the module, or a range is empty.
    """
    width = d_model if d_model is not None else getattr(module, "d_model", None)
    if not isinstance(width, int):
        raise ConfigError("prove(): pass d_model= (the module has no d_model attribute to read it from).")
    for name, (lo, hi) in (("batch", batch), ("seq", seq)):
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise ConfigError(f"prove(): {name}=({lo!r}, {hi!r}) is not a range of sizes (0 <= low <= high).")
    ranges = {"batch": batch, "seq": seq}
    known = _module_sizes(module)
    failures: list[str] = []
    rows: list[tuple[str, str, str]] = []
    symbols: dict[str, str] = {}
    # torch's symbolic sizes start at 2 (0 and 1 it specializes) and need two values at least:
    # the rest of a range (0, 1, or its one size) is proven concretely.
    symbolic = {name: (max(lo, 2), hi) for name, (lo, hi) in ranges.items() if hi > max(lo, 2)}
    concrete = {
        name: sorted({s for s in (0, 1, hi) if lo <= s <= hi and not (name in symbolic and s >= 2)})
        for name, (lo, hi) in ranges.items()
    }
    # Every combination: each size symbolic (where its range allows) or one of its specialized values.
    choices = {name: [None] * (name in symbolic) + concrete[name] for name in ranges}
    example = {name: min(max(lo, 3 if name == "batch" else 5), hi) for name, (lo, hi) in symbolic.items()}
    for b in choices["batch"]:
        for s in choices["seq"]:
            fails, seen_rows, seen_symbols = _prove_case(module, width, b, s, symbolic, decode, known, forward_kwargs)
            if fails and b is None and s is None:  # which size is it? each one symbolic alone
                alone = _prove_case(module, width, example["batch"], None, symbolic, decode, known, forward_kwargs)[0]
                alone += _prove_case(module, width, None, example["seq"], symbolic, decode, known, forward_kwargs)[0]
                fails = alone or fails
            for failure in fails:
                who = failure.split(":")[0]
                if not any(f.split(":")[0] == who for f in failures):  # one line a dimension
                    failures.append(failure)
            if seen_rows and not rows:  # the first case that ran is the most symbolic one
                rows, symbols = seen_rows, seen_symbols
    if decode:
        ranges = {"batch": batch, "cached": seq}
    return ShapeProof(not failures, failures, rows, ranges, symbols, decode)


def _module_sizes(module: nn.Module) -> dict[str, Any]:
    sizes = {}
    for name in ("d_model", "num_heads", "num_kv_heads", "d_head", "group", "q_lora_rank", "kv_lora_rank", "d_nope",
                 "d_rope", "d_value"):  # fmt: skip
        value = getattr(module, name, None)
        if isinstance(value, int):
            sizes[name] = sympy.Integer(value)
    rope_dim = getattr(module, "rope_dim", None)  # partial rotary: the rotated part of a head is its d_rope
    if isinstance(rope_dim, int):
        sizes["d_rope"] = sympy.Integer(rope_dim)
    return sizes


class _Decode(nn.Module):
    """One decoding step of `module` against a KVCache whose buffers are `past_keys` and `past_values`."""

    def __init__(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.inner, self.kwargs = module, kwargs

    def forward(self, query: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor) -> torch.Tensor:
        from .._compute.cache import KVCache

        # The buffers hold the cached positions and the one being written: torch's symbol is their count,
        # `cached + 1`. A buffer concatenated from `cached` positions and one more would make every axis of
        # that length `s + 1`, and torch cannot prove `min(s + 1, 4*s + 4) == s + 1` when it merges two of them.
        cache = KVCache.__new__(KVCache)
        cache.keys_buffer, cache.values_buffer = past_keys.clone(), past_values.clone()
        cache._length = past_keys.shape[2] - query.shape[1]  # pyright: ignore[reportAttributeAccessIssue]
        cache.window, cache._verdicts, cache._start = None, Verdicts(), 0  # (the window before it is built)
        return self.inner(query, kv_cache=cache, **self.kwargs)


class _LatentDecode(nn.Module):
    """One decoding step of a `LatentAttention` against a latent cache whose buffer is `past`."""

    def __init__(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.inner, self.kwargs = module, kwargs

    def forward(self, query: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        from .._modules.latent import LatentCache

        cache = LatentCache.__new__(LatentCache)
        inner: Any = self.inner
        cache.kv_lora_rank = inner.kv_lora_rank
        cache.buffer = past.clone()  # the cached positions and the one being written, as _Decode's buffers
        cache._length = past.shape[1] - query.shape[1]  # pyright: ignore[reportAttributeAccessIssue]
        return self.inner(query, kv_cache=cache, **self.kwargs)


def _prove_case(
    module: nn.Module,
    width: int,
    b: int | None,
    s: int | None,
    symbolic: dict[str, tuple[int, int]],
    decode: bool,
    known: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[list[str], list[tuple[str, str, str]], dict[str, str]]:
    """One export at these sizes (None: symbolic): its failures, its stages' rows, its symbols by name."""
    weight = next((p for p in module.parameters() if p.is_floating_point()), None)
    dtype = weight.dtype if weight is not None else torch.float32
    device = weight.device if weight is not None else torch.device("cpu")
    # Example sizes apart from each other, so a tensor argument's axes can be told apart.
    example_b = b if b is not None else min(max(symbolic["batch"][0], 3), symbolic["batch"][1])
    example_s = s if s is not None else min(max(symbolic["seq"][0], 5), symbolic["seq"][1])
    # Decoding's symbol counts the cache's positions with the one being written (`cached + 1`, see _Decode).
    dims: dict[str, Any] = {
        "batch": Dim("batch", min=symbolic["batch"][0], max=symbolic["batch"][1]) if b is None else None,
        "seq": None,
    }
    if s is None:
        lo, hi = symbolic["seq"]
        dims["seq"] = Dim("cached", min=lo + 1, max=hi + 1) if decode else Dim("seq", min=lo, max=hi)
    names = {"L['query'].size()[0]": "batch", "L['query'].size()[1]": "seq", "L['args'][0][0].size()[0]": "batch"}
    latent = hasattr(module, "kv_lora_rank")
    if decode and latent:
        query = torch.randn(example_b, 1, width, dtype=dtype, device=device)
        mla: Any = module
        entry: int = mla.kv_lora_rank + mla.d_rope
        target: nn.Module = _LatentDecode(module, {"is_causal": True, **kwargs})
        args: tuple[Any, ...] = (query, torch.randn(example_b, example_s + 1, entry, dtype=dtype, device=device))
        batch_only = {0: dims["batch"]} if dims["batch"] else {}
        past_dims = {i: d for i, d in ((0, dims["batch"]), (1, dims["seq"])) if d is not None}
        shapes: Any = {"query": batch_only or None, "past": past_dims or None}
        call_kwargs: dict[str, Any] = {}
        expected_seq: Any = sympy.Integer(1)
        names |= {"L['past'].size()[1]": "(cached + 1)"}
        axes_named: list[dict[int, str]] = [{0: "batch"}, {0: "batch", 1: "cached"}]
    elif decode:
        query = torch.randn(example_b, 1, width, dtype=dtype, device=device)
        heads, d_head = getattr(module, "num_kv_heads", 1), getattr(module, "d_head", width)
        past = torch.randn(example_b, heads, example_s + 1, d_head, dtype=dtype, device=device)
        target = _Decode(module, {"is_causal": True, **kwargs})
        args = (query, past, past)
        batch_only = {0: dims["batch"]} if dims["batch"] else {}
        past_dims = {0: dims["batch"]} if dims["batch"] else {}
        if dims["seq"]:
            past_dims[2] = dims["seq"]
        shapes = {"query": batch_only or None, "past_keys": past_dims or None, "past_values": past_dims or None}
        call_kwargs = {}
        expected_seq = sympy.Integer(1)
        names |= {"L['past_keys'].size()[2]": "(cached + 1)"}
        axes_named = [{0: "batch"}, {0: "batch", 2: "cached"}]
    else:
        target = module
        args = (torch.randn(example_b, example_s, width, dtype=dtype, device=device),)
        axes = {i: d for i, d in ((0, dims["batch"]), (1, dims["seq"])) if d is not None}
        # A tensor argument is given as `lambda batch, seq: tensor`: built at the example sizes, and
        # its axes of those sizes are the same symbols.
        call_kwargs = {k: v(example_b, example_s) if callable(v) else v for k, v in kwargs.items()}
        first = next(iter(inspect.signature(module.forward).parameters))
        shapes = {first: axes or None}
        names |= {f"L['{first}'].size()[0]": "batch", f"L['{first}'].size()[1]": "seq"}
        for key, value in call_kwargs.items():
            marked = None
            if isinstance(value, torch.Tensor):
                marked = {
                    i: dims["batch"] if size == example_b else dims["seq"]
                    for i, size in enumerate(value.shape)
                    if (size == example_b and dims["batch"]) or (size == example_s and dims["seq"])
                } or None
            shapes[key] = marked
        expected_seq = None
        axes_named = [{0: "batch", 1: "seq"}]
    # Each input size torch's guards name, and its range: a guard over them is tried at every size in them.
    ranged = {"batch": dims["batch"], "(cached + 1)" if decode else "seq": dims["seq"]}
    sources = {src: (d.min, d.max) for src, name in names.items() if (d := ranged.get(name)) is not None}
    with _observing() as observer:
        refusal: Exception | None = None
        try:
            program = export(target, args, kwargs=call_kwargs or None, dynamic_shapes=shapes)
        except Exception as error:  # export's own report: which size was specialized, and where
            program, refusal = None, error
            if _only_guards_true_everywhere(error, sources):  # torch could not prove them: export past them
                observer.seen.clear()
                observer.spans.clear()
                with contextlib.suppress(Exception):  # as refused before, if it fails even so
                    program = export(
                        target,
                        args,
                        kwargs=call_kwargs or None,
                        dynamic_shapes=shapes,
                        prefer_deferred_runtime_asserts_over_guards=True,  # its other undecided guards: asserts
                    )
        if program is None:
            every = ["batch", "cached" if decode else "seq"]  # the sizes by name, as the title gives their ranges
            failures = _explain_export_failure(refusal, names, [d.__name__ for d in dims.values() if d], every)
            where = observer.guarding_calls()
            if where:  # the user's decorated functions in which the size-specific guards were made
                failures = [f"{f} in {', '.join(where)}" for f in failures]
            return failures, [], {}
    symbols = _symbols(program, axes_named)
    rename: dict[str, Any] = {}
    if "cached" in symbols:  # torch's symbol counts the new position too: written `cached + 1`
        total = symbols.pop("cached")
        symbols["cached + 1"] = total
        rename[total] = sympy.Symbol("cached", integer=True, positive=True) + 1
    failures, rows = _shape_failures(program, observer, known, b, s, width, decode, expected_seq, rename)
    failures = _deferred_failures(program, symbols) + failures
    return [_named(f, symbols) for f in failures], [(n, a, _named(e, symbols)) for n, a, e in rows], symbols


def _symbols(program: Any, axes_named: list[dict[int, str]]) -> dict[str, str]:
    """`{"batch": "s5", ...}`: the symbol torch gave each named axis of the inputs (a fixed size has none)."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    symbols: dict[str, str] = {}
    for name, axes in zip(program.graph_signature.user_inputs, axes_named, strict=False):
        value = placeholders[name].meta.get("val")
        for axis, dim in axes.items():
            size = value.shape[axis] if isinstance(value, torch.Tensor) else None
            if isinstance(size, torch.SymInt) and isinstance(_expr(size), sympy.Symbol):
                symbols.setdefault(dim, str(_expr(size)))
    return symbols


def _named(text: str, symbols: dict[str, str]) -> str:
    """`text` with each of torch's symbols written as the dimension it stands for (`s83 + 1` -> `cached + 1`)."""
    by_symbol = {symbol: name if name.isidentifier() else f"({name})" for name, symbol in symbols.items()}
    return re.sub(r"\bs\d+\b", lambda m: by_symbol.get(m[0], m[0]), text)


def _shape_failures(
    program: Any,
    observer: _Observer,
    known: dict[str, Any],
    b: int | None,
    s: int | None,
    width: int,
    decode: bool,
    expected_seq: Any,
    rename: dict[str, Any],
) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The exported program's output, and each stage the module reported, against their named shapes."""
    out = next(n for n in program.graph.nodes if n.op == "output").args[0]
    value = out[0] if isinstance(out, list | tuple) else out
    value = value.meta["val"]
    value = value[0] if isinstance(value, tuple) else value
    got = [_expr(x, rename) for x in value.shape]
    if observer.seen:  # our module: every stage against its annotation
        failures, rows = _check_named(observer.seen, known, rename)
    else:
        failures, rows = [], [("output", "batch seq d_model", "(" + ", ".join(map(str, got)) + ")")]
    if len(got) != 3:
        failures.append(f"the output is {len(got)}-D, not (batch, seq, d_model)")
        return failures, rows
    if got[2] != width:
        failures.append(f"d_model: the output has {got[2]} features, not d_model={width}")
    if expected_seq is not None and got[1] != expected_seq:
        failures.append(f"seq: one decoding step returns {got[1]} positions, not 1")
    if b is None and got[0].is_Integer:
        failures.append(f"batch: the output has batch {got[0]} whatever the input's batch")
    if (
        s is None
        and not decode
        and (got[1].is_Integer or len(got[1].free_symbols) != 1 or got[1].func is not sympy.Symbol)
    ):
        failures.append(f"seq: the output has {got[1]} positions, not seq")
    return failures, rows
