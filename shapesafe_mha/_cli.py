"""The `shapesafe-mha` command: thin, it parses arguments and calls the public API."""

import io
import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ._errors import ShapesafeError
from ._report import DTYPES, LatentTraceConfig, TraceConfig, TraceReport, trace_forward, trace_latent

app = typer.Typer(
    help="Shape-checked multi-head attention: see every stage's shape.", no_args_is_help=True, add_completion=False
)


class Device(StrEnum):
    meta = "meta"
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


def _usable(device: str) -> str:
    """`device`, or a one-line usage error if this machine cannot compute on it."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter(f"{device} was asked for, but torch.cuda.is_available() is False on this machine")
    try:
        torch.device(device)
    except RuntimeError:
        raise typer.BadParameter(f"{device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    return device


class Format(StrEnum):
    table = "table"
    json = "json"
    svg = "svg"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render(report: TraceReport, console: Console) -> None:
    """Print a trace as a rich table with totals."""
    c = report.config
    title = f"{report.heading()} on {c['device']} ({c['dtype']})"
    table = Table(title=title)
    for column in ("stage", "named shape", "shape", "strides", "storage", "bytes", "allocated"):
        table.add_column(column, justify="right" if column in ("bytes", "allocated") else "left")
    for s in report.stages:
        storage = s.storage
        table.add_row(
            s.name,
            s.named_shape,
            str(tuple(s.shape)),
            str(tuple(s.strides)),
            storage,
            _bytes(s.nbytes),
            _bytes(s.allocated_bytes) if s.allocated_bytes else "-",
        )
    console.print(table)
    t = report.totals
    if "tp" in t:
        placement = "KV heads replicated" if t["replicated_kv"] else "KV heads sharded"
        ranks = Table(title=f"head-parallel over {t['tp']} ranks ({placement})")
        for column in ("rank", "query heads", "KV heads", "weights", "KV cache"):
            ranks.add_column(column, justify="right")
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


@app.command()
def trace(
    d_model: Annotated[int, typer.Option(min=1, help="model width")] = 4096,
    num_heads: Annotated[int, typer.Option(min=1, help="query heads")] = 32,
    num_kv_heads: Annotated[int, typer.Option(min=1, help="key/value heads (MQA: 1)")] = 8,
    d_head: Annotated[int | None, typer.Option(min=1, help="head width \\[default: d_model // num_heads]")] = None,
    batch: Annotated[int, typer.Option(min=1)] = 1,
    seq: Annotated[int, typer.Option(min=1, help="query positions")] = 128,
    device: Annotated[Device, typer.Option(help="meta: shapes only, no memory")] = Device.meta,
    dtype: Annotated[DType, typer.Option()] = DType.bfloat16,
    decode: Annotated[
        int | None, typer.Option(min=0, help="one decoding step against a cache holding N positions")
    ] = None,
    tp: Annotated[
        int, typer.Option("--tp", min=1, help="head-parallel ranks: show one rank's share and the all-reduce")
    ] = 1,
    rope_theta: Annotated[
        float | None, typer.Option("--rope-theta", help="rotary position embeddings with this base (Llama: 500000)")
    ] = None,
    qk_norm: Annotated[bool, typer.Option("--qk-norm", help="RMS-normalise each head's q and k (Qwen3)")] = False,
    window: Annotated[int | None, typer.Option(min=1, help="sliding-window attention (Mistral)")] = None,
    logit_softcap: Annotated[float | None, typer.Option("--logit-softcap", help="softcapped scores (Gemma 2)")] = None,
    kv_lora_rank: Annotated[
        int | None,
        typer.Option(
            "--kv-lora-rank",
            min=1,
            help="multi-head latent attention (DeepSeek) with this latent width; then --num-kv-heads, --d-head and "
            "the options above do not apply",
        ),
    ] = None,
    q_lora_rank: Annotated[int | None, typer.Option(min=1, help="latent attention: the queries' bottleneck")] = None,
    d_nope: Annotated[int, typer.Option(min=1, help="latent attention: a head's part without RoPE")] = 128,
    d_rope: Annotated[int, typer.Option(min=1, help="latent attention: a head's rotary part (even)")] = 64,
    d_value: Annotated[int, typer.Option(min=1, help="latent attention: a value head's width")] = 128,
    format: Annotated[
        Format, typer.Option("--format", help="table, json, or svg (a picture of the stages)")
    ] = Format.table,
    output: Annotated[
        Path | None, typer.Option("--output", dir_okay=False, help="write to this file instead of the terminal")
    ] = None,
) -> None:
    """Run one forward and print every stage: named shape, shape, strides, view or new allocation."""
    _usable(device.value)
    try:
        if kv_lora_rank is not None:
            latent = LatentTraceConfig(
                d_model, num_heads, q_lora_rank, kv_lora_rank, d_nope, d_rope, d_value, batch, seq, device.value,
                dtype.value, decode,
            )  # fmt: skip
            report = trace_latent(latent)
        else:
            config = TraceConfig(
                d_model, num_heads, num_kv_heads, d_head, batch, seq, device.value, dtype.value, decode, tp, rope_theta,
                qk_norm, window, logit_softcap,
            )  # fmt: skip
            report = trace_forward(config)
    except ShapesafeError as error:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {error}", highlight=False)
        raise typer.Exit(2) from None
    if format is Format.table and output is None:
        render(report, Console())
        return
    if format is Format.json:
        text = json.dumps(report.as_dict(), indent=2) + "\n"
    elif format is Format.svg:
        from ._svg import pipeline

        text = pipeline(report)
    else:
        console = Console(record=True, width=200, file=io.StringIO())
        render(report, console)
        text = console.export_text()
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as error:
        raise typer.BadParameter(f"cannot write {output}: {error.strerror}", param_hint="--output") from None


@app.command()
def check(
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1 (a device that computes; not meta)")] = "cpu",
    dtype: Annotated[DType, typer.Option()] = DType.float64,
    examples: Annotated[int, typer.Option(min=1, help="examples per property")] = 50,
    impl: Annotated[
        str | None,
        typer.Option("--impl", help="check your function instead: pkg.mod:fn, fn(x, weights, *, num_heads, ...)"),
    ] = None,
    module: Annotated[
        str | None,
        typer.Option("--module", help="check your module instead: pkg.mod:factory, factory(d_model, num_heads, ...)"),
    ] = None,
) -> None:
    """Run the built-in property suite, or with --impl/--module the same checks on your code, on a device and dtype."""
    if device == "meta":
        raise typer.BadParameter("--device meta has no values to compare; use cpu or cuda")
    if impl is not None and module is not None:
        raise typer.BadParameter("pass --impl or --module, not both")
    _usable(device)
    dtype_name = dtype.value
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from ._suite import PROPERTIES, load_callable, module_properties, run_suite, user_properties

    properties = PROPERTIES
    try:
        if impl is not None:
            properties = user_properties(load_callable(impl))
        elif module is not None:
            properties = module_properties(load_callable(module))
    except ValueError as error:
        raise typer.BadParameter(f"{'--impl' if impl else '--module'} {error}") from None
    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console) as progress:
        tasks = [progress.add_task(escape(name), total=examples) for name, *_ in properties]
        outcomes = run_suite(
            device=device,
            dtype=DTYPES[dtype_name],
            examples=examples,
            on_example=lambda i: progress.advance(tasks[i]),
            properties=properties,
        )
        for task, outcome in zip(tasks, outcomes, strict=True):
            progress.update(task, completed=examples if outcome.passed else outcome.examples)
    whose = f"{impl or module}: " if impl or module else "shapesafe_mha "
    table = Table(title=escape(f"{whose}properties on {device} ({dtype_name})"))
    for column in ("property", "examples", "result", "worst deviation", "tolerance"):
        table.add_column(column, justify="left" if column in ("property", "result") else "right")
    for outcome in outcomes:
        result = "[green]pass[/green]" if outcome.passed else "[red]FAIL[/red]"
        row = (escape(outcome.name), str(outcome.examples), result, f"{outcome.worst:.2e}", f"{outcome.tolerance:.0e}")
        table.add_row(*row)
    console.print(table)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        console.print(f"[red]{escape(outcome.name)}[/red]: {escape(outcome.failure or '')}", highlight=False)
    if failed:
        raise typer.Exit(1)


def _load_factory(spec: str) -> object:
    """`pkg.mod:factory` -> what calling `factory()` returns."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise typer.BadParameter(f"--module must be pkg.mod:factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise typer.BadParameter(f"--module {spec}: {error}") from None
    return factory()


@app.command()
def prove(
    d_model: Annotated[int, typer.Option(min=1, help="model width")] = 512,
    num_heads: Annotated[int, typer.Option(min=1, help="query heads")] = 8,
    num_kv_heads: Annotated[int, typer.Option(min=1, help="key/value heads (MQA: 1)")] = 2,
    d_head: Annotated[int | None, typer.Option(min=1, help="head width (default: d_model / num_heads)")] = None,
    batch_max: Annotated[int, typer.Option(min=1, help="prove for every batch from 1 to this")] = 64,
    seq_max: Annotated[int, typer.Option(min=1, help="prove for every seq from 1 to this")] = 2048,
    causal: Annotated[bool, typer.Option("--causal", help="is_causal=True")] = False,
    decode: Annotated[bool, typer.Option("--decode", help="one decoding step against a cache of any fill")] = False,
    module: Annotated[
        str | None,
        typer.Option("--module", help="prove a user's module instead: pkg.mod:factory (called with no arguments)"),
    ] = None,
) -> None:
    """Prove every stage's named shape for all batch and seq sizes in the ranges (exit 1 if not proven)."""
    from ._module import MultiHeadAttention
    from ._prove import prove as prove_shapes

    try:
        if module is not None:
            target = _load_factory(module)
            kwargs = {}
        else:
            target = MultiHeadAttention(d_model, num_heads, num_kv_heads, d_head=d_head)
            kwargs = {"is_causal": True} if causal and not decode else {}
        proof = prove_shapes(target, batch=(1, batch_max), seq=(1, seq_max), decode=decode, **kwargs)  # pyright: ignore[reportArgumentType]
    except ShapesafeError as error:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {error}", highlight=False)
        raise typer.Exit(2) from None
    console = Console()
    console.print(proof.table())
    for failure in proof.failures:
        console.print(failure, highlight=False, soft_wrap=True)
    raise typer.Exit(0 if proof.ok else 1)


@app.callback()
def _root() -> None:
    """shapesafe_mha's command line."""


def main() -> None:
    """The console script: a bad value is one line on stderr and exit code 2, never a traceback."""
    try:
        code = typer.main.get_command(app).main(standalone_mode=False)
    except typer.Abort:
        raise SystemExit(1) from None
    except Exception as error:
        # typer ships click's usage errors (bad value, unknown option) without a public name for
        # their base class: they are the exceptions that know how to format themselves.
        if not (hasattr(error, "format_message") and hasattr(error, "exit_code")):
            raise
        context = getattr(error, "ctx", None)
        command = f" {context.info_name}" if context is not None and context.parent is not None else ""
        typer.echo(f"shapesafe-mha{command}: error: {error.format_message()}", err=True)  # pyright: ignore[reportAttributeAccessIssue]
        raise SystemExit(error.exit_code) from None  # pyright: ignore[reportAttributeAccessIssue]
    raise SystemExit(code if isinstance(code, int) else 0)
