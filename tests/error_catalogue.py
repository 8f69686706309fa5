"""The catalogue of shape mistakes: the code that makes each, and the first line it must get.

`python tests/error_catalogue.py` rewrites `docs/errors.md` from these entries by running them;
`tests/test_errors.py` runs them again and fails if a message or the page drifts.
"""

import contextlib
import io
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

PRELUDE = "import numpy as np\nimport torch\nimport shapesafe_mha as ssm\n"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


@dataclass(frozen=True)
class Entry:
    """One mistake: the code that makes it, the error type and a regex its first line must match."""

    group: str
    title: str
    code: str
    error: str
    first_line: str
    raw_torch: str | None = None  # the same mistake in plain torch
    raw_jaxtyping: str | None = None  # the same mistake under @jaxtyped(typechecker=beartype)


JAXTYPED_SDPA = """
from beartype import beartype
from jaxtyping import Float, jaxtyped
from torch import Tensor

@jaxtyped(typechecker=beartype)
def sdpa(q: Float[Tensor, "batch num_heads seq d_head"], k: Float[Tensor, "batch num_kv_heads kv_seq d_head"],
         v: Float[Tensor, "batch num_kv_heads kv_seq d_head"]) -> Float[Tensor, "batch num_heads seq d_head"]:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
"""

JAXTYPED_MODULE = """
from beartype import beartype
from jaxtyping import Float, jaxtyped
from torch import Tensor

@jaxtyped(typechecker=beartype)
def attend(query: Float[Tensor, "batch seq d_model"], key: Float[Tensor, "batch kv_seq d_model"],
           value: Float[Tensor, "batch kv_seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
    return torch.nn.MultiheadAttention(32, 4, batch_first=True)(query, key, value)[0]
"""

CATALOGUE: list[Entry] = [
    # --- configuration ---
    Entry(
        "Configuration",
        "d_model not divisible by num_heads",
        "ssm.MultiHeadAttention(d_model=500, num_heads=8)",
        "ConfigError",
        r"^MultiHeadAttention\(d_model=500, num_heads=8, num_kv_heads=8\): d_model must be num_heads \* d_head, "
        r"and 500 is not divisible by 8; pass d_head explicitly or use num_heads in \{1, 2, 4, 5, 10, \.\.\.\}\.$",
        raw_torch="torch.nn.MultiheadAttention(500, 8)",
    ),
    Entry(
        "Configuration",
        "num_heads not a multiple of num_kv_heads",
        "ssm.MultiHeadAttention(d_model=64, num_heads=8, num_kv_heads=3)",
        "ConfigError",
        r"num_heads=8 is not a multiple of num_kv_heads=3; .* must be one of \[1, 2, 4, 8\]\.$",
    ),
    Entry(
        "Configuration",
        "num_kv_heads larger than num_heads",
        "ssm.MultiHeadAttention(d_model=64, num_heads=4, num_kv_heads=8)",
        "ConfigError",
        r"num_kv_heads=8 is more than num_heads=4; .*num_kv_heads must divide num_heads",
    ),
    Entry(
        "Configuration",
        "zero or negative sizes",
        "ssm.MultiHeadAttention(d_model=64, num_heads=0)",
        "ConfigError",
        r"num_heads must be a positive int, but got 0\.$",
    ),
    # --- inputs ---
    Entry(
        "Inputs",
        "wrong d_model width",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 30))",
        "ShapeError",
        r"^MultiHeadAttention\.forward\(\): query has d_model=30 \(axis 2\), but the module set d_model=32\.$",
        raw_torch="torch.nn.MultiheadAttention(32, 4, batch_first=True)(*[torch.randn(2, 5, 30)] * 3)",
        raw_jaxtyping=JAXTYPED_MODULE + "attend(torch.randn(2, 5, 30), torch.randn(2, 5, 30), torch.randn(2, 5, 30))",
    ),
    Entry(
        "Inputs",
        "missing batch axis",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(5, 32))",
        "ShapeError",
        r"query must be 3-D \(batch seq d_model\), but it is 2-D with shape \(5, 32\); if the batch axis is "
        r"missing, add it with query\.unsqueeze\(0\)\.$",
    ),
    Entry(
        "Inputs",
        "an extra axis",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 3, 5, 32))",
        "ShapeError",
        r"query must be 3-D \(batch seq d_model\), but it is 4-D with shape \(2, 3, 5, 32\)\.$",
    ),
    Entry(
        "Inputs",
        "key and value of different lengths",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(2, 10, 32), torch.randn(2, 12, 32))",
        "ShapeError",
        r"value has kv_seq=12 \(axis 1\), but key set kv_seq=10\. key and value must cover the same positions\.$",
        raw_torch="torch.nn.MultiheadAttention(32, 4, batch_first=True)"
        "(torch.randn(2, 5, 32), torch.randn(2, 10, 32), torch.randn(2, 12, 32))",
        raw_jaxtyping=JAXTYPED_MODULE + "attend(torch.randn(2, 5, 32), torch.randn(2, 10, 32), torch.randn(2, 12, 32))",
    ),
    Entry(
        "Inputs",
        "key/value batch differs from the query's",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(3, 7, 32))",
        "ShapeError",
        r"key has batch=3 \(axis 0\), but query set batch=2\. key needs one sequence per query sequence\.$",
    ),
    Entry(
        "Inputs",
        "key width differs from d_model",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(2, 7, 16))",
        "ShapeError",
        r"key has d_model=16 \(axis 2\), but the module set d_model=32\.$",
    ),
    Entry(
        "Inputs",
        "integer input",
        "ssm.MultiHeadAttention(32, 4)(torch.ones(2, 5, 32, dtype=torch.int64))",
        "ShapeError",
        r"query has dtype int64, but the module's parameters are float32; inputs must be floating point: "
        r"query\.to\(torch\.float32\)\.$",
    ),
    Entry(
        "Inputs",
        "a float dtype other than the module's",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32, dtype=torch.float64))",
        "ShapeError",
        r"query has dtype float64, but the module's parameters are float32; cast the input "
        r"\(query\.to\(torch\.float32\)\) or the module \(module\.to\(torch\.float64\)\)\.$",
        raw_torch="torch.nn.MultiheadAttention(32, 4, batch_first=True)"
        "(*[torch.randn(2, 5, 32, dtype=torch.float64)] * 3)",
    ),
    Entry(
        "Inputs",
        "tensors on different devices",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(2, 5, 32, device='meta'))",
        "ShapeError",
        r"key is on meta, but the module's parameters are on cpu; move one of them",
    ),
    Entry(
        "Inputs",
        "not a tensor (numpy array)",
        "ssm.MultiHeadAttention(32, 4)(np.zeros((2, 5, 32), dtype=np.float32))",
        "ShapeError",
        r"query must be a torch\.Tensor, but got numpy\.ndarray; convert it with torch\.as_tensor\(query\)\.$",
    ),
    Entry(
        "Inputs",
        "not a tensor (list)",
        "ssm.split_heads([[0.0] * 8], 2)",
        "ShapeError",
        r"^split_heads\(\): x must be a torch\.Tensor, but got list; convert it with torch\.as_tensor\(x\)\.$",
    ),
    # --- masks ---
    Entry(
        "Masks",
        "attn_mask of the wrong shape",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), attn_mask=torch.ones(5, 6, dtype=torch.bool))",
        "ShapeError",
        r"attn_mask has kv_seq=6 \(axis 1\), but key set kv_seq=5\.$",
        raw_torch="torch.nn.MultiheadAttention(32, 4, batch_first=True)"
        "(*[torch.randn(2, 5, 32)] * 3, attn_mask=torch.ones(5, 6, dtype=torch.bool))",
    ),
    Entry(
        "Masks",
        "a 3-D mask in nn.MultiheadAttention's layout",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), attn_mask=torch.ones(8, 5, 5, dtype=torch.bool))",
        "ShapeError",
        r"attn_mask must be \(seq, kv_seq\) or \(#batch, #num_heads, seq, kv_seq\), but it is 3-D \(8, 5, 5\)\. "
        r"From \(batch\*num_heads, seq, kv_seq\): attn_mask\.unflatten\(0, \(batch, -1\)\)\.$",
    ),
    Entry(
        "Masks",
        "attn_mask of an integer dtype",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), attn_mask=torch.ones(5, 5, dtype=torch.int64))",
        "ShapeError",
        r"attn_mask has dtype int64, but it must be bool or floating point\. A mask is bool \(True = may attend\) "
        r"or floating point \(added to the scores\): convert with attn_mask\.bool\(\)\.$",
    ),
    Entry(
        "Masks",
        "key_padding_mask of the wrong length",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))",
        "ShapeError",
        r"key_padding_mask has kv_seq=4 \(axis 1\), but key set kv_seq=5\.$",
    ),
    Entry(
        "Masks",
        "a mask that would broadcast over seq",
        "ssm.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))",
        "ShapeError",
        r"attn_mask has seq=1 \(axis 2\), but query set seq=5\. Masks broadcast only over batch and heads; "
        r"for a per-key mask use key_padding_mask\.$",
        raw_torch="torch.nn.functional.scaled_dot_product_attention(*[torch.randn(2, 4, 5, 8)] * 3, "
        "attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool)); print('(no error: the mask broadcast over seq)')",
    ),
    Entry(
        "Masks",
        "a mask that would broadcast over kv_seq",
        "ssm.scaled_dot_product_attention(*[torch.randn(2, 4, 5, 8)] * 3,\n"
        "                                 attn_mask=torch.ones(5, 1, dtype=torch.bool))",
        "ShapeError",
        r"attn_mask has kv_seq=1 \(axis 1\), but k set kv_seq=5\. Masks broadcast only over batch and heads",
    ),
    # --- stages ---
    Entry(
        "Stages",
        "split_heads with an indivisible width",
        "ssm.split_heads(torch.randn(2, 10, 730), num_heads=7)",
        "ShapeError",
        r"^split_heads\(\): x has width 730 \(axis 2\), which does not split into num_heads=7 equal heads; "
        r"num_heads must divide it \(one of \{1, 2, 5, 10, 73, 146, 365, 730\}\)\.$",
        raw_torch="torch.randn(2, 10, 730).view(2, 10, 7, 73)",
    ),
    Entry(
        "Stages",
        "merge_heads on a tensor that is not 4-D",
        "ssm.merge_heads(torch.randn(2, 5, 32))",
        "ShapeError",
        r"^merge_heads\(\): x must be 4-D \(batch num_heads seq d_head\), but it is 3-D with shape \(2, 5, 32\)",
    ),
    Entry(
        "Stages",
        "SDPA with mismatched d_head",
        "ssm.scaled_dot_product_attention(torch.randn(2, 8, 12, 64), torch.randn(2, 8, 12, 32), "
        "torch.randn(2, 8, 12, 32))",
        "ShapeError",
        r"^scaled_dot_product_attention\(\): k has d_head=32 \(axis 3\), but q set d_head=64\.$",
        raw_torch="torch.nn.functional.scaled_dot_product_attention(torch.randn(2, 8, 12, 64), "
        "torch.randn(2, 8, 12, 32), torch.randn(2, 8, 12, 32))",
        raw_jaxtyping=JAXTYPED_SDPA
        + "sdpa(torch.randn(2, 8, 12, 64), torch.randn(2, 8, 12, 32), torch.randn(2, 8, 12, 32))",
    ),
    Entry(
        "Stages",
        "SDPA with mismatched batch",
        "q, k = torch.randn(2, 8, 5, 16), torch.randn(3, 8, 5, 16)\nssm.scaled_dot_product_attention(q, k, k)",
        "ShapeError",
        r"k has batch=3 \(axis 0\), but q set batch=2\.$",
    ),
    Entry(
        "Stages",
        "SDPA with num_heads not a multiple of num_kv_heads",
        "q, k = torch.randn(1, 8, 5, 16), torch.randn(1, 3, 5, 16)\nssm.scaled_dot_product_attention(q, k, k)",
        "ShapeError",
        r"q has num_heads=8 \(axis 1\), which is not a multiple of k's num_kv_heads=3; each KV head must serve a "
        r"whole group of query heads\.$",
        raw_torch="torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 8, 5, 16), "
        "torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16), enable_gqa=True)",
    ),
    Entry(
        "Stages",
        "q and k swapped",
        "q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 9, 16)\nssm.scaled_dot_product_attention(k, q, k)",
        "ShapeError",
        r"v has kv_seq=9 \(axis 2\), but k set kv_seq=3\. Are q and k swapped\? q has as many positions as v\.$",
    ),
    Entry(
        "Stages",
        "k passed transposed",
        "q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 9, 16)\n"
        "ssm.scaled_dot_product_attention(q, k.transpose(-1, -2), k)",
        "ShapeError",
        r"k has d_head=9 \(axis 3\), but q set d_head=16\. k looks transposed",
        raw_torch="q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 9, 16)\n"
        "torch.nn.functional.scaled_dot_product_attention(q, k.transpose(-1, -2), k)",
    ),
    Entry(
        "KV cache",
        "appending past the capacity",
        "cache = ssm.KVCache(1, 2, 4, 8, dtype=torch.float32)\n"
        "cache.append(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))",
        "ShapeError",
        r"^KVCache\.append\(\): appending new=5 positions to the 0 cached would exceed capacity=4",
    ),
]


# What no shape can tell: a seq-first tensor whose sizes fit. The page shows it and what we do about it;
# tests/test_errors.py runs these blocks and checks what they print.
SEQ_FIRST = """\
attn = ssm.MultiHeadAttention(64, 8, 2)
x = torch.randn(2, 10, 64)  # (batch=2, seq=10, d_model): two sequences of 10 tokens
seq_first = x.transpose(0, 1)  # (seq=10, batch=2, d_model): nn.MultiheadAttention's default layout
out = attn(seq_first, is_causal=True)  # runs: to any shape check this is batch=10, seq=2
print(out.shape)  # torch.Size([10, 2, 64])
print(torch.allclose(out.transpose(0, 1), attn(x, is_causal=True)))  # False
"""
SEQ_FIRST_CAUGHT = """\
padding = torch.zeros(2, 10, dtype=torch.bool)  # (batch, kv_seq), built for the real layout
try:
    attn(seq_first, key_padding_mask=padding)
except ssm.ShapeError as error:
    print(str(error).splitlines()[0])  # key_padding_mask has batch=2 (axis 0), but query set batch=10.
try:
    ssm.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(64, 8))  # batch_first=False
except ssm.ConfigError as error:
    print(str(error).split(", so")[0])  # this nn.MultiheadAttention has batch_first=False
"""


def _what_no_shape_can_tell() -> list[str]:
    return [
        "",
        "## What no shape can tell",
        "",
        "A check of shapes sees sizes, not meaning. A `(seq, batch, d_model)` tensor, the layout of",
        "`nn.MultiheadAttention`'s default `batch_first=False`, *is* a valid `(batch, seq, d_model)` one",
        "whenever its sizes are: 10 tokens of 2 sequences read as 2 tokens of 10 sequences. The call runs",
        "without an error, and `is_causal=True` masks along the wrong axis (each token attends to the same",
        "position of the other sequences):",
        "",
        "```python",
        SEQ_FIRST.rstrip("\n"),
        "```",
        "",
        "What we do about it: the layout is one, batch first, everywhere (every signature says so:",
        '`query: Float[Tensor, "batch seq d_model"]`, and `shapesafe-mha trace` names each axis), and the',
        "doors a seq-first tensor usually comes through are checked. `MultiHeadAttention.from_torch`",
        "refuses an `nn.MultiheadAttention` with `batch_first=False` by name, with the conversion to make,",
        "instead of converting a module whose callers pass `(seq, batch, d)`; and anything built for the",
        "real layout (a `key_padding_mask`, a `KVCache` of that batch) disagrees with the swapped one:",
        "",
        "```python",
        SEQ_FIRST_CAUGHT.rstrip("\n"),
        "```",
        "",
        "A tensor whose batch and seq sizes are equal passes even that; only its producer knows its layout.",
    ]


# Mistakes in a user's own functions, each checked three ways (`{check}` is the decorator, or nothing):
# our decorator, plain jaxtyping+beartype, and none (raw torch). The page measures first lines and lengths.
USER_CODE = {
    "a per-head temperature with 2 entries for 6 heads": (
        """
from jaxtyping import Float
from torch import Tensor
{check}
def apply_temperature(q: Float[Tensor, "batch num_heads seq d_head"], log_temp: Float[Tensor, " num_heads"]) -> Float[
    Tensor, "batch num_heads seq d_head"
]:
    return q * log_temp.exp()[:, None, None]
apply_temperature(torch.randn(2, 6, 5, 8), torch.randn(2))
"""
    ),
    "a forgotten output projection (inner width 48, d_model 64)": (
        """
from jaxtyping import Float
from torch import Tensor
{check}
def attend(x: Float[Tensor, "batch seq d_model"], w_qkv: Float[Tensor, "inner3 d_model"],
           w_o: Float[Tensor, "d_model inner"]) -> Float[Tensor, "batch seq d_model"]:
    q, k, v = (t.unflatten(-1, (6, -1)).transpose(1, 2) for t in (x @ w_qkv.T).chunk(3, dim=-1))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
    return out  # forgot: out @ w_o.T
attend(torch.randn(2, 5, 64), torch.randn(144, 64), torch.randn(64, 48))
"""
    ),
    "a causal mask built (kv_seq, seq)": (
        """
from jaxtyping import Bool, Float
from torch import Tensor
{check}
def causal_mask(q: Float[Tensor, "batch num_heads seq d_head"], k: Float[Tensor, "batch num_kv_heads kv_seq d_head"]
                ) -> Bool[Tensor, "seq kv_seq"]:
    return torch.ones(k.shape[2], q.shape[2], dtype=torch.bool).tril()
q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8)
torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=causal_mask(q, k), enable_gqa=True)
"""
    ),
}
CHECKS = {
    "shapesafe_mha": "@ssm.shapecheck",
    "plain jaxtyping + beartype": "from beartype import beartype\nfrom jaxtyping import jaxtyped\n@jaxtyped(typechecker=beartype)",
    "raw torch": "",
}


def _your_own_code() -> list[str]:
    out = [
        "",
        "## Your own code",
        "",
        "Functions of your own, annotated with our dimension names (`shapesafe_mha.dims`) or yours, and",
        "decorated with `@ssm.shapecheck`, get the same messages (see [Checking your own code](own-code.md)).",
        "Each mistake below run three ways, measured when this page was made: our decorator, plain",
        "`@jaxtyped(typechecker=beartype)`, and no check (what torch says, if anything):",
    ]
    for title, code in USER_CODE.items():
        out += ["", f"### {title}", "", "```python", code.strip().replace("{check}\n", "@ssm.shapecheck\n"), "```", ""]
        out += ["| checked by | first line | characters | lines |", "|---|---|---|---|"]
        for name, check in CHECKS.items():
            error = run(code.replace("{check}", check))
            text = "" if error is None else f"{type(error).__name__}: {error}"
            first = text.splitlines()[0] if text else "(no error: the mistake passes silently)"
            first = first.replace("|", "\\|")
            out.append(f"| {name} | `{first}` | {len(text)} | {len(text.splitlines())} |")
    return out


def run(code: str) -> BaseException | None:
    """Run a snippet; return what it raised (None if nothing), with anything it printed discarded."""
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(PRELUDE + code, "<catalogue>", "exec"), namespace)
        except Exception as error:
            return error
    return None


def _describe(error: BaseException | None, lines: int) -> str:
    if error is None:
        return "(no error: the mistake passes silently)"
    text = f"{type(error).__module__}.{type(error).__qualname__}: {error}".replace("builtins.", "")
    kept = text.splitlines()
    return "\n".join(kept[:lines] + ([f"... ({len(kept) - lines} more lines)"] if len(kept) > lines else []))


def render() -> str:
    """The whole of docs/errors.md, from running every entry."""
    out = [
        "# Shape errors: the catalogue",
        "",
        "Every mistake below was made by running the code shown; the message is what shapesafe_mha printed.",
        "The first line names the function, the argument, the dimension and axis, the size given, what it",
        "had to be and who set it, and where the cause is usual, the fix. Later lines (not shown here) give",
        "every tensor's named shape and every dimension bound so far. Where it helps, the same mistake in",
        "plain torch and under `@jaxtyped(typechecker=beartype)` is shown beside it.",
        "",
        "This page is generated by `python tests/error_catalogue.py` and checked by `tests/test_errors.py`.",
        "",
        "One mistake from the usual list is not here because it cannot happen: `split_heads` on a",
        "non-contiguous input. Splitting one axis into two is expressible as a view for *every* stride",
        "pattern, so `split_heads` never needs a copy (`tests/test_aliasing.py` proves it for contiguous,",
        "transposed and sliced inputs). The copy people remember happens on the way back:",
        "`x.transpose(1, 2).view(batch, seq, -1)` after attention fails in torch with *view size is not",
        "compatible with input tensor's size and stride*. `merge_heads` copies there instead, and",
        "`shapesafe-mha trace` shows that copy as a new allocation.",
    ]
    group = None
    for entry in CATALOGUE:
        if entry.group != group:
            group = entry.group
            out += ["", f"## {group}"]
        error = run(entry.code)
        first = str(error).splitlines()[0] if error else "(no error)"
        out += ["", f"### {entry.title}", "", "```python", entry.code, "```", "", "shapesafe_mha:", "", "```text"]
        out += [f"{type(error).__name__ if error else 'nothing'}: {first}", "```"]
        if entry.raw_torch:
            out += ["", "Plain torch:", "", "```text", _describe(run(entry.raw_torch), 4), "```"]
        if entry.raw_jaxtyping:
            out += ["", "Plain jaxtyping + beartype:", "", "```text", _describe(run(entry.raw_jaxtyping), 20), "```"]
    out += _your_own_code()
    out += _what_no_shape_can_tell()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.stdout.write(textwrap.shorten(f"wrote {PAGE}", 200) + "\n")
