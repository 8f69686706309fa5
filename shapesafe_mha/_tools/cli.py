"""The `shapesafe-mha` command: thin, it parses arguments and calls the public API.

Nothing here imports torch at module level: `--help` and a bad value answer before torch loads
(a second or more), and each command imports what it runs. An option means one thing wherever it
appears (`--d-model`, `--module`, `--decode`, ...), and its help is written once, below.
"""

import dataclasses
import inspect
import json
import re
import sys
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from .report import TraceReport

# Plain click help: flags read `--qk-norm / --no-qk-norm`, never `<bool>`, and no markup in help text.
app = typer.Typer(
    help="Shape-checked multi-head attention: see every stage's shape.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


class DType(StrEnum):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Format(StrEnum):
    table = "table"
    json = "json"
    svg = "svg"


class KVHeads(StrEnum):
    grouped = "grouped"
    interleaved = "interleaved"


# The options more than one command takes, each with one help text.
DModel = Annotated[int, typer.Option(min=1, metavar="INT", help="model width")]
NumHeads = Annotated[int, typer.Option(min=1, metavar="INT", help="query heads")]
NumKVHeads = Annotated[int, typer.Option(min=1, metavar="INT", help="key/value heads (MQA: 1)")]
DHead = Annotated[
    int | None, typer.Option(min=1, metavar="INT", show_default="d_model // num_heads", help="head width")
]
DTypeOption = Annotated[DType, typer.Option()]
ModuleOption = Annotated[
    str | None,
    typer.Option(
        metavar="PKG.MOD:FACTORY",
        help="your module instead, built by factory(d_model, num_heads, num_kv_heads, d_head, bias): "
        "check draws the sizes, prove takes them from its options",
    ),
]
DeviceOption = Annotated[
    str, typer.Option(metavar="DEVICE", help="a torch device: cpu, cuda, cuda:1, or meta for trace (shapes, no memory)")
]
Decode = Annotated[
    int | None, typer.Option(min=0, metavar="N", help="one decoding step against a cache holding N positions")
]


def fail(command: str, message: str, code: int = 2) -> NoReturn:
    """One line on stderr, `shapesafe-mha COMMAND: error: ...`, and exit `code` (2: usage, 1: the user's code)."""
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    typer.echo(f"shapesafe-mha {command}: error: {first}", err=True)
    raise typer.Exit(code)


def load(spec: str, option: str, command: str) -> Callable[..., Any]:
    """`pkg.mod:name` -> the callable it names, the current directory searched too, as `python -m` does.

    The one resolver of `check --impl`, `check --module` and `prove --module`; anything it cannot
    load is a usage error (exit 2).
    """
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        fail(command, f"{option} must be pkg.mod:name, got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        fail(command, f"{option} {spec}: {error}")
    except Exception as error:  # the user's module raised while it was imported
        fail(command, f"{option} {spec}: importing {module_name} raised {type(error).__name__}: {error}")
    if not callable(found):
        fail(command, f"{option} {spec}: {type(found).__name__} is not callable")
    return found


def _usable(device: str, command: str) -> str:
    """`device`, or a one-line usage error if this machine cannot compute on it."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        fail(command, f"--device {device} was asked for, but torch.cuda.is_available() is False on this machine")
    try:
        torch.device(device)
    except RuntimeError:
        fail(command, f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)")
    return device


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render(report: "TraceReport", console: "Console", *, plain: bool = False) -> None:
    """Print a trace as a rich table with totals; `plain`: no box, the layout of the README's excerpt. At any
    width a cell wraps (a name longer than its column folds), never cut: a named shape is read whole."""
    from rich.table import Table

    c = report.config
    title = f"{report.heading()} on {c['device']} ({c['dtype']})"
    box: Any = {} if not plain else {"box": None}
    table = Table(title=title, **box)
    for column in ("stage", "named shape", "shape", "strides", "storage", "bytes", "allocated"):
        table.add_column(column, justify="right" if column in ("bytes", "allocated") else "left", overflow="fold")
    for s in report.stages:
        table.add_row(
            s.name,
            s.named_shape,
            str(tuple(s.shape)),
            str(tuple(s.strides)),
            s.storage,
            _bytes(s.nbytes),
            _bytes(s.allocated_bytes) if s.allocated_bytes else "-",
        )
    console.print(table)
    t = report.totals
    if "tp" in t:
        placement = "KV heads replicated" if t["replicated_kv"] else "KV heads sharded"
        ranks = Table(title=f"head-parallel over {t['tp']} ranks ({placement})", **box)
        for column in ("rank", "query heads", "KV heads", "weights", "KV cache"):
            ranks.add_column(column, justify="right", overflow="fold")
        for r in t["ranks"]:
            ranks.add_row(
                str(r["rank"]),
                f"{r['q_heads'][0]}..{r['q_heads'][1] - 1}",
                f"{r['kv_heads'][0]}..{r['kv_heads'][1] - 1}",
                _bytes(t["per_rank_weight_bytes"]),
                _bytes(t["per_rank_kv_cache_bytes"]),
            )
        console.print(ranks)
        console.print(
            f"each forward all-reduces {_bytes(t['all_reduce_bytes'])} of partial outputs "
            f"(a ring all-reduce sends and receives {_bytes(t['all_reduce_ring_bytes_per_rank'])} per rank)"
        )
    console.print(
        f"allocated during the forward: {_bytes(t['allocated_bytes'])}; "
        f"KV cache for {t['kv_cache_positions']} positions: {_bytes(t['kv_cache_bytes'])} "
        f"(MHA {_bytes(t['kv_cache_bytes_mha'])}, MQA {_bytes(t['kv_cache_bytes_mqa'])}); "
        f"cache vs MHA: this {t['kv_cache_ratio_vs_mha']:.3f}, MQA {t['kv_cache_ratio_mqa_vs_mha']:.3f}"
    )


def _console() -> "Console":
    """stdout, with no markup or emoji read into names (`mod:factory:` is no emoji code); in a pipe or a
    file, at full width: rich would cut tables and wrap reports at 80 columns there."""
    from rich.console import Console

    console = Console(emoji=False, highlight=False)
    return console if console.is_terminal else Console(emoji=False, highlight=False, width=1000)


def _plain_text(report: "TraceReport") -> str:
    """The table for a pipe or a file: no box, at its full width (rich would cut it at 80 columns)."""
    import io

    from rich.console import Console

    console = Console(record=True, width=1000, file=io.StringIO(), color_system=None, emoji=False, highlight=False)
    render(report, console, plain=True)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def trace(
    d_model: DModel = 4096,
    num_heads: NumHeads = 32,
    num_kv_heads: NumKVHeads = 8,
    d_head: DHead = None,
    batch: Annotated[int, typer.Option(min=1, metavar="INT", help="sequences in the batch")] = 1,
    seq: Annotated[int, typer.Option(min=1, metavar="INT", help="query positions")] = 128,
    device: DeviceOption = "meta",
    dtype: DTypeOption = DType.bfloat16,
    decode: Decode = None,
    tp: Annotated[
        int, typer.Option(min=1, metavar="W", help="head-parallel ranks: show one rank's share and the all-reduce")
    ] = 1,
    kv_lora_rank: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="INT",
            help="multi-head latent attention (DeepSeek) with this latent width; then --num-kv-heads, --d-head and "
            "the options above do not apply",
        ),
    ] = None,
    q_lora_rank: Annotated[
        int | None, typer.Option(min=1, metavar="INT", help="latent attention: the queries' bottleneck")
    ] = None,
    d_nope: Annotated[
        int, typer.Option(min=1, metavar="INT", help="latent attention: a head's part without RoPE")
    ] = 128,
    d_rope: Annotated[
        int, typer.Option(min=1, metavar="INT", help="latent attention: a head's rotary part (even)")
    ] = 64,
    d_value: Annotated[int, typer.Option(min=1, metavar="INT", help="latent attention: a value head's width")] = 128,
    format: Annotated[
        Format,
        typer.Option(help="table, json, or svg (a picture of the stages); a table sent to a pipe or file is plain"),
    ] = Format.table,
    output: Annotated[
        Path | None, typer.Option(dir_okay=False, metavar="FILE", help="write to this file instead of the terminal")
    ] = None,
    **layer: Any,  # the layer's options, one for each AttentionConfig field (`_layer_options`)
) -> None:
    """Run one forward and print every stage: named shape, shape, strides, view or new allocation."""
    options = locals() | layer  # each option is TraceConfig's field of the same name
    from .._core.errors import ShapesafeError
    from .report import LatentTraceConfig, TraceConfig, trace_forward, trace_latent

    _usable(device, "trace")
    try:
        if kv_lora_rank is not None:
            latent = LatentTraceConfig(
                d_model, num_heads, kv_lora_rank=kv_lora_rank, d_nope=d_nope, d_rope=d_rope, d_value=d_value,
                q_lora_rank=q_lora_rank, batch=batch, seq=seq, device=device, dtype=dtype.value, decode=decode,
            )  # fmt: skip
            report = trace_latent(latent)
        else:
            fields = {f.name for f in dataclasses.fields(TraceConfig)}
            given: dict[str, Any] = {name: value for name, value in options.items() if name in fields}
            given = {name: str(value) if isinstance(value, StrEnum) else value for name, value in given.items()}
            config = TraceConfig(**given)
            report = trace_forward(config)
    except ShapesafeError as error:
        fail("trace", str(error))
    from rich.console import Console

    if format is Format.table and output is None:
        console = Console(emoji=False)
        if console.is_terminal:
            render(report, console)
        else:  # a pipe or a redirect: every column at full width, as the README shows it
            typer.echo(_plain_text(report), nl=False)
        return
    if format is Format.json:
        text = json.dumps(report.as_dict(), indent=2) + "\n"
    elif format is Format.svg:
        from .svg import pipeline

        text = pipeline(report)
    else:
        text = _plain_text(report)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as error:
        fail("trace", f"--output {output}: cannot write it: {error.strerror}")


def _layer_options() -> list[inspect.Parameter]:
    """An option for each `AttentionConfig` field that is no size (those are shared with the other commands, above)
    and that a command line spells (a number, a flag, a choice, a pair: not a mapping), in the
    config's order, its help the first sentence of the field's description there (`described`)."""
    from .._modules.config import CHOICES, OPPOSITES, RANGES, SIZES, AttentionConfig, described

    hints = typing.get_type_hints(AttentionConfig)
    parameters = []
    for field in dataclasses.fields(AttentionConfig):
        kind: Any = hints[field.name]
        union = typing.get_origin(kind) is UnionType
        given = [t for t in typing.get_args(kind) if t is not type(None)] if union else [kind]
        if field.name in SIZES or len(given) != 1:
            continue
        flag, (value,) = "--" + field.name.replace("_", "-"), given
        help = re.split(r"(?<=\.)\s+(?=[A-Z`])", described(field.name), maxsplit=1)[0].replace("`", "")
        edges = RANGES.get(field.name)
        if value is bool:
            option = typer.Option(f"{flag}/--{OPPOSITES.get(field.name, 'no-' + flag[2:])}", help=help)
        elif field.name in CHOICES:  # typer's choices are an enum's members
            kind = StrEnum(field.name, {word: word for word in CHOICES[field.name]})
            option = typer.Option(help=help)
        elif value in (int, float):
            low = edges.low if edges and value is int and isinstance(edges.low, int) and not edges.low_open else None
            option = typer.Option(min=low, metavar=value.__name__.upper(), help=help)
        elif typing.get_origin(value) is tuple:
            option = typer.Option(metavar=" ".join(t.__name__.upper() for t in typing.get_args(value)), help=help)
        else:
            continue
        default = kind(field.default) if field.name in CHOICES else field.default
        parameters.append(inspect.Parameter(field.name, KEYWORD, default=default, annotation=Annotated[kind, option]))
    return parameters


def _with_layer_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command`, its `**layer` the layer's options (`_layer_options`), after its `tp` (typer reads the signature)."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next(i for i, p in enumerate(own) if p.name == "tp") + 1
    command.__signature__ = signature.replace(parameters=[*own[:at], *_layer_options(), *own[at:]])  # type: ignore[attr-defined]
    return command


KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD  # (typer passes every option by its name)
app.command()(_with_layer_options(trace))


def _in_cli_words(report: str) -> str:
    """A report's advice in this command's options: `kv_heads="x"` is `--kv-heads x`, `atol=x` is `--atol x`."""
    report = re.sub(r'\bkv_heads="(\w+)"', r"--kv-heads \1", report)
    report = re.sub(r"\bpass atol=(\S+)", r"pass --atol \1", report)
    return report.replace("or check in float32", "or check in float32 (--dtype float32)")


@app.command()
def check(
    device: DeviceOption = "cpu",
    dtype: DTypeOption = DType.float64,
    examples: Annotated[int, typer.Option(min=1, metavar="INT", help="examples per property")] = 50,
    impl: Annotated[
        str | None,
        typer.Option(metavar="PKG.MOD:FN", help="check your function instead: fn(x, weights, *, num_heads, ...)"),
    ] = None,
    module: ModuleOption = None,
    kv_heads: Annotated[
        KVHeads,
        typer.Option(
            help="with --impl/--module: query head i reads KV head i // group (grouped: transformers, torch) "
            "or i % num_kv_heads (interleaved: x-transformers)"
        ),
    ] = KVHeads.grouped,
    atol: Annotated[
        float | None,
        typer.Option(min=0, metavar="FLOAT", show_default="the dtype's", help="with --impl/--module: the tolerance"),
    ] = None,
) -> None:
    """Run the built-in property suite, or with --impl/--module the same checks on your code, on a device and dtype."""
    if device == "meta":
        fail("check", "--device meta has no values to compare; use cpu or cuda")
    if impl is not None and module is not None:
        fail("check", "pass --impl or --module, not both")
    if impl is None and module is None and (kv_heads is not KVHeads.grouped or atol is not None):
        fail("check", "--kv-heads and --atol apply to your code: pass --impl or --module too")
    try:  # first: the suite is hypothesis's, an extra that `pip install shapesafe_mha` does not bring
        from ..testing._suite import PROPERTIES, module_properties, run_suite, user_properties
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "hypothesis":
            raise
        needs = 'the property suite needs hypothesis, not installed here: pip install "shapesafe_mha[testing]"'
        fail("check", needs, 1)
    spec, option = (impl, "--impl") if impl is not None else (module, "--module")
    target = load(spec, option, "check") if spec is not None else None
    _usable(device, "check")
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from .report import DTYPES

    properties = PROPERTIES
    convention: Any = kv_heads.value  # check_attention's kv_heads: "grouped" or "interleaved"
    if target is not None:
        make = user_properties if impl is not None else module_properties
        properties = make(target, kv_heads=convention, atol=atol)
    console = _console()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console) as bars:
            tasks = [bars.add_task(escape(name), total=examples) for name, *_ in properties]
            outcomes = run_suite(
                device=device,
                dtype=DTYPES[dtype.value],
                examples=examples,
                on_example=lambda i: bars.advance(tasks[i]),
                properties=properties,
            )
            for task, outcome in zip(tasks, outcomes, strict=True):
                bars.update(task, completed=examples if outcome.passed else outcome.examples)
    except Exception as error:  # the user's factory or function raised outside a compared call
        if spec is None:
            raise
        fail("check", f"{option} {spec} raised {type(error).__name__}: {error}", 1)
    whose = f"{spec}: " if spec else "shapesafe_mha "
    table = Table(title=escape(f"{whose}properties on {device} ({dtype.value})"))
    # For a failure, the examples include the failing one and the deviation is its, as its report says.
    for column in ("property", "examples", "result", "worst deviation", "tolerance"):
        table.add_column(column, justify="left" if column in ("property", "result") else "right")
    for outcome in outcomes:
        result = "[green]pass[/green]" if outcome.passed else "[red]FAIL[/red]"
        worst = "-" if outcome.worst != outcome.worst else f"{outcome.worst:.2e}"  # NaN: not a deviation
        table.add_row(escape(outcome.name), str(outcome.examples), result, worst, f"{outcome.tolerance:.0e}")
    console.print(table)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        console.print(f"[red]{escape(outcome.name)}[/red]: {escape(_in_cli_words(outcome.failure or ''))}")
    if failed:
        raise typer.Exit(1)


@app.command()
def prove(
    context: typer.Context,
    d_model: DModel = 512,
    num_heads: NumHeads = 8,
    num_kv_heads: NumKVHeads = 2,
    d_head: DHead = None,
    batch_max: Annotated[int, typer.Option(min=1, metavar="INT", help="prove for every batch from 1 to this")] = 64,
    seq_max: Annotated[int, typer.Option(min=1, metavar="INT", help="prove for every seq from 1 to this")] = 2048,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="is_causal=True")] = False,
    decode_max: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="N",
            help="prove one decoding step against a cache holding every number of positions from 1 to N "
            "(instead of a forward over --seq-max)",
        ),
    ] = None,
    module: ModuleOption = None,
) -> None:
    """Prove every stage's named shape for all batch and seq sizes in the ranges (exit 1 if not proven)."""
    given = context.get_parameter_source("seq_max")
    if decode_max is not None and given is not None and given.name == "COMMANDLINE":
        fail("prove", "--decode-max N proves one step (seq 1) against caches of 1..N positions: drop --seq-max")
    target = load(module, "--module", "prove") if module is not None else None

    import torch

    from .._core.errors import ShapesafeError
    from .._modules.multihead import MultiHeadAttention
    from .prove import prove as prove_shapes

    try:
        if target is not None:
            sizes = (d_model, num_heads, num_kv_heads, d_head or d_model // num_heads, False)
            try:
                built = target(*sizes)
            except Exception as error:
                fail("prove", f"--module {module}: calling it raised {type(error).__name__}: {error}", 1)
            if not isinstance(built, torch.nn.Module):
                fail("prove", f"--module {module}: it returned a {type(built).__name__}, not an nn.Module")
        else:
            built = MultiHeadAttention(d_model, num_heads, num_kv_heads, d_head=d_head)
        kwargs = {"is_causal": True} if causal and decode_max is None else {}  # decoding is causal anyway
        top = decode_max if decode_max is not None else seq_max
        proof = prove_shapes(built, batch=(1, batch_max), seq=(1, top), decode=decode_max is not None, **kwargs)
    except ShapesafeError as error:
        fail("prove", str(error))
    console = _console()
    table = proof.table()
    if not console.is_terminal:  # a pipe or a file: plain text, as trace's table there
        table.box = None
    console.print(table)
    for failure in proof.failures:
        console.print(failure, markup=False, soft_wrap=True)
    raise typer.Exit(0 if proof.ok else 1)


@app.callback()
def _root() -> None:
    """shapesafe_mha's command line."""


def main() -> None:
    """The console script: a bad value is one line on stderr and exit code 2, never a traceback.

    An error nobody foresaw is one line too, exit 1, saying so; `SHAPESAFE_MHA_TRACEBACK=1` shows its
    traceback (for a bug report).
    """
    import os

    try:
        code = typer.main.get_command(app).main(standalone_mode=False)
    except typer.Abort:
        raise SystemExit(1) from None
    except Exception as error:
        # typer ships click's usage errors (bad value, unknown option) without a public name for
        # their base class: they are the exceptions that know how to format themselves.
        if not (hasattr(error, "format_message") and hasattr(error, "exit_code")):
            if os.environ.get("SHAPESAFE_MHA_TRACEBACK"):
                raise
            first = (str(error).strip().splitlines() or [""])[0]
            typer.echo(
                f"shapesafe-mha: error: unexpected {type(error).__name__}: {first} "
                "(SHAPESAFE_MHA_TRACEBACK=1 shows where)",
                err=True,
            )
            raise SystemExit(1) from None
        context = getattr(error, "ctx", None)
        command = f" {context.info_name}" if context is not None and context.parent is not None else ""
        typer.echo(f"shapesafe-mha{command}: error: {error.format_message()}", err=True)  # pyright: ignore[reportAttributeAccessIssue]
        raise SystemExit(error.exit_code) from None  # pyright: ignore[reportAttributeAccessIssue]
    raise SystemExit(code if isinstance(code, int) else 0)
