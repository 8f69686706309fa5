"""Ours against what a user would pick today, every row measured side by side in one run.

    python -m benchmarks.contenders [--quick] [--device cuda] [--threads 1] [--rounds N] [--markdown]

Contenders: plain torch (`F.linear`, views and `F.scaled_dot_product_attention(..., enable_gqa=True)`),
Hugging Face's `LlamaAttention` (sdpa), `nn.MultiheadAttention` (MHA rows) and ours, all without biases.
Each row calls its contenders in turn, round after round, the order rotated every round; it reports each
one's median time, the median of the per-round ratios ours / best contender (the fastest by median) and
their spread (quartiles over rounds). A ratio over 1.00 whose spread reaches 1.00 is a tie.
"""

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Float
from rich.console import Console
from rich.table import Table
from torch import Tensor

import shapesafe_mha as ssm
from shapesafe_mha.dims import Tokens, Weight

Fn = Callable[[], object]


@dataclass
class Row:
    group: str
    name: str
    sizes: str
    times: dict[str, float]  # median seconds per call, ours first
    ratios: dict[str, tuple[float, float, float]]  # ours / contender per round: median, first and third quartile
    goal: float = 1.00
    where: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> str:
        others = {name: t for name, t in self.times.items() if name != "ours"}
        return min(others, key=others.__getitem__)

    @property
    def verdict(self) -> str:
        median, low, _ = self.ratios[self.best]
        if median <= self.goal:
            return "met"
        return "tie" if low <= self.goal else "NO"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 4:
        return statistics.median(values), min(values), max(values)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q2, q1, q3


def measure(contenders: dict[str, Fn], rounds: int, inner: int, sync: Callable[[], None]) -> tuple[dict, dict]:
    """Median seconds per call of each contender and per-round ratios of 'ours' to each, order rotated."""
    names = list(contenders)
    for f in contenders.values():  # warm up: first calls check, build caches, pick kernels
        for _ in range(max(2, min(inner, 5))):
            f()
    sync()
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            f = contenders[name]
            start = time.perf_counter()
            for _ in range(inner):
                f()
            sync()
            per_round[name].append((time.perf_counter() - start) / inner)
    times = {name: statistics.median(ts) for name, ts in per_round.items()}
    ratios = {
        name: quartiles([a / b for a, b in zip(per_round["ours"], per_round[name], strict=True)])
        for name in names
        if name != "ours"
    }
    return times, ratios


# --- the contenders ----------------------------------------------------------------------------------------


def plain_attention(
    module: ssm.MultiHeadAttention,
    x: torch.Tensor,
    causal: bool,
    padding: torch.Tensor | None,
) -> torch.Tensor:
    """The same layer in plain torch: bias-free projections, views, torch's own GQA kernel, one bool mask."""
    w_q, w_k, w_v, w_o = (p.weight for p in (module.q_proj, module.k_proj, module.v_proj, module.o_proj))
    q = F.linear(x, w_q).unflatten(-1, (module.num_heads, -1)).transpose(1, 2)
    k = F.linear(x, w_k).unflatten(-1, (module.num_kv_heads, -1)).transpose(1, 2)
    v = F.linear(x, w_v).unflatten(-1, (module.num_kv_heads, -1)).transpose(1, 2)
    mask = None
    if padding is not None:
        mask = ~padding[:, None, None, :]
        if causal:
            seq = x.shape[1]
            mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
    return F.linear(out.transpose(1, 2).flatten(2), w_o)


def hf_layer(d_model: int, heads: int, kv_heads: int, device: str, causal: bool = True) -> torch.nn.Module | None:
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention
    except ImportError:
        return None
    config = LlamaConfig(
        hidden_size=d_model, num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=False
    )
    config._attn_implementation = "sdpa"
    layer = LlamaAttention(config, layer_idx=0).to(device).eval()
    layer.is_causal = causal
    return layer


def identity_rotation(batch: int, seq: int, d_head: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0: HF's layer always rotates; this rotation changes nothing (its cost stays)."""
    return torch.ones(batch, seq, d_head, device=device), torch.zeros(batch, seq, d_head, device=device)


def hf_mask(padding: torch.Tensor | None, seq: int, kv_seq: int, causal: bool) -> torch.Tensor | None:
    """The 4-D bool mask (True = attend) HF's sdpa path takes; None lets it use is_causal."""
    if padding is None:
        return None
    mask = ~padding[:, None, None, :]
    if causal:
        mask = mask & torch.ones(seq, kv_seq, dtype=torch.bool, device=padding.device).tril(kv_seq - seq)
    return mask


def right_padding(batch: int, kv_seq: int, device: str) -> torch.Tensor:
    """Every other sequence padded on its last quarter (True = padding); no query row is left without a key."""
    padding = torch.zeros(batch, kv_seq, dtype=torch.bool, device=device)
    padding[1::2, kv_seq - kv_seq // 4 :] = True
    return padding


# --- rows ---------------------------------------------------------------------------------------------------

KINDS = {"MHA": 1, "GQA": 4, "MQA": 0}  # heads per KV head (0: all heads share one)


def prefill_rows(
    sizes: list[tuple[int, int, int, int]], rounds: int, device: str, sync: Callable[[], None]
) -> list[Row]:
    rows = []
    for batch, seq, d_model, heads in sizes:
        for kind, group in KINDS.items():
            kv_heads = 1 if group == 0 else heads // group
            ours = ssm.MultiHeadAttention(d_model, heads, kv_heads, bias=False, device=device).eval()
            x = torch.randn(batch, seq, d_model, device=device)
            torch_mha = None
            if kind == "MHA":
                torch_mha = torch.nn.MultiheadAttention(d_model, heads, bias=False, batch_first=True, device=device)
                torch_mha.eval()
            for masking in ("causal", "non-causal", "key-padded"):
                causal = masking != "non-causal"
                padding = right_padding(batch, seq, device) if masking == "key-padded" else None
                torch.testing.assert_close(  # the same computation, on the same weights
                    ours(x, is_causal=causal, key_padding_mask=padding),
                    plain_attention(ours, x, causal, padding),
                    atol=1e-4,
                    rtol=1e-4,
                )
                contenders: dict[str, Fn] = {
                    "ours": lambda o=ours, x=x, c=causal, p=padding: o(x, is_causal=c, key_padding_mask=p),
                    "plain torch": lambda o=ours, x=x, c=causal, p=padding: plain_attention(o, x, c, p),
                }
                hf = hf_layer(d_model, heads, kv_heads, device, causal)
                if hf is not None:
                    rotation = identity_rotation(batch, seq, d_model // heads, device)
                    mask = hf_mask(padding, seq, seq, causal)
                    contenders["HF LlamaAttention"] = lambda x=x, m=mask, hf=hf, r=rotation: hf(x, r, m)
                if torch_mha is not None:
                    # torch's bool convention (True = may not attend), the key_padding_mask's type
                    causal_mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
                    contenders["nn.MultiheadAttention"] = lambda t=torch_mha, x=x, c=causal, p=padding, m=causal_mask: (
                        t(x, x, x, attn_mask=m if c else None, is_causal=c, key_padding_mask=p, need_weights=False)
                    )
                with torch.no_grad():
                    times, ratios = measure(contenders, rounds, 1 if seq >= 128 else 10, sync)
                shape = f"({batch}, {seq}, {d_model}), {heads}/{kv_heads} heads"
                rows.append(Row("prefill", f"{kind} {masking} prefill", shape, times, ratios, where=device))
    return rows


def decode_rows(
    cached_sizes: tuple[int, ...], batches: tuple[int, ...], rounds: int, device: str, sync: Callable[[], None]
) -> list[Row]:
    d_model, heads, kv_heads = 512, 8, 2
    d_head = d_model // heads
    ours = ssm.MultiHeadAttention(d_model, heads, kv_heads, bias=False, device=device).eval()
    hf = hf_layer(d_model, heads, kv_heads, device)
    rows = []
    for cached in cached_sizes:
        for batch in batches:
            for padded in (False, True):
                past = torch.randn(batch, kv_heads, cached, d_head, device=device)
                cache = ours.new_cache(batch, cached + 1)
                cache.append(past, past)
                x = torch.randn(batch, 1, d_model, device=device)
                padding = right_padding(batch, cached + 1, device) if padded else None
                if padding is not None:
                    padding[:, -1] = False  # the new token is never padding
                keys = torch.zeros(batch, kv_heads, cached + 1, d_head, device=device)
                values = torch.zeros_like(keys)
                keys[:, :, :cached], values[:, :, :cached] = past, past

                def ours_step(cache=cache, x=x, padding=padding, cached=cached) -> object:
                    cache._length = cached
                    return ours(x, is_causal=True, kv_cache=cache, key_padding_mask=padding)

                def plain_step(keys=keys, values=values, x=x, padding=padding, cached=cached) -> object:
                    """A preallocated cache written in place, like ours; one query sees every key but padding."""
                    q = F.linear(x, ours.q_proj.weight).unflatten(-1, (heads, -1)).transpose(1, 2)
                    k = F.linear(x, ours.k_proj.weight).unflatten(-1, (kv_heads, -1)).transpose(1, 2)
                    v = F.linear(x, ours.v_proj.weight).unflatten(-1, (kv_heads, -1)).transpose(1, 2)
                    keys[:, :, cached : cached + 1] = k
                    values[:, :, cached : cached + 1] = v
                    mask = None if padding is None else ~padding[:, None, None, :]
                    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
                    return F.linear(out.transpose(1, 2).flatten(2), ours.o_proj.weight)

                contenders: dict[str, Fn] = {"ours": ours_step, "plain torch": plain_step}
                if hf is not None:
                    from transformers import DynamicCache

                    hf_cache = DynamicCache()
                    hf_cache.update(past.clone(), past.clone(), 0)
                    rotation = identity_rotation(batch, 1, d_head, device)
                    mask = hf_mask(padding, 1, cached + 1, True)

                    def hf_step(hf_cache=hf_cache, x=x, rotation=rotation, mask=mask) -> object:
                        out = hf(x, rotation, mask, cache=hf_cache)  # pyright: ignore[reportOptionalCall]
                        hf_cache.crop(-1)  # rewind: each call decodes the same position
                        return out

                    contenders["HF LlamaAttention"] = hf_step
                with torch.no_grad():
                    times, ratios = measure(contenders, rounds, 20, sync)
                name = f"GQA decode, {cached} cached, batch {batch}" + (", padding mask" if padded else "")
                rows.append(Row("decode", name, "d_model 512, 8/2 heads", times, ratios, where=device))
    return rows


def training_rows(batch: int, seq: int, rounds: int, device: str, sync: Callable[[], None]) -> list[Row]:
    return [
        training_row(kind, kv_heads, batch, seq, rounds, device, sync) for kind, kv_heads in (("MHA", 8), ("GQA", 2))
    ]


def step(forward: Callable[[], torch.Tensor], module: torch.nn.Module) -> Fn:
    """A training step: gradients cleared, forward, a loss, backward."""

    def run() -> object:
        module.zero_grad(set_to_none=True)
        out = forward()
        out.square().mean().backward()
        return out

    return run


def training_row(
    kind: str, kv_heads: int, batch: int, seq: int, rounds: int, device: str, sync: Callable[[], None]
) -> Row:
    d_model, heads = 512, 8
    ours = ssm.MultiHeadAttention(d_model, heads, kv_heads, bias=False, device=device)
    x = torch.randn(batch, seq, d_model, device=device)

    contenders: dict[str, Fn] = {
        "ours": step(lambda: ours(x, is_causal=True), ours),
        "plain torch": step(lambda: plain_attention(ours, x, True, None), ours),
    }
    hf = hf_layer(d_model, heads, kv_heads, device)
    if hf is not None:
        hf.train()
        rotation = identity_rotation(batch, seq, d_model // heads, device)
        contenders["HF LlamaAttention"] = step(lambda hf=hf: hf(x, rotation, None)[0], hf)
    if kind == "MHA":
        torch_mha = torch.nn.MultiheadAttention(d_model, heads, bias=False, batch_first=True, device=device)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=torch.device(device))
        contenders["nn.MultiheadAttention"] = step(
            lambda: torch_mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0], torch_mha
        )
    times, ratios = measure(contenders, rounds, 1, sync)
    shape = f"({batch}, {seq}, {d_model}), {heads}/{kv_heads} heads, causal"
    return Row("training", f"{kind} training step (forward + backward)", shape, times, ratios, where=device)


def stage_rows(rounds: int, device: str, sync: Callable[[], None]) -> list[Row]:
    """Our public stages composed into a GQA layer, against the same composition in plain torch."""
    batch, seq, d_model, heads, kv_heads = 1, 16, 256, 8, 2
    d_head = d_model // heads
    x = torch.randn(batch, seq, d_model, device=device)
    w_q = torch.randn(heads * d_head, d_model, device=device) / math.sqrt(d_model)
    w_k, w_v = (torch.randn(kv_heads * d_head, d_model, device=device) / math.sqrt(d_model) for _ in range(2))
    w_o = torch.randn(d_model, heads * d_head, device=device) / math.sqrt(d_model)

    def ours() -> torch.Tensor:
        q = ssm.split_heads(ssm.project(x, w_q), heads)
        k = ssm.split_heads(ssm.project(x, w_k), kv_heads)
        v = ssm.split_heads(ssm.project(x, w_v), kv_heads)
        return ssm.project(ssm.merge_heads(ssm.scaled_dot_product_attention(q, k, v, is_causal=True)), w_o)

    def plain() -> torch.Tensor:
        q = F.linear(x, w_q).unflatten(-1, (heads, -1)).transpose(1, 2)
        k = F.linear(x, w_k).unflatten(-1, (kv_heads, -1)).transpose(1, 2)
        v = F.linear(x, w_v).unflatten(-1, (kv_heads, -1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(out.transpose(1, 2).flatten(2), w_o)

    kv_weight = Float[Tensor, "d_kv d_model"]

    @ssm.shapecheck
    def layer(x: Tokens, w_q: Float[Tensor, "d_q d_model"], w_k: kv_weight, w_v: kv_weight, w_o: Weight) -> Tokens:
        q = ssm.split_heads(ssm.project(x, w_q), heads)
        k = ssm.split_heads(ssm.project(x, w_k), kv_heads)
        v = ssm.split_heads(ssm.project(x, w_v), kv_heads)
        return ssm.project(ssm.merge_heads(ssm.scaled_dot_product_attention(q, k, v, is_causal=True)), w_o)

    def decorated() -> torch.Tensor:
        return layer(x, w_q, w_k, w_v, w_o)

    torch.testing.assert_close(ours(), plain())
    torch.testing.assert_close(decorated(), plain())
    q = torch.randn(batch, heads, seq, d_head, device=device)
    k = torch.randn(batch, kv_heads, seq, d_head, device=device)
    rows = []
    with torch.no_grad():
        times, ratios = measure({"ours": ours, "plain torch": plain}, rounds, 50, sync)
        rows.append(
            Row("stages", "public stages composed", "GQA (1, 16, 256), 8/2 heads, causal", times, ratios, 1.05, device)
        )
        # the same stages inside one decorated function: its remembered verdict covers them (one key, not six)
        times, ratios = measure({"ours": decorated, "plain torch": plain}, rounds, 50, sync)
        where = "GQA (1, 16, 256), 8/2 heads, causal"
        rows.append(Row("stages", "public stages in a decorated function", where, times, ratios, 1.03, device))
        times, ratios = measure(
            {
                "ours": lambda: ssm.scaled_dot_product_attention(q, k, k, is_causal=True),
                "plain torch": lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True),
            },
            rounds,
            50,
            sync,
        )
        rows.append(
            Row("stages", "scaled_dot_product_attention alone", "(1, 8/2, 16, 32), causal", times, ratios, 1.05, device)
        )
    return rows


def overhead_rows(rounds: int, devices: tuple[str, ...], sync: Callable[[], None]) -> list[Row]:
    """The cost of a call when compute is free: `meta` tensors (no kernel runs) and tiny CPU inputs."""
    rows = []
    for device in devices:
        for kind, kv_heads in (("MHA", 4), ("GQA", 2)):
            d_model, heads, batch, seq = 64, 4, 1, 4
            ours = ssm.MultiHeadAttention(d_model, heads, kv_heads, bias=False, device=device).eval()
            x = torch.randn(batch, seq, d_model, device=device)
            contenders: dict[str, Fn] = {
                "ours": lambda ours=ours, x=x: ours(x, is_causal=True),
                "plain torch": lambda ours=ours, x=x: plain_attention(ours, x, True, None),
            }
            hf = hf_layer(d_model, heads, kv_heads, device)
            if hf is not None:
                rotation = identity_rotation(batch, seq, d_model // heads, device)
                contenders["HF LlamaAttention"] = lambda hf=hf, x=x, r=rotation: hf(x, r, None)
            if kind == "MHA":
                torch_mha = torch.nn.MultiheadAttention(d_model, heads, bias=False, batch_first=True, device=device)
                mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=torch.device(device))
                contenders["nn.MultiheadAttention"] = lambda m=torch_mha, x=x, mask=mask: m(
                    x, x, x, attn_mask=mask, is_causal=True, need_weights=False
                )
            with torch.no_grad():
                times, ratios = measure(contenders, rounds, 200, sync if device != "meta" else lambda: None)
            row = Row("overhead", f"{kind} per-call cost ({device})", "(1, 4, 64), 4 heads, causal", times, ratios)
            row.where = device
            rows.append(row)
    return rows


def decision_rows(rounds: int, device: str, sync: Callable[[], None], quick: bool) -> list[Row]:
    """Why the decision table folds where it does: our module forced onto torch's GQA kernel / forced to fold
    (the 'ours' column here is the forced native call; the module itself takes the faster of the two)."""
    from shapesafe_mha._compute import kernels as _kernels

    decided = _kernels.native_gqa

    def forced(f: Fn, native: bool) -> Fn:
        """`f` with the decision replaced: torch's kernel for every GQA call (no dropout here), or none."""

        def run() -> object:
            _kernels.native_gqa = lambda q, k, dropout_p: native or q.shape[1] == k.shape[1]
            try:
                return f()
            finally:
                _kernels.native_gqa = decided

        return run

    d_model, heads, kv_heads = (64, 4, 2) if quick else (512, 8, 2)
    module = ssm.MultiHeadAttention(d_model, heads, kv_heads, bias=False, device=device).eval()
    rows = []
    cases = [(2, 16 if quick else 128, 0), (1, 1, 16 if quick else 4096), (4, 1, 16 if quick else 4096)]
    for batch, seq, cached in cases:
        for padded in (False, True):
            x = torch.randn(batch, seq, d_model, device=device)
            padding = right_padding(batch, cached + seq, device) if padded else None
            if padding is not None:
                padding[:, -1] = False
            cache = None
            if cached:
                cache = module.new_cache(batch, cached + seq)
                past = torch.randn(batch, kv_heads, cached, d_model // heads, device=device)
                cache.append(past, past)

            def call(x=x, padding=padding, cache=cache, cached=cached) -> object:
                if cache is not None:
                    cache._length = cached
                return module(x, is_causal=True, kv_cache=cache, key_padding_mask=padding)

            with torch.no_grad():
                times, ratios = measure(
                    {"ours": forced(call, True), "folded": forced(call, False)}, rounds, 10 if cached else 2, sync
                )
            name = ("decode" if cached else "causal prefill") + (", padding mask" if padded else "")
            sizes = (
                f"batch {batch}, seq {seq}" + (f", {cached} cached" if cached else "") + f", {heads}/{kv_heads} heads"
            )
            row = Row("decision", f"torch's GQA kernel / folded: {name}", sizes, times, ratios, where=device)
            rows.append(row)
    return rows


# --- output -------------------------------------------------------------------------------------------------


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def print_table(rows: list[Row], title: str, markdown: bool) -> None:
    contenders = ["plain torch", "HF LlamaAttention", "nn.MultiheadAttention", "folded"]
    contenders = [c for c in contenders if any(c in row.times for row in rows)]
    header = ["row", "sizes", "ours", *contenders, "best", "ours / best", "spread", "goal", "verdict"]
    lines = []
    for row in rows:
        median, low, high = row.ratios[row.best]
        cells = [row.name, row.sizes, us(row.times["ours"])]
        cells += [us(row.times[c]) if c in row.times else "-" for c in contenders]
        cells += [row.best, f"{median:.3f}", f"{low:.3f}-{high:.3f}", f"<= {row.goal:.2f}", row.verdict]
        if row.group == "decision":  # which of the two the table should pick, not a goal
            verdict = {"met": "native faster", "tie": "tie", "NO": "fold faster"}[row.verdict]
            cells[-2], cells[-1] = "-", verdict
        if row.group == "overhead":
            gap = row.times["ours"] - row.times["plain torch"]
            cells[-2], cells[-1] = "ours - plain <= 3 us", f"{gap * 1e6:+.1f} us: {'met' if gap <= 3e-6 else 'NO'}"
        lines.append(cells)
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
        return
    table = Table(title=title)
    for column in header:
        table.add_column(column)
    for cells in lines:
        table.add_row(*cells)
    Console(width=250).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds: runs in seconds")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1: least noise)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per row (default 15; 3 with --quick)")
    parser.add_argument("--only", default=None, help="only the rows of this group (prefill, decode, ...)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (docs/performance.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rounds = args.rounds or (3 if args.quick else 15)
    if args.quick:
        prefill_sizes = [(1, 16, 64, 4)]
        cached, batches, train = (16,), (1, 2), (1, 16)
    else:
        prefill_sizes = [(2, 128, 512, 8), (1, 512, 1024, 16)]
        cached, batches, train = (256, 4096), (1, 4), (4, 128)
    groups: dict[str, Callable[[], list[Row]]] = {
        "prefill": lambda: prefill_rows(prefill_sizes, rounds, device, sync),
        "decode": lambda: decode_rows(cached, batches, rounds, device, sync),
        "training": lambda: training_rows(*train, rounds, device, sync),
        "stages": lambda: stage_rows(rounds, device, sync),
        "overhead": lambda: overhead_rows(rounds, ("meta", device), sync),
        "decision": lambda: decision_rows(rounds, device, sync, args.quick),
    }
    where = f"torch {torch.__version__}, {device}" + (f", {args.threads} thread(s)" if device == "cpu" else "")
    for group, run in groups.items():
        if args.only is None or args.only == group:
            print_table(run(), f"{group}: {where}, median of {rounds} rotated rounds", args.markdown)


if __name__ == "__main__":
    main()
