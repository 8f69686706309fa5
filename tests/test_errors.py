"""Every shape, dtype, device and config mistake gets the library's error with a one-line, specific message."""

import re

import pytest
import torch
from error_catalogue import CATALOGUE, PAGE, PRELUDE, SEQ_FIRST, SEQ_FIRST_CAUGHT, Entry, run
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.title.replace(" ", "_"))
def test_catalogue_entry_gets_its_message(entry: Entry) -> None:
    """The mistake raises the library's error, and the first line is the one pinned (and short)."""
    error = run(entry.code)
    assert error is not None, "the mistake passed silently"
    assert type(error).__name__ == entry.error and type(error).__module__ == "shapesafe_mha", repr(error)
    first = str(error).splitlines()[0]
    assert re.search(entry.first_line, first), first
    assert len(first) <= 210, f"first line is {len(first)} characters"
    shown_context = error.__context__ is not None and not error.__suppress_context__
    assert error.__cause__ is None and not shown_context, "chained to an internal error; re-raise from None"


def test_errors_page_shows_the_current_messages() -> None:
    """docs/errors.md shows exactly what each entry prints today (regenerate: python tests/error_catalogue.py)."""
    page = PAGE.read_text()
    for entry in CATALOGUE:
        error = run(entry.code)
        line = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        assert line in page, f"docs/errors.md is stale for {entry.title!r}: run python tests/error_catalogue.py"
    assert sum(1 for e in CATALOGUE if e.raw_torch or e.raw_jaxtyping) >= 5


def test_the_seq_first_section_runs_and_prints_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    """errors.md's "What no shape can tell": a seq-first tensor runs; a mask, or from_torch, catches it."""
    namespace: dict[str, object] = {}
    for block in (SEQ_FIRST, SEQ_FIRST_CAUGHT):
        assert f"```python\n{block}```" in PAGE.read_text()
        exec(compile(PRELUDE + block, "errors.md", "exec"), namespace)
        printed = capsys.readouterr().out
        for comment in re.findall(r"^\s*print\(.*\)  # (.*)$", block, re.MULTILINE):
            assert comment in printed, f"{comment!r} not in {printed!r}"


def test_detail_lines_give_named_shapes_and_bound_dimensions() -> None:
    """After the first line: every tensor as a named shape, and every bound dimension with its source."""
    with pytest.raises(ssm.ShapeError) as caught:
        ssm.scaled_dot_product_attention(torch.randn(2, 8, 5, 64), torch.randn(2, 2, 7, 32), torch.randn(2, 2, 7, 32))
    lines = str(caught.value).splitlines()
    assert "  q: f32[batch=2, num_heads=8, seq=5, d_head=64]" in lines
    assert "  k: f32[batch=2, num_kv_heads=2, kv_seq=7, d_head=32]" in lines
    assert any(line.startswith("Bound so far:") and "d_head=64 (q)" in line for line in lines)


@pytest.mark.parametrize("mask", ["key_padding_mask", "attn_mask"])
def test_a_cached_call_names_the_cache_plus_key_as_what_set_kv_seq(mask: str) -> None:
    """With a cache, kv_seq is the cached positions plus the new key: a mask of another length is told so, with
    both lengths (the user passed no tensor of kv_seq=5, so "key set kv_seq=5" would send them to the key)."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = module.new_cache(batch=2, capacity=8)
    module(torch.randn(2, 4, 16), is_causal=True, kv_cache=cache)
    short = torch.zeros(2, 4, dtype=torch.bool) if mask == "key_padding_mask" else torch.ones(1, 4, dtype=torch.bool)
    expected = rf"^MultiHeadAttention\.forward\(\): {mask} has kv_seq=4 \(axis 1\), but the cache plus key set kv_seq=5"
    with pytest.raises(ssm.ShapeError, match=expected):
        module(torch.randn(2, 1, 16), is_causal=True, kv_cache=cache, **{mask: short})
    assert len(cache) == 4


# --- fuzz: one dimension perturbed, for each public function --------------------------------------------


@st.composite
def perturbed_calls(draw: st.DrawFn) -> tuple[str, dict[str, tuple[int, ...]], int, list[str]]:
    """A valid call of a public function with one dimension of one argument changed.

    Returns the function, the argument shapes, a head count where the function takes one, and the
    texts the first line must contain: the argument, the dimension, and both sizes.
    """
    b, hkv, g, s, kv, d = (draw(st.integers(1, 4)) for _ in range(6))
    h, width = hkv * g, hkv * g * d
    delta = draw(st.integers(1, 3))
    function = draw(st.sampled_from(["sdpa", "weights", "module", "project", "split", "cache"]))
    heads = h
    if function in ("sdpa", "weights"):
        shapes = {"q": (b, h, s, d), "k": (b, hkv, kv, d), "v": (b, hkv, kv, d)}
        if function == "weights":
            del shapes["v"]
        choices = [("k", 0, "batch", "q"), ("k", 3, "d_head", "q")]
        if function == "sdpa":
            choices += [("v", 0, "batch", "q"), ("v", 2, "kv_seq", "k"), ("v", 3, "d_head", "q")]
    elif function == "module":
        shapes = {"query": (b, s, width), "key": (b, kv, width), "value": (b, kv, width)}
        choices = [
            ("query", 2, "d_model", "the module"),
            ("key", 2, "d_model", "the module"),
            ("key", 0, "batch", "query"),
            ("value", 1, "kv_seq", "key"),
        ]
    elif function == "project":
        shapes = {"x": (b, s, width), "weight": (d, width), "bias": (d,)}
        choices = [("weight", 1, "d_in", "x"), ("bias", 0, "d_out", "weight")]
    elif function == "cache":
        shapes = {"k": (b, hkv, s, d), "v": (b, hkv, s, d)}
        choices = [
            ("k", 0, "batch", "the cache"),
            ("k", 1, "num_kv_heads", "the cache"),
            ("k", 3, "d_head", "the cache"),
        ]
        choices += [("v", 2, "new", "k")]
    else:
        heads = draw(st.integers(2, 6))
        new = heads * d + draw(st.integers(1, heads - 1))
        return "split", {"x": (b, s, new)}, heads, [f"x has width {new} (axis 2)", f"num_heads={heads}"]
    arg, axis, dim, setter = draw(st.sampled_from(choices))
    shape = list(shapes[arg])
    old = shape[axis]
    shape[axis] += delta
    shapes[arg] = tuple(shape)
    return function, shapes, heads, [f"{arg} has {dim}={shape[axis]} (axis {axis})", f"{setter} set {dim}={old}"]


@given(call=perturbed_calls())
def test_one_perturbed_dimension_is_named_with_both_sizes(
    call: tuple[str, dict[str, tuple[int, ...]], int, list[str]],
) -> None:
    """Perturb one dimension: the library's error, naming the argument, the dimension and both sizes; nothing else."""
    function, shapes, heads, expected = call
    t = {name: torch.randn(*shape) for name, shape in shapes.items()}
    with pytest.raises(ssm.ShapesafeError) as caught:
        if function == "sdpa":
            ssm.scaled_dot_product_attention(t["q"], t["k"], t["v"])
        elif function == "weights":
            ssm.attention_weights(t["q"], t["k"])
        elif function == "module":
            d_model = shapes["value"][2]
            ssm.MultiHeadAttention(d_model, 1, d_head=1)(t["query"], t["key"], t["value"])
        elif function == "project":
            ssm.project(t["x"], t["weight"], t["bias"])
        elif function == "cache":
            b, hkv, _, d = shapes["v"]
            ssm.KVCache(b, hkv, 16, d, dtype=torch.float32).append(t["k"], t["v"])
        else:
            ssm.split_heads(t["x"], heads)
    first = str(caught.value).splitlines()[0]
    for text in expected:
        assert text in first, first


_Q, _K = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
# A call with an argument of the wrong kind -> the first line of its message, exactly (pinned from generated
# mutants of the messages that survived: each line names the argument, what it must be, what it got, the fix).
WRONG_KINDS = {
    "a list for a tensor": (
        lambda: ssm.split_heads([1, 2], 2),  # type: ignore[arg-type]
        "split_heads(): x must be a torch.Tensor, but got list; convert it with torch.as_tensor(x).",
    ),
    "a list for an optional mask": (
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, attn_mask=[[True]]),  # type: ignore[arg-type]
        "scaled_dot_product_attention(): attn_mask must be a torch.Tensor, but got list; "
        "convert it with torch.as_tensor(attn_mask).",
    ),
    "a str for a float": (
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, scale="2"),  # type: ignore[arg-type]
        "scaled_dot_product_attention(): scale must be float, but got str '2'.",
    ),
    "None for a bool that is not optional": (
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, is_causal=None),  # type: ignore[arg-type]
        "scaled_dot_product_attention(): is_causal must be bool, but got NoneType None.",
    ),
    "integer queries": (
        lambda: ssm.scaled_dot_product_attention(_Q.long(), _K, _K),
        "scaled_dot_product_attention(): q has dtype int64, but it must be floating point.",
    ),
    "a bool tensor to split": (
        lambda: ssm.split_heads(torch.zeros(2, 3, 8, dtype=torch.bool), 2),
        "split_heads(): x has dtype bool, but it must be floating point.",
    ),
    "an integer mask": (
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, attn_mask=torch.zeros(5, 5, dtype=torch.int64)),
        "scaled_dot_product_attention(): attn_mask has dtype int64, but it must be bool or floating point. "
        "A mask is bool (True = may attend) or floating point (added to the scores): convert with attn_mask.bool().",
    ),
}


@pytest.mark.parametrize("case", WRONG_KINDS)
def test_an_argument_of_the_wrong_kind_is_named_with_what_it_must_be(case: str) -> None:
    call, first_line = WRONG_KINDS[case]
    with pytest.raises(ssm.ShapeError) as raised:
        call()
    assert str(raised.value).splitlines()[0] == first_line


def test_none_is_accepted_where_the_annotation_allows_it() -> None:
    """The optional arguments take None (their default spelled out); the explanation of a failure is not asked."""
    out = ssm.scaled_dot_product_attention(_Q, _K, _K, attn_mask=None, scale=None, window=None, softcap=None)
    assert out.shape == _Q.shape


def test_a_detail_line_shows_a_value_as_a_named_shape_or_its_type() -> None:
    """What the "Called with:" lines show (pinned from surviving mutants of named_shape): a tensor as its dtype,
    abbreviated where there is an abbreviation, then its dimensions named by the annotation where its rank
    fits one, else its sizes; anything else as its type's name."""
    from shapesafe_mha._core.messages import named_shape
    from shapesafe_mha.dims import Tokens

    assert named_shape(torch.zeros(2, 5, 3, dtype=torch.int64), Tokens) == "int64[batch=2, seq=5, d_model=3]"
    assert named_shape(torch.zeros(2, 5, 3, dtype=torch.bfloat16), Tokens) == "bf16[batch=2, seq=5, d_model=3]"
    assert named_shape(torch.zeros(2, 5), Tokens) == "f32[2, 5]"
    assert named_shape(3) == "int" and named_shape(None) == "NoneType"
