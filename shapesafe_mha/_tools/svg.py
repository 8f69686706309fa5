"""Pictures of attention as SVG text, drawn from what the code does (a trace, the stages' own views).

No drawing library: every picture is rectangles, lines and monospace text, laid out by counting
characters, so the same input always gives the same bytes (the docs test that their pictures are
current by drawing them again). `shapesafe-mha trace --format svg` draws `pipeline`; the docs'
`tools/pictures.py` draws the others.
"""

import itertools
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any
from xml.sax.saxutils import escape

import torch

from .._compute.stages import group_queries, split_heads
from .._core.trace import Stage
from .report import TraceReport

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', 'Liberation Mono', monospace"
SIZE = 13  # px
ADVANCE = 0.62  # a monospace character's width per px of font size (0.6 in most fonts), with room to spare
INK, MUTED, LINE = "#1f2328", "#57606a", "#8c959f"
VIEW, NEW, INPUT, KV = "#1a7f37", "#bc4c00", "#57606a", "#8250df"
# Pale fills, one per storage (a buffer and every view of it share one).
FILLS = ("#ddf4ff", "#fff1e5", "#dafbe1", "#fbefff", "#fff8c5", "#ffebe9", "#e7ecf0", "#d8f3f0")
# Strong colours, one per head.
HEADS = ("#0969da", "#bf3989", "#1a7f37", "#bc4c00", "#8250df", "#cf222e", "#0a7d8c", "#9a6700")


def _width(text: str, size: float = SIZE) -> float:
    return len(text) * ADVANCE * size


class Canvas:
    """An SVG document built element by element; it grows to hold everything drawn on it."""

    def __init__(self, pad: float = 16) -> None:
        self.parts: list[str] = []
        self.pad = pad
        self.right = 0.0
        self.bottom = 0.0

    def _extend(self, right: float, bottom: float) -> None:
        self.right, self.bottom = max(self.right, right), max(self.bottom, bottom)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "none", rx: float = 0) -> None:
        self._extend(x + w, y + h)
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx:g}" fill="{fill}" '
            f'stroke="{stroke}"/>'
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = LINE, width: float = 1) -> None:
        self._extend(max(x1, x2), max(y1, y2))
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{stroke}" stroke-width="{width:g}"/>'
        )

    def text(
        self,
        x: float,
        y: float,
        text: str | Sequence[tuple[str, str]],
        fill: str = INK,
        size: float = SIZE,
        anchor: str = "start",
        bold: bool = False,
    ) -> None:
        """`text` at baseline `y`; a sequence of (text, colour) pieces is one line in several colours."""
        pieces = [(text, fill)] if isinstance(text, str) else list(text)
        length = _width("".join(t for t, _ in pieces), size)
        self._extend(x + {"start": length, "middle": length / 2, "end": 0.0}[anchor], y + 0.3 * size)
        body = "".join(
            escape(t) if colour == fill else f'<tspan fill="{colour}">{escape(t)}</tspan>' for t, colour in pieces
        )
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size:g}" fill="{fill}" text-anchor="{anchor}"{weight}>'
            f"{body}</text>"
        )

    def svg(self, title: str) -> str:
        """The document: a white page just large enough for what was drawn, `title` for screen readers."""
        width, height = self.right + self.pad, self.bottom + self.pad
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}" role="img">\n'
            f"<title>{escape(title)}</title>\n"
            f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>\n'
        )
        return head + "\n".join(self.parts) + "\n</svg>\n"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _title(report: TraceReport) -> str:
    return f"{report.heading()} ({report.config['dtype']})"


def _highlighted(named_shape: str) -> list[tuple[str, str]]:
    """`named_shape` in pieces, `num_kv_heads` (and a rank's `local_kv_heads`) in the K/V colour."""
    pieces: list[tuple[str, str]] = []
    for i, word in enumerate(re.split(r"(\w+)", named_shape)):
        pieces.append((word, KV if i % 2 and word in ("num_kv_heads", "local_kv_heads") else INK))
    return [p for p in pieces if p[0]]


def pipeline(report: TraceReport, *, narrow: bool = False) -> str:
    """The stages of a traced forward, top to bottom, as an SVG picture.

    One row per stage: its name, named shape (`num_kv_heads` highlighted) and shape; whether it
    is a view of an earlier stage (green), a new allocation (orange) or an input (grey); and a bar
    of its bytes, to scale. Rows whose tensors share one storage (a buffer and all its views) have
    one background colour. Below: the KV cache against MHA's and MQA's. `narrow`: the same in one
    column, about 360 px wide, for a phone's screen (each row's facts on three lines).

    Example:
        >>> from shapesafe_mha import TraceConfig, trace_forward
        >>> svg = pipeline(trace_forward(TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4)))
        >>> svg.startswith("<svg"), "view of qkv_proj" in svg
        (True, True)
    """
    stages = report.stages
    owner: dict[str, str] = {}  # stage -> the stage that owns its storage
    for s in stages:
        owner[s.name] = owner.get(s.aliases, s.aliases) if s.aliases else s.name
    owners = list(dict.fromkeys(owner.values()))

    def storage(s: Stage) -> tuple[str, str]:
        return s.storage, VIEW if s.aliases else INPUT if s.is_input else NEW

    def fill(s: Stage) -> str:
        return FILLS[owners.index(owner[s.name]) % len(FILLS)]

    if narrow:
        return _narrow_pipeline(report, storage, fill)
    totals = report.totals

    firsts = [(s.name, storage(s)[0]) for s in stages]
    seconds = [(s.named_shape, str(tuple(s.shape))) for s in stages]
    heads = [("stage", "storage"), ("named shape", "shape")]
    widths = [max(_width(row[i]) for row in [*heads, *firsts, *seconds]) + 28 for i in range(2)]
    pad, bar, row_h, top = 16.0, 140.0, 44.0, 112.0
    xs = [pad + 10, pad + 10 + widths[0], pad + 10 + widths[0] + widths[1]]
    right = xs[2] + bar + _width(" 000.0 KiB") + 12
    largest = max((s.nbytes for s in stages), default=1) or 1

    c = Canvas(pad)
    title = _title(report)
    c.text(pad, 28, "The stages of one forward, as traced", size=16, bold=True)
    c.text(pad, 50, title, fill=MUTED)
    for x, (first, second) in zip(xs, [*zip(*heads, strict=True), ("bytes", "")], strict=True):
        c.text(x, top - 30, first, fill=MUTED, bold=True)
        c.text(x, top - 12, second, fill=MUTED)
    c.line(pad, top, right, top)
    for i, s in enumerate(stages):
        y = top + i * row_h
        c.rect(pad, y + 2, right - pad, row_h - 4, fill(s), rx=4)
        c.text(xs[0], y + 19, s.name, bold=True)
        c.text(xs[0], y + 36, _highlighted(s.named_shape))
        c.text(xs[1], y + 19, storage(s)[0], fill=storage(s)[1])
        c.text(xs[1], y + 36, str(tuple(s.shape)), fill=MUTED)
        filled = max(2.0, bar * s.nbytes / largest)
        c.rect(xs[2], y + 16, filled, 12, MUTED, rx=2)
        c.text(xs[2] + 8 + filled, y + 27, _bytes(s.nbytes), fill=MUTED)
    bottom = top + row_h * len(stages)
    c.line(pad, bottom, right, bottom)
    if totals:
        c.text(pad, bottom + 28, [*_cache_line(totals)[0], *_cache_line(totals)[1]], bold=True)
    for i, line in enumerate(LEGEND):
        c.text(pad, bottom + 52 + 20 * i, line, fill=MUTED)
    return c.svg(f"The stages of one forward: {title}")


LEGEND = (
    "One background colour: one storage (a buffer and its views).",
    "Bars: each stage's tensor, to scale. num_kv_heads in purple.",
    "Observed, not assumed: storage identity and every operator's allocations.",
)


def _cache_line(totals: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The KV cache's size against MHA's and MQA's, in two pieces (one line each in the narrow picture)."""
    first = [(f"KV cache for {totals['kv_cache_positions']} positions: ", INK), (_bytes(totals["kv_cache_bytes"]), KV)]
    return first, [(f"  (MHA {_bytes(totals['kv_cache_bytes_mha'])}, MQA {_bytes(totals['kv_cache_bytes_mqa'])})", INK)]


def _narrow_pipeline(
    report: TraceReport, storage: Callable[[Stage], tuple[str, str]], fill: Callable[[Stage], str]
) -> str:
    """`pipeline` in one column: name and storage, then the named shape, then shape and bytes."""
    size, pad, row_h, top, bar = 12.0, 12.0, 58.0, 0.0, 90.0
    chars = 44  # 360 px wide in all: a phone's text column at 400 px
    c = Canvas(pad)
    y = 24.0
    c.text(pad, y, "The stages of one forward, as traced", size=15, bold=True)
    for line in textwrap.wrap(_title(report), chars):
        y += 18
        c.text(pad, y, line, fill=MUTED, size=size)
    top = y + 14
    largest = max((s.nbytes for s in report.stages), default=1) or 1
    right = pad + 10 + _width("x" * chars, size)
    bars_at = pad + 8 + _width(max((str(tuple(s.shape)) for s in report.stages), key=len) + "  ", size)
    for i, s in enumerate(report.stages):
        y = top + i * row_h
        c.rect(pad, y + 2, right - pad, row_h - 4, fill(s), rx=4)
        c.text(pad + 8, y + 18, [(s.name, INK), ("  ", INK), (storage(s)[0], storage(s)[1])], size=size, bold=True)
        c.text(pad + 8, y + 34, _highlighted(s.named_shape), size=size)
        c.text(pad + 8, y + 50, str(tuple(s.shape)), fill=MUTED, size=size)
        x = bars_at
        filled = max(2.0, bar * s.nbytes / largest)
        c.rect(x, y + 41, filled, 10, MUTED, rx=2)
        c.text(x + 6 + filled, y + 50, _bytes(s.nbytes), fill=MUTED, size=size)
    y = top + row_h * len(report.stages) + 8
    if report.totals:
        for piece in _cache_line(report.totals):
            y += 18
            c.text(pad, y, piece, size=size, bold=True)
    for line in (w for legend in LEGEND for w in textwrap.wrap(legend, chars)):
        y += 17
        c.text(pad, y, line, fill=MUTED, size=size)
    return c.svg(f"The stages of one forward: {_title(report)}")


def _grid(c: Canvas, x: float, y: float, values: list[list[int]], colours: list[list[str]], cell: float) -> None:
    """A grid of numbered cells, each outlined in its colour."""
    for r, row in enumerate(values):
        for col, value in enumerate(row):
            colour = colours[r][col]
            c.rect(x + col * cell, y + r * cell, cell - 4, cell - 4, "#ffffff", stroke=colour, rx=3)
            c.text(x + col * cell + (cell - 4) / 2, y + r * cell + cell / 2 + 2, str(value), colour, 12, "middle")


def head_split(seq: int = 3, num_heads: int = 4, d_head: int = 3) -> str:
    """`split_heads` as a view: the projected buffer, and each head's matrix read out of it in place.

    The numbers are storage offsets, read from the view `split_heads` returns (the buffer is
    `arange`, so each element is its own offset): the picture shows what the code does.

    Example:
        >>> "strides (36, 3, 12, 1)" in head_split(seq=3, num_heads=4, d_head=3)
        True
    """
    inner = num_heads * d_head
    buffer = torch.arange(seq * inner, dtype=torch.float32).view(1, seq, inner)
    heads = split_heads(buffer, num_heads)
    colour = [HEADS[h % len(HEADS)] for h in range(num_heads)]
    pad, cell, left = 16.0, 32.0, 56.0
    c = Canvas(pad)
    c.text(pad, 28, "split_heads: one buffer, relabelled, not copied", size=16, bold=True)
    c.text(pad, 50, "The numbers are storage offsets: where each element lives in memory.", fill=MUTED)

    top = 84.0
    c.text(pad, top, f"x: (batch=1, seq={seq}, num_heads*d_head={inner}), strides {tuple(buffer.stride())}", bold=True)
    grid_y = top + 14
    values = [[int(v) for v in row] for row in buffer[0].tolist()]
    _grid(c, left, grid_y, values, [[colour[j // d_head] for j in range(inner)] for _ in range(seq)], cell)
    for r in range(seq):
        c.text(pad, grid_y + r * cell + cell / 2 + 2, f"s={r}", MUTED, 12)
    for h in range(num_heads):
        c.text(
            left + (h * d_head + d_head / 2) * cell - 2, grid_y + seq * cell + 12, f"head {h}", colour[h], 12, "middle"
        )

    view_y = grid_y + seq * cell + 64
    shape, strides = tuple(heads.shape), tuple(heads.stride())
    c.text(pad, view_y, f"split_heads(x, {num_heads}): shape {shape}, strides {strides}, the same storage", bold=True)
    block = d_head * cell + 28
    for h in range(num_heads):
        x = left + h * block
        c.text(x, view_y + 24, f"[0, {h}]: head {h}", colour[h], 12)
        offsets = [[int(v) for v in row] for row in heads[0, h].tolist()]
        _grid(c, x, view_y + 34, offsets, [[colour[h]] * d_head for _ in range(seq)], cell)
    for r in range(seq):
        c.text(pad, view_y + 34 + r * cell + cell / 2 + 2, f"s={r}", MUTED, 12)
    c.text(
        pad,
        view_y + 34 + seq * cell + 22,
        f"Head h reads columns h*d_head .. h*d_head+{d_head - 1} of every row: a stride of "
        f"num_heads*d_head = {inner} from one position to the next.",
        MUTED,
        12,
    )
    return c.svg("split_heads as a view of one buffer")


def gqa_groups(num_heads: int = 8, num_kv_heads: int = 2) -> str:
    """Grouped-query attention: which KV head each query head reads, from `group_queries`' own view.

    Example:
        >>> "K/V head 1: query heads 4..7" in gqa_groups(num_heads=8, num_kv_heads=2)
        True
    """
    group = num_heads // num_kv_heads
    labels = torch.arange(num_heads, dtype=torch.float32).view(1, num_heads, 1, 1)
    grouped = group_queries(labels, num_kv_heads)  # (1, num_kv_heads, group, 1, 1): which head lands where
    reads = {int(grouped[0, kv, g, 0, 0]): kv for kv in range(num_kv_heads) for g in range(group)}
    pad, box_w, box_h, gap = 16.0, 84.0, 34.0, 14.0
    c = Canvas(pad)
    c.text(
        pad, 28, f"GQA: {num_heads} query heads share {num_kv_heads} K/V heads (group = {group})", size=16, bold=True
    )
    c.text(
        pad,
        50,
        f"group_queries(q, num_kv_heads={num_kv_heads}) views q as (batch, {num_kv_heads}, {group}, seq, d_head)",
        MUTED,
    )
    q_y, kv_y = 96.0, 226.0
    q_x = [pad + h * (box_w + gap) for h in range(num_heads)]
    span = num_heads * (box_w + gap) - gap
    kv_w = max(box_w, span / num_kv_heads - 2 * gap)
    kv_x = [pad + (kv + 0.5) * span / num_kv_heads - kv_w / 2 for kv in range(num_kv_heads)]
    c.text(pad, q_y - 10, f"queries: num_heads = {num_heads}", MUTED, 12)
    for h in range(num_heads):
        colour = HEADS[reads[h] % len(HEADS)]
        c.line(q_x[h] + box_w / 2, q_y + box_h, kv_x[reads[h]] + kv_w / 2, kv_y, stroke=colour, width=1.5)
        c.rect(q_x[h], q_y, box_w, box_h, "#ffffff", stroke=colour, rx=4)
        c.text(q_x[h] + box_w / 2, q_y + 22, f"q head {h}", colour, 12, "middle")
    for kv in range(num_kv_heads):
        colour = HEADS[kv % len(HEADS)]
        members = [h for h in range(num_heads) if reads[h] == kv]
        c.rect(kv_x[kv], kv_y, kv_w, box_h, "#ffffff", stroke=colour, rx=4)
        c.text(
            kv_x[kv] + kv_w / 2,
            kv_y + 22,
            f"K/V head {kv}: query heads {members[0]}..{members[-1]}",
            colour,
            12,
            "middle",
        )
    c.text(
        pad,
        kv_y + box_h + 28,
        f"keys and values: num_kv_heads = {num_kv_heads}, never repeated to {num_heads} heads; "
        f"query head h reads K/V head h // {group}",
        MUTED,
        12,
    )
    return c.svg(f"GQA: {num_heads} query heads grouped onto {num_kv_heads} K/V heads")


def serving_layout(lengths: Sequence[int] = (6, 9, 3), block_size: int = 4, num_blocks: int = 10) -> str:
    """A packed batch and the paged cache it is written into, read from a real `PagedKVCache`'s block tables.

    The sequences of `lengths` are packed end to end (`cu_seqlens` their offsets) and run through a small module
    into the cache; then the first one leaves and a fourth joins, so the free list hands it blocks out of order.

    Example:
        >>> "cu_seqlens = [0, 6, 15, 18]" in serving_layout((6, 9, 3))
        True
    """
    from .._compute.paged import PagedKVCache
    from .._modules.multihead import MultiHeadAttention

    torch.manual_seed(0)
    module = MultiHeadAttention(8, 2, 1).eval()
    cache = PagedKVCache.for_module(module, num_blocks=num_blocks, block_size=block_size)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu = torch.tensor(offsets, dtype=torch.int32)
    with torch.no_grad():
        for _ in lengths:
            cache.add()
        module(torch.randn(1, offsets[-1], 8), cu_seqlens=cu, is_causal=True, kv_cache=cache)
        cache.remove(cache.sequences[0])
        joined = cache.add()
        news = [1] * (len(lengths) - 1) + [5]
        step = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
        module(torch.randn(1, sum(news), 8), cu_seqlens=step, is_causal=True, kv_cache=cache)
    rows = zip(cache.sequences, cache.block_table().tolist(), strict=True)
    tables = {seq: [b for b in row if b >= 0] for seq, row in rows}
    owner = {block: seq for seq, blocks in tables.items() for block in blocks}
    colour = {seq: HEADS[seq % len(HEADS)] for seq in range(joined + 1)}
    pad, cell = 16.0, 22.0
    c = Canvas(pad)
    c.text(pad, 28, "Serving: a packed batch, and the paged cache it is written into", size=16, bold=True)
    c.text(pad, 50, f"cu_seqlens = {offsets}: each sequence attends to itself only, its positions from 0", MUTED)
    top = 78.0
    c.text(pad, top, f"query: (1, total={offsets[-1]}, d_model), the sequences end to end (no padding)", bold=True)
    for seq, (a, b) in enumerate(itertools.pairwise(offsets)):
        for t in range(a, b):
            c.rect(pad + t * cell, top + 12, cell - 3, cell - 3, "#ffffff", stroke=colour[seq], rx=3)
            c.text(pad + t * cell + (cell - 3) / 2, top + 12 + cell / 2 + 2, str(t - a), colour[seq], 11, "middle")
        c.text(pad + a * cell, top + 12 + cell + 14, f"sequence {seq}", colour[seq], 12)
    pool_y = top + 2 * cell + 56
    shape = tuple(cache.keys_pool.shape)
    c.text(pad, pool_y, f"keys_pool: (num_blocks={shape[0]}, block_size={shape[1]}, num_kv_heads, d_head)", bold=True)
    c.text(pad, pool_y + 18, f"after sequence 0 left and sequence {joined} joined; grey: free", MUTED, 12)
    for block in range(num_blocks):
        x, y = pad + block * (block_size * cell + 10), pool_y + 30
        seq = owner.get(block)
        held = 0 if seq is None else min(block_size, cache.length(seq) - tables[seq].index(block) * block_size)
        for slot in range(block_size):
            stroke = LINE if seq is None or slot >= held else colour[seq]
            c.rect(x + slot * cell, y, cell - 3, cell - 3, "#ffffff" if slot >= held else "#f6f8fa", stroke=stroke)
        c.text(x, y + cell + 14, f"block {block}", MUTED if seq is None else colour[seq], 11)
    table_y = pool_y + 30 + cell + 48
    c.text(pad, table_y, "block_table(): each sequence's blocks in position order", bold=True)
    for row, (seq, blocks) in enumerate(tables.items()):
        line = f"sequence {seq}: length {cache.length(seq)}, blocks {blocks}"
        c.text(pad, table_y + 22 + row * 20, line, colour[seq], 12)
    return c.svg("A packed batch and its paged KV cache")
