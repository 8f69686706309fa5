"""Every shape, dtype, device and config mistake gets the library's error with a one-line, specific message."""

import functools
import re
from typing import Any

import numpy as np
import pytest
import torch
from error_catalogue import CATALOGUE, PAGE, PRELUDE, SEQ_FIRST, SEQ_FIRST_CAUGHT, Entry, run
from hypothesis import given
from hypothesis import strategies as st
from jaxtyping import Float, Float32, Int
from torch import Tensor

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



def test_a_modules_detail_lines_show_every_tensor_it_was_called_with_masks_included() -> None:
    """A module call's mistake lists each tensor argument it was given (the mask at fault among them), as given."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    padding = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ssm.ShapeError) as caught:
        module(torch.randn(2, 3, 16), attn_mask=torch.ones(3, 5, dtype=torch.bool), key_padding_mask=padding)
    lines = str(caught.value).splitlines()
    assert lines[0] == "MultiHeadAttention.forward(): attn_mask has kv_seq=5 (axis 1), but key set kv_seq=3."
    assert lines[1:6] == [
        "Called with:",
        "  query: f32[batch=2, seq=3, d_model=16]",
        "  key: f32[batch=2, kv_seq=3, d_model=16]",
        "  value: f32[batch=2, kv_seq=3, d_model=16]",
        "  attn_mask: bool[3, 5]",
    ]
    assert lines[6].startswith("  key_padding_mask: bool[")

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


# --- whole messages: the wording, the sources and the detail lines (pinned from surviving generated mutants) ---


def _message(call: Any) -> str:
    with pytest.raises(ssm.ShapeError) as raised:
        call()
    return str(raised.value)


@ssm.shapecheck
def _integers(x: Int[Tensor, " n"]) -> Int[Tensor, " n"]:
    return x


@ssm.shapecheck
def _single_precision(x: Float32[Tensor, " n"]) -> Float32[Tensor, " n"]:
    return x


@ssm.shapecheck
def _square(x: Float[Tensor, "n n"]) -> Float[Tensor, " n"]:
    return x[0]


@ssm.shapecheck
def _doubled(x: Float[Tensor, " N"], y: Float[Tensor, " 2*N"]) -> Float[Tensor, " N"]:
    return x


@ssm.shapecheck
def _product(x: Float[Tensor, " a"], y: Float[Tensor, " b"], z: Float[Tensor, " a*b"]) -> Float[Tensor, " a"]:
    return x


@ssm.shapecheck
def _literal_rows(x: Float[Tensor, "3 n"]) -> Float[Tensor, " n"]:
    return x[0]


@ssm.shapecheck
def _anything_first(x: Float[Tensor, "_ n m"], y: Float[Tensor, " n"]) -> Float[Tensor, " n"]:
    return y


@ssm.shapecheck
def _broadcast_first(x: Float[Tensor, " #n"], y: Float[Tensor, " n"]) -> Float[Tensor, " n"]:
    return y


@ssm.shapecheck
def _broadcast_second(x: Float[Tensor, " n"], y: Float[Tensor, " #n"]) -> Float[Tensor, " n"]:
    return x


@ssm.shapecheck
def _vector_or_matrix(x: Float[Tensor, " n"] | Float[Tensor, "m n"], y: Float[Tensor, " m"]) -> Float[Tensor, "..."]:
    return x


@ssm.shapecheck
def _capital(x: Float[Tensor, " Xa"], y: Float[Tensor, " Xa"]) -> Float[Tensor, " Xa"]:
    return x


@ssm.shapecheck
def _int_or_str(x: Float[Tensor, " n"], k: int | str) -> Float[Tensor, " n"]:
    return x


@ssm.shapecheck
def _int_or_list(x: Float[Tensor, " n"], k: int | list[Any]) -> Float[Tensor, " n"]:
    return x


@ssm.shapecheck
def _listed(x: Float[Tensor, " n"]) -> Float[Tensor, " n"]:
    return x.tolist()  # type: ignore[return-value]


def _z(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape)


# A user's decorated function called wrongly -> its whole message. Each names the argument, the dimension, the
# axis, both sizes and who set the expected one; the detail lines list the call's named shapes and the bound dims.
WHOLE_MESSAGES = {
    "an integer annotation given floats (every integer dtype it accepts)": (
        lambda: _integers(_z(3)),
        "_integers(): x has dtype float32, but it must be int16 or int2 or int32 or int4 or int64 or int8.\n"
        "Called with:\n  x: f32[n=3]",
    ),
    "a float32 annotation given half precision (the dtype it names, not every float's kind)": (
        lambda: _single_precision(_z(3).half()),
        "_single_precision(): x has dtype float16, but it must be float32.\nCalled with:\n  x: f16[n=3]",
    ),
    "a dimension repeated in one annotation": (
        lambda: _square(_z(3, 4)),
        "_square(): x has n=4 (axis 1), but x set n=3.\nCalled with:\n  x: f32[n=3, n=4]",
    ),
    "arithmetic over a capitalised name": (
        lambda: _doubled(_z(3), _z(5)),
        "_doubled(): y has 2*N=5 (axis 0), but x (N=3) set 2*N=6.\n"
        "Called with:\n  x: f32[N=3]\n  y: f32[2*N=5]\nBound so far: N=3 (x)",
    ),
    "arithmetic over names two arguments set": (
        lambda: _product(_z(2), _z(3), _z(7)),
        "_product(): z has a*b=7 (axis 0), but x and y (a=2, b=3) set a*b=6.\n"
        "Called with:\n  x: f32[a=2]\n  y: f32[b=3]\n  z: f32[a*b=7]\nBound so far: a=2 (x), b=3 (y)",
    ),
    "a size written in the annotation": (
        lambda: _literal_rows(_z(4, 2)),
        "_literal_rows(): x has 3=4 (axis 0), but the annotation set 3=3.\nCalled with:\n  x: f32[3=4, n=2]",
    ),
    "an anonymous axis binds nothing": (
        lambda: _anything_first(_z(5, 2, 3), _z(4)),
        "_anything_first(): y has n=4 (axis 0), but x set n=2.\n"
        "Called with:\n  x: f32[_=5, n=2, m=3]\n  y: f32[n=4]\nBound so far: n=2 (x), m=3 (x)",
    ),
    "a broadcastable axis of size 3 binds its name": (
        lambda: _broadcast_first(_z(3), _z(4)),
        "_broadcast_first(): y has n=4 (axis 0), but x set n=3.\n"
        "Called with:\n  x: f32[n=3]\n  y: f32[n=4]\nBound so far: n=3 (x)",
    ),
    "a broadcastable axis of size 2 binds its name": (
        lambda: _broadcast_first(_z(2), _z(4)),
        "_broadcast_first(): y has n=4 (axis 0), but x set n=2.\n"
        "Called with:\n  x: f32[n=2]\n  y: f32[n=4]\nBound so far: n=2 (x)",
    ),
    "a broadcastable axis of the wrong size may also be 1": (
        lambda: _broadcast_second(_z(3), _z(4)),
        "_broadcast_second(): y has n=4 (axis 0), but x set n=3 (or 1, to broadcast).\n"
        "Called with:\n  x: f32[n=3]\n  y: f32[n=4]\nBound so far: n=3 (x)",
    ),
    "the second alternative of a union binds its names": (
        lambda: _vector_or_matrix(_z(2, 3), _z(4)),
        "_vector_or_matrix(): y has m=4 (axis 0), but x set m=2.\n"
        "Called with:\n  x: f32[m=2, n=3]\n  y: f32[m=4]\nBound so far: m=2 (x), n=3 (x)",
    ),
    "a name that starts with X": (
        lambda: _capital(_z(3), _z(4)),
        "_capital(): y has Xa=4 (axis 0), but x set Xa=3.\n"
        "Called with:\n  x: f32[Xa=3]\n  y: f32[Xa=4]\nBound so far: Xa=3 (x)",
    ),
    "a union of two types, not optional": (
        lambda: _int_or_str(_z(3), 2.5),  # type: ignore[arg-type]
        "_int_or_str(): k must be int | str, but got float 2.5.\nCalled with:\n  x: f32[n=3]\nBound so far: n=3 (x)",
    ),
    "a result that is no tensor (no conversion is suggested: the function's own code makes it)": (
        lambda: _listed(_z(3)),
        "_listed(): the result must be a torch.Tensor, but got list.\n"
        "Called with:\n  x: f32[n=3]\nBound so far: n=3 (x)",
    ),
    "a union naming a typing form, shown without its module": (
        lambda: _int_or_list(_z(3), 2.5),  # type: ignore[arg-type]
        "_int_or_list(): k must be int | list[Any], but got float 2.5.\n"
        "Called with:\n  x: f32[n=3]\nBound so far: n=3 (x)",
    ),
}


@pytest.mark.parametrize("case", WHOLE_MESSAGES)
def test_a_decorated_functions_mistake_gets_its_whole_message(case: str) -> None:
    call, message = WHOLE_MESSAGES[case]
    assert _message(call) == message


_X = torch.randn(2, 6, 16)
# A key_padding_mask mistake -> the first line, whole: what is wrong, then what a key_padding_mask is.
_PADDING = " key_padding_mask is (batch, kv_seq) bool, True = padding."
PADDING_MISTAKES = {
    "float": (
        {"key_padding_mask": torch.zeros(2, 6)},
        "key_padding_mask has dtype float32, but it must be bool.",
    ),
    "3-D": (
        {"key_padding_mask": torch.zeros(2, 6, 6, dtype=torch.bool)},
        "key_padding_mask must be 2-D (batch kv_seq), but it is 3-D with shape (2, 6, 6).",
    ),
    "a list": (
        {"key_padding_mask": [[True]]},
        "key_padding_mask must be a torch.Tensor, but got list; convert it with torch.as_tensor(key_padding_mask).",
    ),
    "on another device": (
        {"key_padding_mask": torch.zeros(2, 6, dtype=torch.bool, device="meta")},
        "key_padding_mask is on meta, but the module's parameters are on cpu.",
    ),
}


@pytest.mark.parametrize("case", PADDING_MISTAKES)
def test_a_padding_mask_mistake_says_what_a_padding_mask_is(case: str) -> None:
    kwargs, sentence = PADDING_MISTAKES[case]
    module = ssm.MultiHeadAttention(16, 4, 2)
    first = _message(lambda: module(_X, **kwargs)).splitlines()[0]
    assert first == f"MultiHeadAttention.forward(): {sentence}{_PADDING}"


def test_a_width_that_does_not_split_lists_eight_head_counts_that_would() -> None:
    """720 has 30 divisors: the suggestion shows the first eight, then an ellipsis."""
    first = _message(lambda: ssm.split_heads(_z(1, 2, 720), 7)).splitlines()[0]
    assert first == (
        "split_heads(): x has width 720 (axis 2), which does not split into num_heads=7 equal heads; "
        "num_heads must divide it (one of {1, 2, 3, 4, 5, 6, 8, 9, ...})."
    )


@ssm.shapecheck
def _with_pair(x: Float[Tensor, " d"], pair: tuple[Float[Tensor, " d"], int]) -> Float[Tensor, " d"]:
    return x * pair[1]


@ssm.shapecheck
def _with_parts(x: Float[Tensor, " d"], parts: tuple[Float[Tensor, " d"], ...]) -> Float[Tensor, " d"]:
    return x


# A tuple argument's mistake -> the first line, whole: the part that fails by its index, or the tuple's length;
# a tuple where a tensor belongs is told it is not a tensor.
TUPLE_MISTAKES = {
    "a part of another size": (
        lambda: _with_pair(_z(3), (_z(4), 2)),
        "_with_pair(): pair[0] has d=4 (axis 0), but x set d=3.",
    ),
    "a part of another kind": (
        lambda: _with_pair(_z(3), (_z(3), "2")),  # type: ignore[arg-type]
        "_with_pair(): pair[1] must be int, but got str '2'.",
    ),
    "a tuple too short": (
        lambda: _with_pair(_z(3), (_z(3),)),  # type: ignore[arg-type]
        "_with_pair(): pair must be a tuple of 2, but got a tuple of 1.",
    ),
    "every part of a tuple of any length (beartype samples one part of it: each must be wrong to be seen)": (
        lambda: _with_parts(_z(3), (_z(4), _z(4))),
        "_with_parts(): parts[0] has d=4 (axis 0), but x set d=3.",
    ),
    "the first part of a tuple of any length": (
        lambda: _with_parts(_z(3), (_z(2),)),
        "_with_parts(): parts[0] has d=2 (axis 0), but x set d=3.",
    ),
    "a tuple for a tensor": (
        lambda: _with_pair((_z(3), _z(3)), (_z(3), 2)),  # type: ignore[arg-type]
        "_with_pair(): x must be a torch.Tensor, but got tuple; convert it with torch.as_tensor(x).",
    ),
}


@pytest.mark.parametrize("case", TUPLE_MISTAKES)
def test_a_tuple_argument_is_explained_by_its_part_or_its_length(case: str) -> None:
    call, first_line = TUPLE_MISTAKES[case]
    assert _message(call).splitlines()[0] == first_line


@ssm.shapecheck
def _with_array(x: Float[Tensor, " d"], pair: tuple[Float[np.ndarray, " d"], int]) -> Float[Tensor, " d"]:
    return x


def test_a_tuple_whose_failing_part_is_another_librarys_array_gets_the_annotation() -> None:
    """No reason of ours for a numpy part: the tuple is named with its annotation (not a crash while explaining)."""
    first = _message(lambda: _with_array(_z(3), (np.ones(4, dtype=np.float32), 1))).splitlines()[0]
    assert first == "_with_array(): pair does not satisfy its annotation tuple[jaxtyping.Float[ndarray, 'd'], int]."


def _window_cache_seen_7() -> tuple[ssm.MultiHeadAttention, ssm.KVCache]:
    module = ssm.MultiHeadAttention(16, 4, window=3)
    cache = module.new_cache(1, 4)
    for _ in range(6):
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    return module, cache


def _a_mask_over_the_kept_positions_only(name: str) -> None:
    """A window cache that has seen 7 positions and kept 3, and a mask over the kept ones and the new one."""
    module, cache = _window_cache_seen_7()
    mask = torch.ones(1, cache.kept + 1).bool() if name == "attn_mask" else torch.zeros(1, cache.kept + 1).bool()
    module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache, **{name: mask})


def _latent_with_a_float64_cache() -> None:
    small = ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    small(torch.randn(1, 3, 16), kv_cache=small.new_cache(1, 8).to(torch.float64))


def _under_bf16_autocast_a_padding_mask_on_meta() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(
            torch.randn(2, 3, 16),
            attn_mask=torch.zeros(3, 3, dtype=torch.float64),  # another float dtype: autocast's to cast
            key_padding_mask=torch.zeros(2, 3, dtype=torch.bool, device="meta"),
        )


_Q, _K = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
_UNFLATTEN = "From (batch*num_heads, seq, kv_seq): attn_mask.unflatten(0, (batch, -1))."
_FORWARD_FLOAT_MASK = (
    "MultiHeadAttention.forward(): attn_mask has dtype float64; a float mask is added to the scores, so it must be "
    "float32 like the module (or bool: True = may attend)."
)
# (what, the call, the error, its whole first line): the explicit checks of the stages, each sentence pinned
STAGE_REFUSALS: list[tuple[str, Any, type[Exception], str]] = [
    (
        "a float mask of another dtype",
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, attn_mask=torch.zeros(4, 6, dtype=torch.float64)),
        ssm.ShapeError,
        "scaled_dot_product_attention(): attn_mask has dtype float64, but q has float32; a float mask is added to the "
        "scores, so cast it (attn_mask.to(q.dtype)).",
    ),
    (
        "nn.MultiheadAttention's 3-D float mask of another dtype",
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, attn_mask=torch.zeros(2, 4, 6, dtype=torch.float64)),
        ssm.ShapeError,
        "scaled_dot_product_attention(): attn_mask has dtype float64, but q has float32; a float mask is added to the "
        f"scores, so cast it (attn_mask.to(q.dtype)). {_UNFLATTEN}",
    ),
    (
        "nn.MultiheadAttention's 3-D mask on another device",
        lambda: ssm.scaled_dot_product_attention(
            _Q, _K, _K, attn_mask=torch.ones(2, 4, 6, dtype=torch.bool, device="meta")
        ),
        ssm.ShapeError,
        "scaled_dot_product_attention(): attn_mask is on meta, but q is on cpu; move them to one device (for example "
        f"attn_mask.to(q.device)). {_UNFLATTEN}",
    ),
    (
        "more KV heads than query heads",
        lambda: ssm.scaled_dot_product_attention(
            torch.randn(1, 2, 4, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
        ),
        ssm.ShapeError,
        "scaled_dot_product_attention(): q has num_heads=2 (axis 1), which is not a multiple of k's num_kv_heads=4; "
        "each KV head must serve a whole group of query heads; are q and k swapped?",
    ),
    (
        "dropout of 1",
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, dropout_p=1.0),
        ssm.ConfigError,
        "scaled_dot_product_attention(): dropout_p must be in [0, 1), but got 1.0.",
    ),
    (
        "a window of 0",
        lambda: ssm.scaled_dot_product_attention(_Q, _K, _K, window=0),
        ssm.ConfigError,
        "scaled_dot_product_attention(): window must be a positive int (the keys a query sees, itself included), "
        "but got 0.",
    ),
    (
        "no heads",
        lambda: ssm.split_heads(torch.randn(1, 3, 8), 0),
        ssm.ConfigError,
        "split_heads(): num_heads must be a positive int, but got 0.",
    ),
    (
        "no KV heads",
        lambda: ssm.group_queries(_Q, 0),
        ssm.ConfigError,
        "group_queries(): num_kv_heads must be a positive int, but got 0.",
    ),
    (
        "KV heads that do not divide the query heads",
        lambda: ssm.group_queries(torch.randn(1, 8, 4, 8), 3),
        ssm.ShapeError,
        "group_queries(): q has num_heads=8 (axis 1), which num_kv_heads=3 does not divide; each KV head must serve a "
        "whole group of query heads.",
    ),
    (
        "a bias of another dtype",
        lambda: ssm.project(torch.randn(1, 3, 8), torch.randn(4, 8), torch.randn(4, dtype=torch.float64)),
        ssm.ShapeError,
        "project(): bias has dtype float64, but x has float32; cast one of them (for example bias.to(x.dtype)).",
    ),
    (
        "a dict for a cache",
        lambda: ssm.MultiHeadAttention(16, 4, 2)(torch.randn(1, 3, 16), kv_cache={}),
        ssm.ShapeError,
        "MultiHeadAttention.forward(): kv_cache must be a shapesafe_mha.KVCache, but got dict; make one with "
        "module.new_cache(batch, capacity).",
    ),
    (
        "a cache of another dtype",
        lambda: ssm.MultiHeadAttention(16, 4, 2)(
            torch.randn(1, 3, 16), kv_cache=ssm.KVCache(1, 2, 8, 4, dtype=torch.float64)
        ),
        ssm.ShapeError,
        "MultiHeadAttention.forward(): kv_cache holds float64 on cpu, but the module computes float32 on cpu; use "
        "module.new_cache(batch, capacity) or kv_cache.to(torch.float32, 'cpu').",
    ),
    (
        "a latent cache of another dtype",
        _latent_with_a_float64_cache,
        ssm.ShapeError,
        "LatentAttention.forward(): kv_cache holds float64 on cpu, but the module computes float32 on cpu; use "
        "module.new_cache(batch, capacity).",
    ),
    (
        "a module's float mask of another dtype",
        lambda: ssm.MultiHeadAttention(16, 4, 2)(
            torch.randn(2, 3, 16), attn_mask=torch.zeros(3, 3, dtype=torch.float64)
        ),
        ssm.ShapeError,
        _FORWARD_FLOAT_MASK,
    ),
    (
        "a module's 3-D float mask of another dtype",
        lambda: ssm.MultiHeadAttention(16, 4, 2)(
            torch.randn(2, 3, 16), attn_mask=torch.zeros(8, 3, 3, dtype=torch.float64)
        ),
        ssm.ShapeError,
        f"{_FORWARD_FLOAT_MASK} {_UNFLATTEN}",
    ),
    (
        "a float mask of another dtype on meta",  # autocast is asked about, and meta has none
        lambda: ssm.MultiHeadAttention(16, 4, 2, device="meta")(
            torch.randn(2, 3, 16, device="meta"), attn_mask=torch.zeros(3, 3, dtype=torch.float64, device="meta")
        ),
        ssm.ShapeError,
        _FORWARD_FLOAT_MASK,
    ),
    (
        "under autocast, a padding mask on another device beside a float mask of another dtype",
        _under_bf16_autocast_a_padding_mask_on_meta,
        ssm.ShapeError,
        "MultiHeadAttention.forward(): key_padding_mask is on meta, but the module's parameters are on cpu. "
        "key_padding_mask is (batch, kv_seq) bool, True = padding.",
    ),
    *(
        (
            f"a window cache's {name} over the kept positions only",
            functools.partial(_a_mask_over_the_kept_positions_only, name),
            ssm.ShapeError,
            f"MultiHeadAttention.forward(): {name} covers 5 key positions, but the sliding-window kv_cache has seen 7 "
            "(cached and new); with a window, masks cover every position seen (the cache keeps the last 3).",
        )
        for name in ("attn_mask", "key_padding_mask")
    ),
]


@pytest.mark.parametrize(
    ("what", "call", "error", "first"), STAGE_REFUSALS, ids=[r[0].replace(" ", "_") for r in STAGE_REFUSALS]
)
def test_a_stage_refusal_says_what_is_wrong_and_the_fix(
    what: str, call: Any, error: type[Exception], first: str
) -> None:
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).splitlines()[0] == first


def test_a_value_of_the_wrong_width_gets_no_hint_meant_for_another_mistake() -> None:
    """v's d_head wrong, where kv_seq equals d_head and v's width equals seq: neither 'k looks transposed' nor
    'are q and k swapped' applies, and the message offers neither."""
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 4)
    with pytest.raises(ssm.ShapeError) as caught:
        ssm.scaled_dot_product_attention(q, k, v)
    assert (
        str(caught.value).splitlines()[0]
        == "scaled_dot_product_attention(): v has d_head=4 (axis 3), but q set d_head=8."
    )


def _forward(module: ssm.MultiHeadAttention, *sizes: tuple[int, int], cached: bool = False) -> None:
    """The module called on query, key and value of these (batch, positions), into a new cache if `cached`."""
    kwargs = {"kv_cache": module.new_cache(2, 10)} if cached else {}
    module(*(torch.randn(batch, n, 16) for batch, n in sizes), **kwargs)


FORWARD_HINTS = {
    "value over other positions": (
        {}, [(2, 5), (2, 7), (2, 6)], False,
        "value has kv_seq=6 (axis 1), but key set kv_seq=7. key and value must cover the same positions.",
    ),
    "new value over other positions": (
        {}, [(2, 3), (2, 3), (2, 2)], True,
        "value has new=2 (axis 1), but key set new=3. key and value must cover the same positions.",
    ),
    "value of another batch": (
        {}, [(2, 5), (2, 7), (3, 7)], False,
        "value has batch=3 (axis 0), but query set batch=2. value needs one sequence per query sequence.",
    ),
    "rotary cross-attention (no hint beside the refusal)": (
        {"rope_theta": 1e4}, [(2, 5), (2, 7)], False,
        "key has kv_seq=7 positions for the query's seq=5, but this module rotates queries and keys by the same "
        "positions (rope_theta=10000.0): cross-attention with rotary embeddings is not supported. Build the module "
        "with rope_theta=None for cross-attention.",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", FORWARD_HINTS)
def test_a_forward_mistake_gets_the_hint_of_its_own_cause_and_no_other(case: str) -> None:
    """Key and value over other positions, or of another batch, each get their cause's hint; the rotary refusal of
    cross-attention (key, kv_seq) is not mistaken for a value mistake."""
    options, sizes, cached, first = FORWARD_HINTS[case]
    with pytest.raises(ssm.ShapeError) as caught:
        _forward(ssm.MultiHeadAttention(16, 4, 2, **options), *sizes, cached=cached)
    assert str(caught.value).splitlines()[0] == f"MultiHeadAttention.forward(): {first}"


_OWNER = "MultiHeadAttention(d_model=16, num_heads=4, num_kv_heads=2)"
MODULE_REFUSALS = {
    "QK-norm after RoPE without a QK-norm": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, qk_norm_after_rope=True),
        f"{_OWNER}: qk_norm_after_rope=True needs qk_norm=True over each head (qk_norm_over='head', an RMSNorm: "
        "HunYuan's), but got qk_norm_after_rope=True, qk_norm=False, qk_norm_over='head'.",
    ),
    "QK-norm after RoPE with a centred norm": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, qk_norm=True, qk_norm_centred=True, qk_norm_after_rope=True),
        f"{_OWNER}: qk_norm_after_rope=True needs qk_norm=True over each head (qk_norm_over='head', an RMSNorm: "
        "HunYuan's), but got qk_norm_after_rope=True, qk_norm=True, qk_norm_over='head', qk_norm_centred=True.",
    ),
    "an output gate with clip_qkv": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, output_gate=True, clip_qkv=8.0),
        f"{_OWNER}: output_gate=True with a QK-norm over every head or clip_qkv: no model computes them together, "
        "and the gate's place among them is not known.",
    ),
    **{
        f"chunk_size={size!r}": (
            functools.partial(ssm.MultiHeadAttention, 16, 4, 2, chunk_size=size),
            f"{_OWNER}: chunk_size must be a positive int (Llama 4: 8192), but got {size!r}.",
        )
        for size in (True, 2.5, 0)
    },
    "no model width": (
        lambda: ssm.MultiHeadAttention(0, 4, 2),
        "MultiHeadAttention(d_model=0, num_heads=4, num_kv_heads=2): d_model must be a positive int, but got 0.",
    ),
    "no KV heads": (
        lambda: ssm.MultiHeadAttention(16, 4, 0),
        "MultiHeadAttention(d_model=16, num_heads=4, num_kv_heads=0): num_kv_heads must be a positive int, but got 0.",
    ),
    "a head width of 0": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, d_head=0),
        f"{_OWNER}: d_head must be a positive int, but got 0.",
    ),
    "a rotary width of 1, whose only even neighbour is above it": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, rope_theta=1e4, rope_dim=1),
        f"{_OWNER}: rope_dim=1, but the rotary part of a head must be an even int in [2, d_head=4] (for example 2): "
        "rotary embeddings rotate pairs of a head's features.",
    ),
    **{
        f"rope_dim={width!r}, not an int": (
            functools.partial(ssm.MultiHeadAttention, 16, 4, 2, rope_theta=1e4, rope_dim=width),
            f"{_OWNER}: rope_dim={width!r}, but the rotary part of a head must be an even int in [2, d_head=4]: "
            "rotary embeddings rotate pairs of a head's features.",
        )
        for width in (True, "4")  # no width suggested: neither has int neighbours
    },
    "positions without RoPE": (
        lambda: ssm.MultiHeadAttention(16, 4, 2)(torch.randn(1, 3, 16), positions=torch.arange(3)[None]),
        "MultiHeadAttention.forward(): positions were given, but this module has no rotary embeddings "
        "(rope_theta=None): nothing would use them. Build it with rope_theta=..., or drop positions.",
    ),
    "a cache keeping a narrower window": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, window=4)(
            torch.randn(1, 3, 16), kv_cache=ssm.KVCache(1, 2, 8, 4, dtype=torch.float32, window=2)
        ),
        "MultiHeadAttention.forward(): kv_cache keeps a window of 2 positions, but the module attends over a window "
        "of 4; it would have dropped keys the module needs. Make it with module.new_cache(batch, capacity).",
    ),
}


@pytest.mark.parametrize("case", MODULE_REFUSALS)
def test_a_module_refusal_is_a_config_or_shape_error_saying_what_was_given_and_the_fix(case: str) -> None:
    """Options that do not go together, a size that is not a positive int (a bool is not one; a rotary width's
    message suggests the nearest even one that fits), positions no rotary embedding reads and a cache that drops
    keys are refused when made or called, each with its whole sentence: what was given and what to do instead."""
    call, first = MODULE_REFUSALS[case]
    with pytest.raises((ssm.ConfigError, ssm.ShapeError)) as caught:
        call()
    assert str(caught.value).splitlines()[0] == first
