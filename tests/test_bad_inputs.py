"""Every bad input is answered by the library: a `ShapeError` or `ConfigError` naming the argument and the fix, or,
where torch accepts the input, torch's own result. One case a test (issue 44's red-team list), then a fuzz of the
public entry points with wrong types and sizes: nothing but the library's errors or a result comes out."""

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shapesafe_mha as ssm

_MHA = "MultiHeadAttention.forward(): "


def _first_line(call: Callable[[], Any], error: type[Exception]) -> str:
    with pytest.raises(error) as caught:
        call()
    return str(caught.value).splitlines()[0]


# --- a projection's parameter replaced by one of another dtype or width, every route -----------------------

_PARAMETERS: dict[str, tuple[Callable[[nn.Linear], nn.Parameter], str, str]] = {
    # what replaces it, which of the projection's parameters, the first line's sentence after "at <proj>, "
    "weight float64": (
        lambda p: nn.Parameter(p.weight.double()),
        "weight",
        r"{p}\.weight is float64 on cpu, but {x} is float32 on cpu; keep the module's parameters in one dtype",
    ),
    "weight narrower": (
        lambda p: nn.Parameter(p.weight[:, :8].clone()),
        "weight",
        r"{p}\.weight has shape \(\d+, 8\), but {p} reads {x}'s 16 features, so it must be \(out_features, 16\)",
    ),
    "bias of one feature": (
        lambda p: nn.Parameter(torch.zeros(1)),
        "bias",
        r"{p}\.bias has shape \(1,\), but {p}\.weight has \d+ output features, so it must be \(\d+,\)",
    ),
}
_READS = {"q": "query", "k": "key", "v": "value", "o": "the merged heads"}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
@pytest.mark.parametrize("role", "qkvo")
@pytest.mark.parametrize("change", list(_PARAMETERS))
def test_a_projection_parameter_of_another_dtype_or_width_is_named_fresh_or_warm(
    change: str, role: str, warm: bool, grad: bool
) -> None:
    """`m.q_proj.weight = nn.Parameter(...)` of float64, of fewer columns, or a bias of one feature (which torch
    broadcasts silently with grad, and refuses raw without): a ShapeError naming the parameter and its shape, on a
    first call and on a call whose verdict was remembered, with grad and without (the fused and separate paths)."""
    m = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 5, 16)
    mode = contextlib.nullcontext() if grad else torch.no_grad()
    if warm:
        with mode:
            m(x)
    make, part, sentence = _PARAMETERS[change]
    proj = getattr(m, f"{role}_proj")
    setattr(proj, part, make(proj))
    with mode:
        first = _first_line(lambda: m(x), ssm.ShapeError)
    if role == "q" and change == "weight float64":  # q_proj's is the module's first parameter: the module's dtype
        assert first.startswith(f"{_MHA}query has dtype float32, but the module's parameters are float64"), first
        return
    expected = sentence.format(p=f"{role}_proj", x=_READS[role])
    assert first.startswith(f"{_MHA}at {role}_proj, "), first
    assert re.match(expected, first.removeprefix(f"{_MHA}at {role}_proj, ")), first


# --- one call a case ---------------------------------------------------------------------------------------


def _partial_decorated() -> Any:
    def scale(x: Any, factor: float) -> Any:
        return x * factor

    return ssm.shapecheck(functools.partial(scale, factor=2.0))


CASES: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "rope_scaling a string": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, rope_theta=1e4, rope_scaling="yarn"),  # type: ignore[arg-type]
        ssm.ConfigError,
        "RotaryEmbedding(): rope_scaling must be a dict of transformers' rope_parameters, such as "
        "{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 4096}, but got 'yarn'.",
    ),
    "an int dtype": (
        lambda: ssm.MultiHeadAttention(16, 4, 2, dtype=torch.int64),
        ssm.ConfigError,
        "MultiHeadAttention(d_model=16, num_heads=4, num_kv_heads=2): dtype=torch.int64 is not a floating-point "
        "torch.dtype, but the weights are learned and softmax needs fractions; pass torch.float32, torch.bfloat16, "
        "torch.float16 or torch.float64.",
    ),
    "from_torch of a Linear": (
        lambda: ssm.MultiHeadAttention.from_torch(nn.Linear(4, 4)),  # type: ignore[arg-type]
        ssm.ConfigError,
        "MultiHeadAttention.from_torch(): module must be a torch.nn.MultiheadAttention, but got Linear; for "
        "projections of your own, pass their weights to MultiHeadAttention.from_weights(AttentionWeights(w_q, w_k, "
        "w_v, w_o, ...), num_heads=...).",
    ),
    "from_weights of a tuple": (
        lambda: ssm.MultiHeadAttention.from_weights((1, 2, 3), num_heads=1),  # type: ignore[arg-type]
        ssm.ConfigError,
        "MultiHeadAttention.from_weights(): weights must be an AttentionWeights(w_q, w_k, w_v, w_o, b_q, b_k, b_v, "
        "b_o) of tensors in nn.Linear's layout, but got tuple.",
    ),
    "from_weights with a head count that is no int": (
        lambda: ssm.MultiHeadAttention.from_weights(
            ssm.MultiHeadAttention(8, 2).weights(),
            num_heads="2",  # type: ignore[arg-type]
        ),
        ssm.ConfigError,
        "MultiHeadAttention.from_weights(): num_heads must be a positive int, but got '2'.",
    ),
    "to_hf of None": (
        lambda: ssm.MultiHeadAttention(16, 4, 2).to_hf(None),
        ssm.ConfigError,
        "MultiHeadAttention.to_hf(): config must be a transformers model config (LlamaConfig(...), "
        "AutoConfig.from_pretrained(name)), but got NoneType.",
    ),
    "inverse_frequencies of a string width": (
        lambda: ssm.inverse_frequencies("8", 1e4),  # type: ignore[arg-type]
        ssm.ConfigError,
        "RotaryEmbedding(): d_head must be an int (the features a head rotates), but got '8'.",
    ),
    "expect of a number": (
        lambda: ssm.expect(torch.zeros(2), 123),
        ssm.ConfigError,
        'expect(): shape must be a string of dimension names ("batch seq d_model") or a jaxtyping annotation '
        '(Float[Tensor, "batch seq d_model"]), but got 123.',
    ),
    "expect of a string jaxtyping refuses": (
        lambda: ssm.expect(torch.zeros(2), "a ...b ...c"),
        ssm.ConfigError,
        "expect(): shape='a ...b ...c' is not a jaxtyping shape string: ",
    ),
    "shapecheck of a partial": (
        _partial_decorated,
        ssm.ConfigError,
        "shapecheck: a functools.partial is no function with annotations of its own to check; decorate the function "
        "itself (def, or a method), and bind arguments afterwards: functools.partial(shapecheck(fn), ...).",
    ),
    "flex_attention without a key": (
        lambda: ssm.flex_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)),
        ssm.ShapeError,
        "flex_attention(): k has kv_seq=0 (axis 2), but FlexAttention needs at least one key position to attend to; "
        "skip the call for an empty context, or use scaled_dot_product_attention, whose rows without a key are zeros.",
    ),
    "a nested tensor into the module": (
        lambda: ssm.MultiHeadAttention(16, 4, 2)(
            torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(3, 16)], layout=torch.jagged)
        ),
        ssm.ShapeError,
        f"{_MHA}query is a nested tensor, but shapesafe_mha computes on dense tensors; pad it "
        "(torch.nested.to_padded_tensor(query, 0.0)) and mask the padding.",
    ),
    "a nested tensor into a stage": (
        lambda: ssm.split_heads(
            torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(3, 16)], layout=torch.jagged), 4
        ),
        ssm.ShapeError,
        "split_heads(): x is a nested tensor, but shapesafe_mha computes on dense tensors; pad it "
        "(torch.nested.to_padded_tensor(x, 0.0)) and mask the padding.",
    ),
    "a sparse tensor into the module": (
        lambda: ssm.MultiHeadAttention(16, 4, 2)(torch.randn(2, 5, 16).to_sparse()),
        ssm.ShapeError,
        f"{_MHA}query is a sparse (torch.sparse_coo) tensor, but shapesafe_mha computes on dense tensors; make it "
        "dense (query.to_dense()).",
    ),
    "a sparse tensor into a stage": (
        lambda: ssm.split_heads(torch.randn(2, 5, 16).to_sparse(), 4),
        ssm.ShapeError,
        "split_heads(): x is a sparse (torch.sparse_coo) tensor, but shapesafe_mha computes on dense tensors; make "
        "it dense (x.to_dense()).",
    ),
    "a trace of an unknown dtype": (
        lambda: ssm.trace_forward(ssm.TraceConfig(64, 4, 2, dtype="int8")),
        ssm.ConfigError,
        "trace_forward(): dtype='int8' is not one of 'float32', 'float64', 'float16', 'bfloat16'; pass one of them.",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_the_librarys_error_naming_the_argument_and_the_fix(case: str) -> None:
    """Each bad input issue 44 found raising a raw error (ValueError, AttributeError, TypeError, IndexError,
    beartype's, torch's) is refused with the library's error: the argument, what was given and what to do."""
    call, error, first = CASES[case]
    assert _first_line(call, error).startswith(first)


def test_a_sparse_tensor_after_a_dense_verdict_of_its_shape_is_refused_by_name_too() -> None:
    """A stage's verdict key holds no layout: a sparse tensor of a remembered dense shape fails in torch, and is run
    again checked to be explained, as a module's remembered forward is."""
    x = torch.randn(2, 5, 16)
    ssm.split_heads(x, 4)
    first = _first_line(lambda: ssm.split_heads(x.to_sparse(), 4), ssm.ShapeError)
    assert first.startswith("split_heads(): x is a sparse (torch.sparse_coo) tensor")
    m = ssm.MultiHeadAttention(16, 4, 2)
    m(x)
    assert _first_line(lambda: m(x.to_sparse()), ssm.ShapeError).startswith(f"{_MHA}query is a sparse")


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_flex_attention_with_no_query_is_torchs_empty_result(num_kv_heads: int) -> None:
    """seq=0: torch's FlexAttention returns an empty (batch, num_heads, 0, d_head) result for as many KV heads as
    query heads; so does ours, for GQA and MQA too (where torch's eager path cannot run our unfolding mod), with a
    score_mod or without."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k = torch.randn(2, 4, 0, 8), torch.randn(2, num_kv_heads, 5, 8)
    expected = torch_flex(q, k.repeat_interleave(4 // num_kv_heads, 1), k.repeat_interleave(4 // num_kv_heads, 1))
    for score_mod in (None, lambda score, b, h, q_idx, kv_idx: score * 2):
        got = ssm.flex_attention(q, k, k, score_mod)
        assert got.shape == expected.shape == (2, 4, 0, 8) and got.dtype == expected.dtype


@pytest.mark.parametrize("sizes", [{"seq": 0}, {"batch": 0}])
def test_a_trace_of_no_position_or_no_sequence_reports_its_ratios_by_heads(sizes: dict[str, int]) -> None:
    """trace_forward at seq=0 (or batch=0) divided 0 bytes by 0: the cache's ratios are its heads' (8 of 32 KV heads
    cache a quarter of MHA's), which is what the bytes give at any other size."""
    report = ssm.trace_forward(ssm.TraceConfig(**sizes))  # type: ignore[arg-type]
    assert report.totals["kv_cache_bytes"] == 0
    assert report.totals["kv_cache_ratio_vs_mha"] == 8 / 32 == ssm.trace_forward().totals["kv_cache_ratio_vs_mha"]
    assert report.totals["kv_cache_ratio_mqa_vs_mha"] == 1 / 32


# --- a fuzz of the public entry points: the library's errors or a result, nothing raw ----------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A small tensor of any rank, sizes near the ones the entry points use (0, 1, 2, 4, 8, 16), any dtype; now and
    then sparse, or a non-contiguous view."""
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 8, 16]), max_size=5))
    dtype = draw(st.sampled_from(_DTYPES))
    tensor = torch.ones(shape, dtype=dtype) if dtype is torch.bool else torch.randn(shape).to(dtype)
    kind = draw(st.sampled_from(["plain", "plain", "plain", "sparse", "transposed"]))
    if kind == "sparse" and tensor.ndim:
        return tensor.to_sparse()
    if kind == "transposed" and tensor.ndim >= 2:
        return tensor.transpose(-1, -2)
    return tensor


# Anything a caller might pass by mistake: tensors, sizes of every sign, non-finite numbers, strings, containers.
_VALUES = st.one_of(
    _tensors(),
    _tensors(),
    st.integers(-2, 17),
    st.booleans(),
    st.sampled_from([0.0, -1.0, 0.5, 1e4, float("nan"), float("inf")]),
    st.sampled_from(["", "8", "batch seq d_model", "yarn"]),
    st.none(),
    st.tuples(st.integers(0, 4), st.integers(0, 4)),
    st.sampled_from([[1, 2], {"rope_type": "yarn"}, {"rope_type": "nope"}, object()]),
)


def _module(*sizes: Any, **options: Any) -> Any:
    return ssm.MultiHeadAttention(*sizes, **options)


def _forward(m_options: dict[str, Any], *tensors: Any, **options: Any) -> Any:
    return ssm.MultiHeadAttention(16, 4, 2, **m_options)(*tensors, **options)


# name: (the entry point, how many positional arguments it takes, keyword arguments one draw may add)
_ENTRY_POINTS: dict[str, tuple[Callable[..., Any], int, tuple[str, ...]]] = {
    "split_heads": (ssm.split_heads, 2, ()),
    "merge_heads": (ssm.merge_heads, 1, ()),
    "project": (ssm.project, 3, ()),
    "scaled_dot_product_attention": (ssm.scaled_dot_product_attention, 3, ("attn_mask", "is_causal", "window")),
    "attention_weights": (ssm.attention_weights, 2, ("attn_mask", "scale", "softcap")),
    "group_queries": (ssm.group_queries, 2, ()),
    "apply_rotary": (ssm.apply_rotary, 4, ("interleaved",)),
    "expect": (ssm.expect, 2, ()),
    "inverse_frequencies": (ssm.inverse_frequencies, 3, ()),
    "MultiHeadAttention": (_module, 3, ("d_head", "rope_theta", "rope_scaling", "window", "dtype", "bias")),
    "MultiHeadAttention.forward": (functools.partial(_forward, {}), 1, ("attn_mask", "key_padding_mask", "is_causal")),
    "MultiHeadAttention.forward (RoPE)": (functools.partial(_forward, {"rope_theta": 1e4}), 1, ("positions",)),
    "MultiHeadAttention.from_weights": (ssm.MultiHeadAttention.from_weights, 1, ("num_heads", "num_kv_heads")),
    "MultiHeadAttention.from_torch": (ssm.MultiHeadAttention.from_torch, 1, ()),
    "AttentionWeights.check": (lambda *w: ssm.AttentionWeights(*w[:4]).check(w[4], w[5]), 6, ()),
}


@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
@given(data=st.data())
def test_a_public_entry_point_given_wrong_types_and_sizes_raises_only_the_librarys_errors(
    entry: str, data: st.DataObject
) -> None:
    """Whatever an entry point is given (tensors of any rank, size, dtype and layout; ints, floats, strings, None,
    containers), it returns or raises the library's own error, a ShapeError or ConfigError, never torch's, Python's or
    beartype's from inside."""
    call, arity, keywords = _ENTRY_POINTS[entry]
    args = [data.draw(_VALUES, label=f"argument {i}") for i in range(arity)]
    kwargs = {k: data.draw(_VALUES, label=k) for k in keywords if data.draw(st.booleans(), label=f"pass {k}")}
    if entry == "MultiHeadAttention.from_weights":
        kwargs.setdefault("num_heads", data.draw(_VALUES, label="num_heads"))
    with contextlib.suppress(ssm.ShapesafeError):
        call(*args, **kwargs)


# --- from_hf names the real reason, or accepts what computes the same ---------------------------------------


def test_from_hf_of_mistral_at_sliding_window_1_names_the_decoding_step_not_rope() -> None:
    """At sliding_window=1 transformers' Mistral attends past its window in a decoding step (its forward keeps each
    query to its own key, as ours does in both): the refusal names that, not the rotary embeddings."""
    pytest.importorskip("transformers")
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=1,
                           num_hidden_layers=1, intermediate_size=64, vocab_size=10)  # fmt: skip
    with pytest.raises(ssm.ConfigError) as caught:
        ssm.MultiHeadAttention.from_hf(MistralAttention(config, 0))
    text = str(caught.value)
    assert "differs from MistralAttention by" in text and "in a decoding step" in text, text
    assert text.endswith(
        "Known to differ here: the decoding step alone (the causal forward agrees): with sliding_window=1, "
        "MistralAttention's decoding step attends to more than the query's own key, which its forward keeps to."
    ), text
    assert "rotary" not in text


def test_from_hf_of_a_cohere2_layer_without_rope_is_converted_without_rope() -> None:
    """Cohere2's full-attention layers apply no RoPE, whatever the config's rope_theta: seen (the layer's forward
    is the same with every position at 0), the layer converts without RoPE and verifies, where it was refused with
    RoPE blamed; its sliding layers keep theirs."""
    pytest.importorskip("transformers")
    from transformers import Cohere2Config
    from transformers.models.cohere2.modeling_cohere2 import Cohere2Attention

    config = Cohere2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                           num_hidden_layers=4, intermediate_size=64, vocab_size=10, eos_token_id=1, pad_token_id=0,
                           bos_token_id=2)  # fmt: skip
    for index, kind in enumerate(config.layer_types):
        module = ssm.MultiHeadAttention.from_hf(Cohere2Attention(config, index))
        assert (module.rotary is None) == (kind == "full_attention"), (index, kind)
