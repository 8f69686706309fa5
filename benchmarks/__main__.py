"""Checked attention at the speed of unchecked torch: every comparison as a ratio measured side by side.

    python -m benchmarks [--quick] [--rounds N] [--threads 1] [--record docs/overhead.json]

Each comparison runs its two contenders alternately, round after round, and reports the median of
the per-round ratios (robust to a shared, noisy machine) next to each contender's median time.
"""

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import shapesafe_mha as ssm
from shapesafe_mha._compute import fastpath as _fastpath
from shapesafe_mha._core import contract as _contract


@dataclass
class Comparison:
    name: str
    sizes: str
    ratio: float
    ours: float
    baseline: float
    goal: str

    @property
    def met(self) -> bool:
        return self.ratio <= float(self.goal.removeprefix("<= "))


Run = Callable[[], object] | tuple[Callable[[], object], Callable[[], AbstractContextManager[object]]]


def measure(ours: Run, baseline: Run, rounds: int, inner: int) -> tuple[float, float, float]:
    """Median per-round ratio ours/baseline, and each one's median seconds per call.

    A contender may be `(function, context)`: the context (say `ssm.unchecked`) is entered once
    around each round's calls, as a user would, not once per call.
    """
    ratios, a, b = rounds_of(ours, baseline, rounds, inner)
    return statistics.median(ratios), statistics.median(a), statistics.median(b)


def rounds_of(ours: Run, baseline: Run, rounds: int, inner: int) -> tuple[list[float], list[float], list[float]]:
    """Each round's ratio ours/baseline and each one's seconds per call (`measure` takes their medians)."""
    contenders = [c if isinstance(c, tuple) else (c, contextlib.nullcontext) for c in (ours, baseline)]
    for f, context in contenders:
        with context():
            for _ in range(max(3, inner)):
                f()
    ratios, a, b = [], [], []
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        times = {}
        for f, context in order:
            with context():
                start = time.perf_counter()
                for _ in range(inner):
                    f()
                times[f] = (time.perf_counter() - start) / inner
        ours_f, base_f = contenders[0][0], contenders[1][0]
        ratios.append(times[ours_f] / times[base_f])
        a.append(times[ours_f])
        b.append(times[base_f])
    return ratios, a, b


def unchecked(f: Callable[[], object]) -> Run:
    return (lambda: f(), ssm.unchecked)


@contextlib.contextmanager
def switch_removed() -> Iterator[None]:
    """The module's forward with its one check switch replaced by a constant: code with no checks at all."""
    original = _contract.checks_enabled
    _contract.checks_enabled = lambda: False  # the switch the module's forward reads (remembered_forward)
    try:
        yield
    finally:
        _contract.checks_enabled = original


@contextlib.contextmanager
def fast_paths_removed() -> Iterator[None]:
    """The module with its fused-QKV fast path switched off: every projection through its submodule."""
    original = _fastpath.fused_qkv
    _fastpath.fused_qkv = lambda *args: None  # what choose_path builds the fused weight with
    try:
        yield
    finally:
        _fastpath.fused_qkv = original


def padded_generation(module: ssm.MultiHeadAttention, batch: int, prompt: int, steps: int) -> Callable[[], object]:
    """A left-padded batch: prefill, then `steps` tokens, each with a key_padding_mask one position longer."""
    d_model = module.d_model
    cache = module.new_cache(batch, prompt + steps)
    x = torch.randn(batch, prompt, d_model)
    tokens = torch.randn(steps, batch, 1, d_model)
    padding = torch.zeros(batch, prompt + steps, dtype=torch.bool)
    for row in range(batch):
        padding[row, : 3 * row] = True  # row r has 3r padding positions on the left

    def generate() -> object:
        cache.reset()
        module(x, is_causal=True, kv_cache=cache, key_padding_mask=padding[:, :prompt])
        for t in range(steps):
            module(tokens[t], is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : prompt + t + 1])
        return cache

    return generate


def training_step(module: torch.nn.Module, x: torch.Tensor, ours: bool) -> Callable[[], object]:
    """Forward (causal) and backward, gradients cleared each time."""
    seq = x.shape[1]
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)

    def step() -> object:
        module.zero_grad(set_to_none=True)
        if ours:
            out = module(x, is_causal=True)
        else:
            out = module(x, x, x, attn_mask=causal_mask, is_causal=True, need_weights=False)[0]
        out.square().mean().backward()
        return out

    return step


def decode_step(module: ssm.MultiHeadAttention, cached: int) -> Callable[[], object]:
    """One new token against a cache already holding `cached` positions (the cache is rewound each call)."""
    cache = module.new_cache(1, cached + 1)
    past = torch.randn(1, module.num_kv_heads, cached, module.d_head)
    cache.append(past, past)
    x = torch.randn(1, 1, module.d_model)

    def step() -> object:
        cache._length = cached
        return module(x, is_causal=True, kv_cache=cache)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: least noise)")
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        help="save the checked/unchecked sweep here as JSON (python tools/pictures.py draws docs/overhead.svg from it)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile comparison")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per comparison (default 60; 15 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds = args.rounds or (15 if args.quick else 60)
    results: list[Comparison] = []

    with torch.no_grad():
        # 1. Decode step, checks on vs off; and a left-padded batched generation (kv_seq grows a step).
        gqa = ssm.MultiHeadAttention(512, 8, 2).eval()
        step = decode_step(gqa, 256)
        ratio, a, b = measure(step, unchecked(step), rounds, 20)
        results.append(
            Comparison("decode: checked / unchecked", "GQA d_model 512, 8/2 heads, cache 256", ratio, a, b, "<= 1.05")
        )
        rope = ssm.MultiHeadAttention(512, 8, 2, rope_theta=10000.0).eval()
        rope_step = decode_step(rope, 256)
        ratio, a, b = measure(rope_step, unchecked(rope_step), rounds, 20)
        results.append(
            Comparison(
                "RoPE decode: checked / unchecked", "GQA 512, 8/2 heads, RoPE, cache 256", ratio, a, b, "<= 1.05"
            )
        )
        generate = padded_generation(gqa, batch=4, prompt=16, steps=48)
        ratio, a, b = measure(generate, unchecked(generate), rounds // 2, 1)
        results.append(
            Comparison(
                "padded generation: checked / unchecked",
                "GQA 512, 8/2 heads, B=4, 16 + 48 steps, growing key_padding_mask",
                ratio,
                a,
                b,
                "<= 1.05",
            )
        )

        # 2. Prefill, checks on vs nn.MultiheadAttention.
        theirs = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
        ours = ssm.MultiHeadAttention.from_torch(theirs).eval()
        x = torch.randn(2, 128, 512)
        # Both sides run the same kernel here, so the difference is small: more rounds resolve it.
        ratio, a, b = measure(lambda: ours(x), lambda: theirs(x, x, x, need_weights=False), 4 * rounds, 1)
        results.append(
            Comparison("prefill: ours checked / nn.MHA", "MHA (2, 128, 512), 8 heads", ratio, a, b, "<= 1.00")
        )

        long = torch.randn(1, 1024, 512)
        ratio, a, b = measure(lambda: ours(long), lambda: theirs(long, long, long, need_weights=False), rounds // 4, 1)
        results.append(Comparison("long prefill: ours / nn.MHA", "MHA (1, 1024, 512), 8 heads", ratio, a, b, "<= 1.00"))

        # 3. torch.compile: ours (fullgraph) vs nn.MultiheadAttention, both compiled.
        if not args.no_compile:
            ours_c = torch.compile(ours, fullgraph=True)
            theirs_c = torch.compile(theirs)
            ratio, a, b = measure(lambda: ours_c(x), lambda: theirs_c(x, x, x, need_weights=False), rounds, 1)
            results.append(Comparison("compiled: ours / nn.MHA", "MHA (2, 128, 512), 8 heads", ratio, a, b, "<= 1.05"))

        # 4. Checks off vs no decorators at all.
        mha = ssm.MultiHeadAttention(512, 8, 2).eval()
        xs = torch.randn(1, 32, 512)
        forward = lambda: mha(xs, is_causal=True)  # noqa: E731
        ratio, a, b = measure(unchecked(forward), (forward, switch_removed), rounds, 5)
        results.append(Comparison("checks off / no checks", "GQA (1, 32, 512), 8/2 heads", ratio, a, b, "<= 1.02"))

        # Checked / unchecked across sizes, for the plot.
        sizes = {
            "tiny (1, 16, 64)": (64, 4, 2, (1, 16)),
            "decode (1 token, cache 256)": None,
            "prefill (2, 128, 512)": (512, 8, 2, (2, 128)),
            "long (1, 1024, 512)": (512, 8, 2, (1, 1024)),
        }
        overhead: list[tuple[str, float, float]] = []
        for label, spec in sizes.items():
            if spec is None:
                f = step
            else:
                d_model, heads, kv_heads, (batch, seq) = spec
                module = ssm.MultiHeadAttention(d_model, heads, kv_heads).eval()
                inp = torch.randn(batch, seq, d_model)
                f = lambda module=module, inp=inp: module(inp, is_causal=True)  # noqa: E731
            inner = 20 if spec is None or spec[3][1] <= 16 else 2
            ratio, a, b = measure(f, unchecked(f), rounds, inner)
            overhead.append((label, ratio, b))

    # 5. A training step (forward + backward, causal) against nn.MultiheadAttention.
    theirs_t = torch.nn.MultiheadAttention(512, 8, batch_first=True)
    ours_t = ssm.MultiHeadAttention.from_torch(theirs_t)
    xt = torch.randn(4, 128, 512)
    ratio, a, b = measure(training_step(ours_t, xt, True), training_step(theirs_t, xt, False), rounds // 2, 1)
    sizes = "MHA (4, 128, 512), 8 heads, causal"
    results.append(Comparison("training step: ours / nn.MHA", sizes, ratio, a, b, "<= 1.00"))

    # 6. LoRA adapters on q/v: the module against itself with its fast path removed by hand.
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:
        adapted = peft.get_peft_model(
            ssm.MultiHeadAttention(512, 8, 2), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=8)
        ).eval()
        xl = torch.randn(2, 64, 512)
        with torch.no_grad():
            run = lambda: adapted(xl, is_causal=True)  # noqa: E731
            run_unfused = lambda: adapted(xl, is_causal=True)  # noqa: E731  (a distinct contender)
            ratio, a, b = measure(run, (run_unfused, fast_paths_removed), rounds, 2)
        results.append(
            Comparison("LoRA q/v: ours / unfused path", "GQA (2, 64, 512), 8/2 heads, r=8", ratio, a, b, "<= 1.01")
        )

    console = Console(width=150)
    table = Table(title=f"shapesafe_mha performance ({args.threads} thread(s), median of {rounds} alternating rounds)")
    for column in ("comparison", "sizes", "ratio", "goal", "met", "ours (median)", "baseline (median)"):
        table.add_column(
            column, justify="right" if column in ("ratio", "ours (median)", "baseline (median)") else "left"
        )
    for c in results:
        table.add_row(
            c.name,
            c.sizes,
            f"{c.ratio:.3f}",
            c.goal,
            "yes" if c.met else "NO",
            f"{c.ours * 1e6:.1f} us",
            f"{c.baseline * 1e6:.1f} us",
        )
    console.print(table)
    sweep = Table(title="checked / unchecked by size")
    for column in ("size", "ratio", "unchecked (median)"):
        sweep.add_column(column, justify="left" if column == "size" else "right")
    for label, ratio, base in overhead:
        sweep.add_row(label, f"{ratio:.3f}", f"{base * 1e6:.1f} us")
    console.print(sweep)
    if args.record is not None:
        record(overhead, args.record)
        console.print(f"sweep recorded in {args.record}")


def record(overhead: list[tuple[str, float, float]], path: Path) -> None:
    """The checked/unchecked sweep as JSON: one entry per size, with its ratio and unchecked time."""
    rows = [
        {"size": label, "ratio": round(ratio, 4), "unchecked_us": round(base * 1e6, 1)}
        for label, ratio, base in overhead
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
