"""Rotary position embeddings as a typed stage, and Hugging Face layers loaded and computed as written."""

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import attention_configs, attention_inputs, projection_weights

F64 = {"atol": 1e-10, "rtol": 1e-8}


def _rope_config(data: st.DataObject, **kwargs: Any) -> Any:
    return data.draw(attention_configs(cross=False, max_seq=40, rope=True, **kwargs), label="config")


@given(data=st.data())
def test_module_with_rope_equals_the_per_head_reference(data: st.DataObject) -> None:
    """MHA/GQA/MQA with RoPE == the reference, which rotates each head's pairs itself."""
    config = _rope_config(data)
    theta = config.rope_theta
    weights = data.draw(projection_weights(config))
    x = data.draw(attention_inputs(config)).query
    is_causal = data.draw(st.booleans(), label="is_causal")
    module = ssm.MultiHeadAttention.from_weights(
        weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, rope_theta=theta
    )
    expected = per_head_attention(
        x, x, x, weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=is_causal,
        rope_theta=theta,
    )  # fmt: skip
    torch.testing.assert_close(module(x, is_causal=is_causal), expected, **F64)
    with torch.no_grad():
        torch.testing.assert_close(module(x, is_causal=is_causal), expected, **F64)


@given(data=st.data())
def test_decoding_with_rope_equals_one_causal_forward(data: st.DataObject) -> None:
    """Default positions continue from the cache: prefill in chunks, then token by token == full causal."""
    config = _rope_config(data)
    module = config.module()
    x = data.draw(attention_inputs(config)).query
    cache = module.new_cache(config.batch, config.seq)
    prefill = data.draw(st.integers(0, config.seq), label="prefill")
    steps = [module(x[:, :prefill], is_causal=True, kv_cache=cache)]
    steps += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, config.seq)]
    torch.testing.assert_close(torch.cat(steps, dim=1), module(x, is_causal=True), **F64)


@given(data=st.data())
def test_shifting_every_position_leaves_attention_unchanged(data: st.DataObject) -> None:
    """RoPE scores depend only on distances. (Angles are float32, as in transformers: 1e-5 apart.)"""
    config = _rope_config(data)
    module = ssm.MultiHeadAttention.from_weights(
        config.module().weights(), num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, rope_theta=10000.0
    )
    x = data.draw(attention_inputs(config)).query
    shift = data.draw(st.integers(1, 200), label="shift")
    positions = torch.arange(config.seq).expand(config.batch, config.seq)
    base = module(x, is_causal=True, positions=positions)
    torch.testing.assert_close(module(x, is_causal=True, positions=positions + shift), base, atol=1e-5, rtol=1e-5)


def test_a_left_padded_batch_gives_its_own_positions() -> None:
    """Row 1 is left-padded by 3: with its own positions it equals the same tokens unpadded."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2, rope_theta=10000.0, dtype=torch.float64)
    tokens = torch.randn(1, 4, 32, dtype=torch.float64)
    padded = torch.cat([torch.zeros(1, 3, 32, dtype=torch.float64), tokens], dim=1)
    positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3]])
    padding = torch.tensor([[True, True, True, False, False, False, False]])
    out = module(padded, is_causal=True, positions=positions, key_padding_mask=padding)
    torch.testing.assert_close(out[:, 3:], module(tokens, is_causal=True), **F64)


@pytest.mark.parametrize(("rope_dim", "interleaved"), [(None, False), (4, False), (None, True), (2, True)])
def test_a_rope_module_fit_for_torchs_fused_kernel_still_rotates_without_grad(
    rope_dim: int | None, interleaved: bool
) -> None:
    """Biased MHA whose heads tile d_model, in eval, not causal, under no_grad: everything torch's fused MHA kernel
    needs, but that kernel has no RoPE, so the no-grad output is still the grad-mode one and the reference's,
    full or partial rotary, halves or adjacent pairs."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, bias=True, rope_theta=10000.0, rope_dim=rope_dim,
                                    rope_interleaved=interleaved, dtype=torch.float64).eval()  # fmt: skip
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    style = "interleaved" if interleaved else "half"
    expected = per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=4, rope_theta=10000.0,
                                  rotary_dim=rope_dim, rope_style=style)  # fmt: skip
    with_grad = module(x)
    with torch.no_grad():
        without_grad = module(x)
    torch.testing.assert_close(with_grad, expected, **F64)
    torch.testing.assert_close(without_grad, with_grad, **F64)


def test_a_partial_rotary_over_adjacent_pairs_equals_the_reference_where_pairs_and_halves_differ() -> None:
    """rope_dim=4 of d_head=8 over adjacent pairs (0, 1), (2, 3) (GLM): the module == the per-head reference rotating
    those pairs, and != the one rotating the halves' pairs (0, 2), (1, 3) (with rope_dim=2 the two are one pair)."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2, rope_theta=10000.0, rope_dim=4, rope_interleaved=True,
                                    dtype=torch.float64)  # fmt: skip
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    reference = {style: per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=2, is_causal=True,
                                           rope_theta=10000.0, rotary_dim=4, rope_style=style)
                 for style in ("interleaved", "half")}  # fmt: skip
    out = module(x, is_causal=True)
    torch.testing.assert_close(out, reference["interleaved"], **F64)
    assert not torch.allclose(out, reference["half"])


def test_rotary_errors_name_what_is_wrong() -> None:
    module = ssm.MultiHeadAttention(32, 4, rope_theta=10000.0)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ssm.ShapeError, match=r"positions has seq=4 \(axis 1\), but query set seq=5"):
        module(x, positions=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ssm.ShapeError, match=r"positions has dtype float32, but it must be"):
        module(x, positions=torch.zeros(2, 5))
    with pytest.raises(ssm.ConfigError, match=r"d_head=5 is odd, but rotary embeddings rotate pairs"):
        ssm.MultiHeadAttention(20, 4, rope_theta=10000.0)
    with pytest.raises(ssm.ConfigError, match="positions were given, but this module has no rotary embeddings"):
        ssm.MultiHeadAttention(32, 4)(x, positions=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ssm.ConfigError, match="rope_type='linear' is not supported"):
        ssm.RotaryEmbedding(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters\['original_max_position_embeddings'\] must be"):
        ssm.RotaryEmbedding(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    cos, sin = ssm.RotaryEmbedding(8)(torch.arange(5)[None], dtype=torch.float32)
    with pytest.raises(ssm.ShapeError, match=r"k has seq=6 \(axis 2\), but q set seq=5"):
        ssm.apply_rotary(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8), cos, sin)


def test_rotary_messages_suggest_the_fix_and_name_the_table() -> None:
    """Pinned from mutants that survived (tools/mutmut_scores.py): an odd width suggests its even neighbours,
    headed by who raised it, and a table in another dtype than q is named by its argument."""
    with pytest.raises(ssm.ConfigError, match=r"^RotaryEmbedding\(\): d_head=5 is odd, .*\(for example 4 or 6\)\.$"):
        ssm.inverse_frequencies(5, 10000.0)
    with pytest.raises(ssm.ConfigError, match=r"\(for example 2 or 4\)"):
        ssm.RotaryEmbedding(3)
    with pytest.raises(ssm.ConfigError, match=r"d_head=1 is odd, .*\(for example 2\)\.$"):
        ssm.RotaryEmbedding(1)
    with pytest.raises(ssm.ConfigError) as raised:
        ssm.RotaryEmbedding(8, 10000.0, {"type": "linear", "factor": 4.0})
    assert str(raised.value) == (
        "RotaryEmbedding(): rope_type='linear' is not supported (only default, llama3, yarn, dynamic, longrope); "
        "its positions would differ from the model's."
    )
    cos, sin = ssm.RotaryEmbedding(8)(torch.arange(5)[None], dtype=torch.float64)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ssm.ShapeError, match=r"cos has dtype torch.float64, but q has torch.float32\.") as raised:
        ssm.apply_rotary(q, k, cos, sin.float())
    assert str(raised.value).startswith("apply_rotary(): ")
    with pytest.raises(ssm.ShapeError, match=r"sin has dtype torch.float64, but q has torch.float32\."):
        ssm.apply_rotary(q, k, cos.float(), sin)


@pytest.mark.parametrize("theta", [0, 0.0, -1.0, float("inf"), float("nan"), True, "10000"])
def test_rope_theta_must_be_a_positive_finite_number(theta: Any) -> None:
    with pytest.raises(ssm.ConfigError, match=r"^RotaryEmbedding\(\): rope_theta must be a positive finite number"):
        ssm.inverse_frequencies(8, theta)


def test_a_theta_below_one_is_a_theta() -> None:
    """Nothing in RoPE needs theta > 1: 0.5 gives frequencies 0.5 ** -(2i / d_head), growing."""
    torch.testing.assert_close(ssm.inverse_frequencies(4, 0.5), torch.tensor([1.0, 2.0**0.5]))


def test_the_tables_are_float32_angles_whatever_the_modules_dtype() -> None:
    """As transformers computes them: float32 angles, cast to the dtype asked for (a module made float64 keeps
    its float32 frequencies' values; the angles are not taken in float64), and the tables are not state."""
    rope, positions = ssm.RotaryEmbedding(8, 10000.0), torch.arange(300)[None]
    expected = [table.double() for table in rope(positions, dtype=torch.float32)]
    for got, want in zip(rope.double()(positions, dtype=torch.float64), expected, strict=True):
        assert torch.equal(got, want)
    assert rope.state_dict() == {}
    assert "rotary.inv_freq" not in ssm.MultiHeadAttention(32, 4, rope_theta=1e4).state_dict()


def test_rope_scaling_is_kept_as_given_a_copy() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    rope = ssm.RotaryEmbedding(16, 10000.0, scaling)
    assert rope.scaling == scaling and rope.scaling is not scaling
    assert ssm.RotaryEmbedding(16, 10000.0).scaling is None


def test_the_trace_shows_the_rotary_stage_and_gqa_stays_zero_copy() -> None:
    report = ssm.trace_forward(ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4, rope_theta=10000.0))
    stages = {s.name: s for s in report.stages}
    assert stages["rotary_q"].named_shape == "batch num_heads seq d_head"
    assert stages["rotary_k"].named_shape == "batch num_kv_heads seq d_head"
    assert stages["group_queries"].aliases == "rotary_q"  # grouping the rotated queries is a view


def test_the_trace_and_the_cli_show_the_partial_rotary_tables_by_d_rope() -> None:
    """Partial rotary: the tables are d_rope wide (rope_dim, named in the trace), the rotated heads d_head."""
    config = ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4, rope_theta=1e4, rope_dim=4,
                             rope_interleaved=True)  # fmt: skip
    stages = {s.name: s for s in ssm.trace_forward(config).stages}
    assert (stages["rotary_cos"].named_shape, stages["rotary_cos"].shape) == ("#batch seq d_rope", (1, 4, 4))
    assert stages["rotary_q"].shape == (1, 8, 4, 8) and stages["rotary_k"].shape == (1, 2, 4, 8)
    from typer.testing import CliRunner

    from shapesafe_mha._tools.cli import app

    args = ["trace", "--d-model", "64", "--num-heads", "8", "--num-kv-heads", "2", "--seq", "4", "--rope-theta",
            "10000", "--rope-dim", "4", "--rope-interleaved", "--format", "json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert '"rope_dim": 4' in result.output and '"rope_interleaved": true' in result.output
    assert '"named_shape": "#batch seq d_rope"' in result.output


@pytest.mark.parametrize("decode", [False, True])
def test_partial_interleaved_rope_is_proven_for_every_batch_and_seq(decode: bool) -> None:
    """prove(): d_rope is the module's rope_dim, every stage's shape holds symbolically, prefill and decoding."""
    module = ssm.MultiHeadAttention(64, 8, 2, rope_theta=1e4, rope_dim=4, rope_interleaved=True)
    proof = ssm.prove(module, is_causal=True, decode=decode)
    assert proof.ok, proof.failures
    rows = {name: (named, symbolic) for name, named, symbolic in proof.stages}
    assert rows["rotary_cos"][0] == "#batch seq d_rope" and rows["rotary_cos"][1].endswith(", 4)")
    heads = "(batch, 8, 1, 8)" if decode else "(batch, 8, seq, 8)"
    assert rows["rotary_q"] == ("batch num_heads seq d_head", heads)


def test_partial_rotary_rotates_the_first_rope_dim_features_and_passes_the_rest() -> None:
    """By hand: features rope_dim.. are the unrotated ones; the first rope_dim are those RotaryEmbedding(rope_dim)
    turns, in halves or adjacent pairs."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    for interleaved in (False, True):
        cos, sin = ssm.RotaryEmbedding(4, interleaved=interleaved)(torch.arange(5)[None], dtype=torch.float64)
        rq, rk = ssm.apply_partial_rotary(q, k, cos, sin, interleaved=interleaved)
        assert torch.equal(rq[..., 4:], q[..., 4:]) and torch.equal(rk[..., 4:], k[..., 4:])
        head, _ = ssm.apply_rotary(q[..., :4], k[..., :4], cos, sin, interleaved=interleaved)
        assert torch.equal(rq[..., :4], head)
        pairs = (0, 1) if interleaved else (0, 2)  # the features the first angle turns together
        angle = torch.arange(5, dtype=torch.float64)  # inv_freq[0] = 1
        x, y = q[..., pairs[0]], q[..., pairs[1]]
        torch.testing.assert_close(rq[..., pairs[0]], x * angle.cos() - y * angle.sin(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(rq[..., pairs[1]], y * angle.cos() + x * angle.sin(), atol=1e-6, rtol=1e-6)


def test_partial_rotary_errors_name_the_table_and_d_rope() -> None:
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    wide = ssm.RotaryEmbedding(10)(torch.arange(5)[None], dtype=torch.float32)
    with pytest.raises(ssm.ShapeError, match=r"cos has d_rope=10 features .* at most d_head=8") as raised:
        ssm.apply_partial_rotary(q, k, *wide)
    assert str(raised.value).startswith("apply_partial_rotary(): ")
    odd = torch.ones(1, 5, 3), torch.zeros(1, 5, 3)
    with pytest.raises(ssm.ShapeError, match=r"cos has d_rope=3 features .* an even number"):
        ssm.apply_partial_rotary(q, k, *odd)
    cos, sin = ssm.RotaryEmbedding(4)(torch.arange(5)[None], dtype=torch.float64)
    with pytest.raises(ssm.ShapeError, match=r"sin has dtype torch.float64, but q has torch.float32\."):
        ssm.apply_partial_rotary(q, k, cos.float(), sin)
    with pytest.raises(ssm.ShapeError, match=r"sin has d_rope=2"):
        ssm.apply_partial_rotary(q, k, cos.float(), sin.float()[..., :2])



@pytest.mark.parametrize(("rope_dim", "first", "bound"), [
    (4, "the result has d_rope=2 (axis 2), but the module set d_rope=4.", "(the module), d_rope=4 (the module),"),
    (None, "the result has d_head=4 (axis 2), but the module set d_head=8.", "(the module), batch=1 (query),"),
], ids=["partial", "full"])  # fmt: skip
def test_a_rotary_submodule_of_another_width_is_refused_by_the_modules_rotated_width(
    rope_dim: int | None, first: str, bound: str
) -> None:
    """A rotary submodule swapped for a narrower one makes tables the module's rotated width does not fit: refused,
    against d_rope (the module's rope_dim, bound by the module where it is partial) or d_head (full rotary, where
    the module binds no d_rope)."""
    module = ssm.MultiHeadAttention(32, 4, 2, rope_theta=1e4, rope_dim=rope_dim)
    narrower = ssm.RotaryEmbedding(2 if rope_dim else 4)
    refused = r"^MultiHeadAttention: rotary cannot be replaced by this one: its d_head"
    with pytest.raises(ssm.ConfigError, match=refused):
        module.rotary = narrower  # set: refused there, against the config
    module._modules["rotary"] = narrower  # put past the refusal: the call's checks refuse it
    with pytest.raises(ssm.ShapeError) as caught:
        module(torch.randn(1, 5, 32))
    lines = str(caught.value).splitlines()
    assert lines[0] == f"MultiHeadAttention.forward(): rotary returned a wrong value: {first}"
    assert lines[-1].startswith("Bound so far: ") and bound in lines[-1]


def test_an_odd_head_width_is_refused_by_the_module_for_full_rotary_and_taken_for_partial() -> None:
    """Full rotary pairs every feature of a head, so an odd d_head is the module's ConfigError (its own sizes named,
    even widths suggested); partial rotary pairs only the first rope_dim, so d_head=9 with rope_dim=4 computes."""
    message = (
        "MultiHeadAttention(d_model=36, num_heads=4, num_kv_heads=2): d_head=9 is odd, but rotary embeddings rotate "
        "pairs of features; use an even d_head (for example 8 or 10)."
    )
    with pytest.raises(ssm.ConfigError) as caught:
        ssm.MultiHeadAttention(36, 4, 2, d_head=9, rope_theta=1e4)
    assert str(caught.value) == message
    partial = ssm.MultiHeadAttention(36, 4, 2, d_head=9, rope_theta=1e4, rope_dim=4)
    assert partial(torch.randn(1, 3, 36)).shape == (1, 3, 36)

def test_partial_rotary_module_reports_its_options() -> None:
    module = ssm.MultiHeadAttention(32, 4, 2, rope_theta=1e4, rope_dim=4, rope_interleaved=True)
    assert "rope_dim=4, rope_interleaved=True" in repr(module)
    assert "RotaryEmbedding(d_head=4, theta=10000.0, interleaved=True)" in repr(module)
    full = ssm.MultiHeadAttention(32, 4, 2, rope_theta=1e4, rope_dim=8)
    assert full.rope_dim == 8 and "rope_dim" not in repr(full)  # every feature: the default, not shown
    assert ssm.MultiHeadAttention(32, 4, 2).rope_dim is None


# --- Hugging Face ---------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Over 16 original positions at d_head 8, YaRN keeps pair 0, slows pairs 1-3 by the factor, and scales the
# tables by its attention factor (0.1 * log(4) + 1 here; mscale 1.0 / mscale_all_dim 0.5 in the second).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
YARN_MSCALE = {**YARN, "rope_theta": 500.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8, "truncate": False}
LLAMA = (LlamaAttention, LlamaRotaryEmbedding, "LlamaConfig")
HF_CASES = {
    # name: (attention class, rotary class, config class name, config keywords)
    "llama-gqa-head16-theta500": (*LLAMA, {"num_key_value_heads": 2, "head_dim": 16, "rope_theta": 500.0}),
    "llama-mha-head8": (*LLAMA, {"num_key_value_heads": 4}),
    "llama-gqa-llama3-scaling": (*LLAMA, {"num_key_value_heads": 2, "rope_parameters": LLAMA3}),
    "llama-bias-head4": (*LLAMA, {"num_key_value_heads": 2, "head_dim": 4, "attention_bias": True}),
    "qwen2-mqa-qkv-bias": (Qwen2Attention, Qwen2RotaryEmbedding, "Qwen2Config", {"num_key_value_heads": 1}),
    "qwen2-gqa-yarn": (Qwen2Attention, Qwen2RotaryEmbedding, "Qwen2Config",
                       {"num_key_value_heads": 2, "max_position_embeddings": 64, "rope_parameters": YARN}),
    "llama-gqa-yarn-mscale": (*LLAMA, {"num_key_value_heads": 2, "max_position_embeddings": 64,
                                       "rope_parameters": YARN_MSCALE}),
}  # fmt: skip


@pytest.mark.parametrize(("low", "high", "bands"), [(1.0, 4.0, (29, 29, 6)), (2.0, 8.0, (25, 32, 7))])
def test_llama3_scaling_equals_transformers_in_each_of_its_three_bands(
    low: float, high: float, bands: tuple[int, int, int]
) -> None:
    """Llama 3.1's own parameters (head_dim 128, 8192 positions; and other band factors): frequencies kept,
    slowed by the factor and interpolated between, each equal to transformers' own computation (pinned from
    surviving mutants of the band edges and the interpolation, which the small probe configs never reach).
    The legacy key "type" names the scaling as "rope_type" does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {**LLAMA3, "original_max_position_embeddings": 8192, "low_freq_factor": low, "high_freq_factor": high}
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                      max_position_embeddings=131072, rope_parameters=parameters)  # fmt: skip
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = ssm.inverse_frequencies(128, 500000.0, parameters)
    assert torch.equal(ours, theirs)
    plain = ssm.inverse_frequencies(128, 500000.0)
    kept, slowed = torch.isclose(ours, plain), torch.isclose(ours, plain / 8.0)
    assert (int(kept.sum()), int(slowed.sum()), int((~kept & ~slowed).sum())) == bands
    legacy = {("type" if k == "rope_type" else k): v for k, v in parameters.items()}
    assert torch.equal(ssm.inverse_frequencies(128, 500000.0, legacy), ours)


def _hf_layer(case: str, implementation: str) -> tuple[Any, Any]:
    attention_cls, rotary_cls, config_name, kwargs = HF_CASES[case]
    config = getattr(transformers, config_name)(
        hidden_size=32, num_attention_heads=4, attn_implementation=implementation, **kwargs
    )
    torch.manual_seed(0)
    layer = attention_cls(config, layer_idx=0).to(torch.float64).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.3, 0.3)
    return layer, rotary_cls(config)


def _hf_forward(layer: Any, rotary: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The layer called as the HF model calls it: its model's rotary tables, transformers' own causal mask."""
    from transformers.masking_utils import create_causal_mask

    cos, sin = rotary(x, positions)
    mask = create_causal_mask(
        config=layer.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
    )
    return layer(x, position_embeddings=(cos, sin), attention_mask=mask)[0]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("case", HF_CASES)
def test_from_hf_equals_the_hugging_face_layer_full_and_decoding(case: str, implementation: str) -> None:
    """float64: HF's eager path computes its softmax in float32 (so 1e-6 there); its sdpa path to 1e-10."""
    layer, rotary = _hf_layer(case, implementation)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    positions = torch.arange(9).expand(2, 9)
    tol = {"atol": 1e-6, "rtol": 1e-6} if implementation == "eager" else F64
    with torch.no_grad():
        expected = _hf_forward(layer, rotary, x, positions)
        torch.testing.assert_close(ours(x, is_causal=True), expected, **tol)
        cache = ours.new_cache(batch=2, capacity=9)
        steps = [ours(x[:, :4], is_causal=True, kv_cache=cache)]
        steps += [ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, **tol)
    if case.startswith("qwen2"):
        assert ours.q_proj.bias is not None and ours.o_proj.bias is None  # biases per projection, as Qwen2


def test_to_hf_round_trips() -> None:
    layer, rotary = _hf_layer("llama-gqa-head16-theta500", "sdpa")
    ours = ssm.MultiHeadAttention.from_hf(layer)
    back = ours.to_hf(layer.config).to(torch.float64).eval()
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        torch.testing.assert_close(_hf_forward(back, rotary, x, positions), ours(x, is_causal=True), **F64)
    other = transformers.LlamaConfig(hidden_size=32, num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ssm.ConfigError, match=r"num_attention_heads=8 \(module: 4\)"):
        ours.to_hf(other)


def test_from_hf_carries_the_layers_attention_dropout() -> None:
    """A Llama layer configured with attention_dropout=0.1 becomes a module with dropout 0.1 (the layer drops
    attention probabilities in training; a module without dropout would train another model)."""
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1
    )
    ours = ssm.MultiHeadAttention.from_hf(LlamaAttention(config, layer_idx=0))
    assert ours.dropout == 0.1


def test_unsupported_variants_are_refused_by_their_config_field() -> None:
    linear = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters\['rope_type'\]='linear'"):
        ssm.MultiHeadAttention.from_hf(LlamaAttention(linear, layer_idx=0))
    odd = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4)
    odd.rope_parameters = {**odd.rope_parameters, "partial_rotary_factor": 0.375}  # 3 of 8 features: no pairs
    with pytest.raises(ssm.ConfigError, match=r"partial_rotary_factor'\]=0.375: it rotates 3 of head_dim=8"):
        ssm.MultiHeadAttention.from_hf(LlamaAttention(odd, layer_idx=0))


def test_a_partial_rotary_field_the_layer_does_not_read_is_refused_by_the_probe() -> None:
    """transformers 5 reads the rotated share from rope_parameters: a stale `config.partial_rotary_factor` beside
    it is loaded as partial rotary, and the probe, where the layer rotates every feature, refuses it naming RoPE."""
    stale = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4)
    stale.partial_rotary_factor = 0.5
    with pytest.raises(ssm.ConfigError, match=r"differs from LlamaAttention .* Known to differ here: the rotary"):
        ssm.MultiHeadAttention.from_hf(LlamaAttention(stale, layer_idx=0))


@pytest.mark.parametrize(("name", "interleaved"), [("phi", False), ("cohere", True), ("glm", False)])
def test_our_tables_are_the_models_own_for_its_rotated_part(name: str, interleaved: bool) -> None:
    """RotaryEmbedding(rope_dim, interleaved=...) makes the tables the model's rotary class makes, bit for bit:
    Phi's (partial, halves), Cohere's (each angle twice in a row); GLM's tables are halves (it interleaves them
    inside apply_rotary_pos_emb, which from_hf reads on a probe)."""
    prefix = {"phi": "Phi", "cohere": "Cohere", "glm": "Glm"}[name]
    modeling = __import__(f"transformers.models.{name}.modeling_{name}", fromlist=["_"])
    config = getattr(transformers, f"{prefix}Config")(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                       head_dim=8)  # fmt: skip
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    rope_dim = {"phi": 4, "cohere": 8, "glm": 4}[name]
    theta = config.rope_parameters["rope_theta"]
    positions = torch.arange(300)[None]
    theirs = rotary(torch.zeros(1, 300, 8, dtype=torch.float64), positions)
    ours = ssm.RotaryEmbedding(rope_dim, theta, interleaved=interleaved)(positions, torch.float64)
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
def test_rope_compiles_fullgraph_with_no_graph_breaks(scaling: dict[str, Any] | None) -> None:
    """Default RoPE and YaRN's scaled tables (its attention factor a Python float) trace without a break."""
    import torch._dynamo

    module = ssm.MultiHeadAttention(64, 8, 2, rope_theta=10000.0, rope_scaling=scaling).eval()
    x = torch.randn(2, 6, 64)
    explanation = torch._dynamo.explain(lambda t: module(t, is_causal=True))(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(lambda t: module(t, is_causal=True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), module(x, is_causal=True))


def test_the_default_theta_is_llamas_ten_thousand() -> None:
    """RotaryEmbedding(d_head) rotates pair i at 10000 ** (-2i / d_head), as Llama and GPT-NeoX do."""
    rotary = ssm.RotaryEmbedding(8)
    expected = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(rotary.inv_freq, expected.float(), atol=0, rtol=0)


def test_the_tables_are_made_on_the_positions_device() -> None:
    """Positions on another device than the module's (meta here): the tables follow the positions."""
    cos, sin = ssm.RotaryEmbedding(8)(torch.arange(5, device="meta")[None], torch.float32)
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (1, 5, 8)


def test_the_repr_gives_d_head_theta_and_the_scaling_where_there_is_one() -> None:
    assert repr(ssm.RotaryEmbedding(8)) == "RotaryEmbedding(d_head=8, theta=10000.0)"
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"original_max_position_embeddings": 8192}
    assert repr(ssm.RotaryEmbedding(8, theta=500000.0, scaling=scaling)) == (
        f"RotaryEmbedding(d_head=8, theta=500000.0, scaling={scaling})"
    )


@pytest.mark.parametrize(
    ("rope_dim", "stage"), [(None, "apply_rotary"), (2, "apply_partial_rotary")], ids=["full", "partial"]
)
def test_tables_of_another_dtype_from_a_rotary_submodule_are_refused_at_its_stage(
    rope_dim: int | None, stage: str
) -> None:
    """A user's rotary submodule returning float32 tables to a float64 module, full or partial rotary: the stage
    that refuses them is named, and the table, and both dtypes."""
    module = ssm.MultiHeadAttention(16, 4, rope_theta=10000.0, rope_dim=rope_dim).double()
    rotary = module.rotary

    class Float32Tables(torch.nn.Module):
        def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
            return rotary(positions, torch.float32)

    module.rotary = Float32Tables()
    with pytest.raises(ssm.ShapeError) as raised:
        module(torch.randn(1, 3, 16, dtype=torch.float64))
    assert str(raised.value).splitlines()[0] == (
        f"MultiHeadAttention.forward(): at {stage}, cos has dtype torch.float32, but q has torch.float64."
    )


def test_a_bfloat16_module_with_llama3_scaling_makes_the_float32_modules_tables() -> None:
    """Frequencies rounded to bfloat16 are computed again for the tables, with the module's scaling (unscaled, the
    cosines differ by up to 2)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"original_max_position_embeddings": 64}
    positions = torch.arange(0, 4096, 97)[None]
    expected = ssm.RotaryEmbedding(16, scaling=scaling)(positions, torch.float32)
    rounded = ssm.RotaryEmbedding(16, scaling=scaling).to(torch.bfloat16)(positions, torch.float32)
    torch.testing.assert_close(rounded, expected, atol=0, rtol=0)


def test_partial_rotary_over_every_feature_is_rotary() -> None:
    """d_rope == d_head is allowed (at most d_head), and rotates as apply_rotary does (checked: each test starts
    with the stages' verdicts forgotten, tests/conftest.py)."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = ssm.RotaryEmbedding(8)(torch.arange(5)[None], torch.float32)
    partial, full = ssm.apply_partial_rotary(q, k, cos, sin), ssm.apply_rotary(q, k, cos, sin)
    assert torch.equal(partial[0], full[0]) and torch.equal(partial[1], full[1])


# --- YaRN ------------------------------------------------------------------------------------------------

YARN_TABLES = {
    # name: (head_dim, rope_parameters); each against transformers' own ROPE_INIT_FUNCTIONS["yarn"]
    "qwen-long-context": (128, {**YARN, "rope_theta": 1e6, "original_max_position_embeddings": 32768}),
    "gpt-oss-untruncated": (64, {**YARN, "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    "deepseek-mscale-equal": (64, {**YARN, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                   "original_max_position_embeddings": 4096}),
    "deepseek-mscale-differ": (64, {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                    "original_max_position_embeddings": 4096}),
    "mscale-without-all-dim": (32, {**YARN, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0}),
    "attention-factor-given": (16, {**YARN, "rope_theta": 500.0, "attention_factor": 1.3, "beta_fast": 4,
                                    "beta_slow": 2}),
    "small-probe-untruncated": (8, {**YARN_MSCALE}),
    "ramp-of-width-zero": (8, {**YARN, "original_max_position_embeddings": 1, "truncate": False}),
    "factor-one": (32, {**YARN, "factor": 1.0}),
    # pinned from mutmut's survivors: the betas' defaults untruncated, a high end clamped at d_head - 1 (a small
    # theta), a ramp of width zero away from 0, a factor below 1, mscale alone, a given attention factor of 2
    "betas-default-untruncated": (64, {**YARN, "truncate": False, "original_max_position_embeddings": 4096}),
    "high-end-clamped": (64, {**YARN, "rope_theta": 10.0, "original_max_position_embeddings": 1024}),
    "ramp-of-width-zero-inside": (64, {**YARN, "beta_fast": 4, "beta_slow": 4, "truncate": False,
                                       "original_max_position_embeddings": 4096}),
    "factor-below-one": (32, {**YARN, "factor": 0.5, "original_max_position_embeddings": 64}),
    "mscale-2-without-all-dim": (32, {**YARN, "factor": 8.0, "mscale": 2.0}),
    "attention-factor-two": (16, {**YARN, "attention_factor": 2.0}),
}  # fmt: skip


@pytest.mark.parametrize("case", YARN_TABLES)
def test_yarn_tables_equal_transformers(case: str) -> None:
    """Frequencies, attention factor and the cos/sin tables (float32 angles scaled by the factor, then cast to
    float64) are bit for bit transformers' own, over DeepSeek's mscale pair, a given attention_factor, truncate
    False, other betas, a ramp of width 0 and factor 1 (attention factor 1)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, parameters = YARN_TABLES[case]
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=dict(parameters),
        max_position_embeddings=int(parameters["factor"] * parameters["original_max_position_embeddings"]),
    )  # fmt: skip
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = ssm.RotaryEmbedding(head_dim, parameters["rope_theta"], parameters)
    assert torch.equal(rope.inv_freq, theirs)
    assert rope.attention_factor == factor
    positions = torch.arange(0, 5000, 7)[None]
    x = torch.zeros(1, positions.shape[1], 4 * head_dim, dtype=torch.float64)
    for ours, want in zip(rope(positions, torch.float64), LlamaRotaryEmbedding(config)(x, positions), strict=True):
        assert torch.equal(ours, want)


@given(data=st.data())
def test_module_with_yarn_equals_the_per_head_reference(data: st.DataObject) -> None:
    """A YaRN module (factor, betas, mscale and truncate drawn) == the reference rotating each head by
    transformers' own YaRN frequencies with cos and sin scaled by its attention factor; prefill and decoding."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _rope_config(data)
    parameters = {
        **YARN,
        "rope_theta": config.rope_theta,
        "factor": data.draw(st.sampled_from([2.0, 4.0, 16.0]), label="factor"),
        "original_max_position_embeddings": (context := data.draw(st.sampled_from([4, 16, 64]), label="context")),
        "beta_fast": data.draw(st.sampled_from([32, 8]), label="beta_fast"),
        "truncate": data.draw(st.booleans(), label="truncate"),
        **data.draw(st.sampled_from([{}, {"mscale": 1.0, "mscale_all_dim": 0.5}]), label="mscale"),
    }
    d_head = config.d_head
    hf = transformers.LlamaConfig(hidden_size=config.num_heads * d_head, num_attention_heads=config.num_heads,
                                  head_dim=d_head,
                                  rope_parameters=dict(parameters),
                                  max_position_embeddings=int(parameters["factor"]) * context)  # fmt: skip
    frequencies = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    weights = data.draw(projection_weights(config))
    x = data.draw(attention_inputs(config)).query
    module = ssm.MultiHeadAttention.from_weights(
        weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, rope_theta=config.rope_theta,
        rope_scaling=parameters,
    )  # fmt: skip
    expected = per_head_attention(
        x, x, x, weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=True,
        rope_theta=config.rope_theta, rope_frequencies=frequencies,
    )  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(module(x, is_causal=True), expected, **F64)
        cache = module.new_cache(batch=x.shape[0], capacity=x.shape[1])
        steps = [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(x.shape[1])]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, **F64)


def test_a_yarn_module_without_its_attention_factor_is_caught() -> None:
    """Planted bug: the tables left unscaled (attention factor 1) differ from the HF layer by far more than the
    tolerance of the from_hf comparison, so that comparison catches it."""
    layer, rotary = _hf_layer("qwen2-gqa-yarn", "sdpa")
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert ours.rotary is not None and ours.rotary.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = _hf_forward(layer, rotary, x, torch.arange(9).expand(2, 9))
        torch.testing.assert_close(ours(x, is_causal=True), expected, **F64)
        ours.rotary.__dict__["attention_factor"] = 1.0  # planted past the refusal of setting it
        assert (ours(x, is_causal=True) - expected).abs().max() > 1e-3


def test_to_hf_carries_yarn_and_a_factor_left_out_is_the_context_ratio() -> None:
    """A YaRN module goes to a config with the same rope_parameters and back, computing the same; a config whose
    factor is None (DeepSeek-V3) loads with factor max_position_embeddings / original_max_position_embeddings,
    as transformers computes it; another scaling in the config is named."""
    ours = ssm.MultiHeadAttention(32, 4, 2, bias=False, rope_theta=500.0, rope_scaling=YARN_MSCALE, dtype=torch.float64)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, rope_parameters=dict(YARN_MSCALE),
                                      attn_implementation="sdpa")  # fmt: skip
    back = ours.to_hf(config).to(torch.float64).eval()
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            _hf_forward(back, LlamaRotaryEmbedding(config), x, torch.arange(7)[None]), ours(x, is_causal=True), **F64
        )
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters \(scaling\)=\{'rope_type': 'yarn', 'factor': 4.0"):
        ours.to_hf(transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                            rope_parameters={**YARN, "rope_theta": 500.0}))  # fmt: skip
    derived = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                                       rope_parameters={**YARN, "factor": None})  # fmt: skip
    loaded = ssm.MultiHeadAttention.from_hf(LlamaAttention(derived, layer_idx=0))
    assert loaded.rotary is not None and loaded.rotary.scaling is not None
    assert loaded.rotary.scaling["factor"] == 4.0
    assert loaded.rotary.attention_factor == LlamaRotaryEmbedding(derived).attention_scaling


@pytest.mark.parametrize(
    ("field", "value", "wanted"),
    [
        ("factor", None, "a positive finite number"),
        ("factor", 0.0, "a positive finite number"),
        ("original_max_position_embeddings", "4k", "a positive finite number"),
        ("beta_fast", -1.0, "a positive finite number"),
        ("beta_slow", float("nan"), "a positive finite number"),
        ("mscale", True, "a finite number"),
        ("attention_factor", 0, "a positive finite number"),
        ("truncate", "yes", "True or False"),
    ],
)
def test_yarn_fields_are_checked_by_name(field: str, value: Any, wanted: str) -> None:
    parameters = {**YARN, field: value}
    with pytest.raises(ssm.ConfigError, match=rf"^RotaryEmbedding\(\): rope_parameters\['{field}'\] must be {wanted} "
                       rf"for rope_type='yarn', but got {re.escape(repr(value))}\.$"):  # fmt: skip
        ssm.RotaryEmbedding(8, 10000.0, parameters)


def test_llama3_fields_are_checked_by_name() -> None:
    parameters = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64}
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters\['high_freq_factor'\] must be a positive finite"):
        ssm.inverse_frequencies(16, 10000.0, parameters)


def test_yarn_kept_per_layer_type_is_truncated_as_transformers_reads_it() -> None:
    """transformers reads `truncate` from the top level of `rope_parameters`, so with a set per layer type
    (Gemma 3) it truncates whatever the set says: from_hf's scaling does too, and the frequencies are
    transformers' own (the set's own truncate=False would give others: gpt-oss's sizes, where it matters)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shapesafe_mha._interop.hf import rope_of

    untruncated = {**YARN_TABLES["gpt-oss-untruncated"][1]}
    config = transformers.Gemma3TextConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=131072,
        rope_parameters={"full_attention": dict(untruncated), "sliding_attention": dict(untruncated)},
    )  # fmt: skip
    theirs, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu", layer_type="full_attention")
    theta, scaling = rope_of(config, "full_attention")
    assert scaling is not None and scaling["truncate"] is True
    assert torch.equal(ssm.inverse_frequencies(64, theta, scaling), theirs)
    assert not torch.equal(ssm.inverse_frequencies(64, theta, untruncated), theirs)


@pytest.mark.parametrize("decode", [False, True])
def test_a_yarn_module_is_proven_for_every_batch_and_seq(decode: bool) -> None:
    """prove() holds for every batch and seq with YaRN's scaled tables, prefill and decoding, the rotated queries
    shaped as with default RoPE."""
    module = ssm.MultiHeadAttention(64, 8, 2, rope_theta=1e4, rope_scaling=YARN_MSCALE)
    proof = ssm.prove(module, is_causal=True, decode=decode)
    assert proof.ok, proof.failures
    rows = {name: (named, symbolic) for name, named, symbolic in proof.stages}
    heads = "(batch, 8, 1, 8)" if decode else "(batch, 8, seq, 8)"
    assert rows["rotary_q"] == ("batch num_heads seq d_head", heads)


def test_apply_rotary_on_heads_of_odd_width_names_the_width() -> None:
    """The public stage refuses an odd d_head with the width in the message (pairs of features are rotated)."""
    q, table = torch.randn(1, 2, 3, 7), torch.randn(1, 3, 7)
    with pytest.raises(ssm.ShapeError) as raised:
        ssm.apply_rotary(q, q, table, table)
    assert str(raised.value).splitlines()[0] == (
        "apply_rotary(): q has d_head=7 (axis 3), which is odd; rotary embeddings rotate pairs of features."
    )


# For each constructor argument of RotaryEmbedding, a value other than the default (a YaRN scaling, so that the
# factor and the frequencies both change). A parameter added to the constructor fails the first test until listed.
_ROTARY_CHANGED: dict[str, Any] = {
    "d_head": 6,
    "theta": 50.0,
    "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "interleaved": True,
}


def test_every_rotary_argument_has_a_value_here() -> None:
    import inspect

    assert set(_ROTARY_CHANGED) == set(inspect.signature(ssm.RotaryEmbedding).parameters)


@pytest.mark.parametrize("name", list(_ROTARY_CHANGED))
def test_a_rotary_argument_set_on_a_built_module_is_followed_or_refused_never_half_applied(name: str) -> None:
    """Set after construction, an argument's tables equal a fresh module's built with it (it is read at each call), or
    it is refused naming the constructor call that has it, the tables left as they were."""
    rope = ssm.RotaryEmbedding(8, 10000.0)
    positions = torch.arange(40)[None]
    before = rope(positions, torch.float64)
    value = _ROTARY_CHANGED[name]
    fresh = ssm.RotaryEmbedding(**({"d_head": 8, "theta": 10000.0} | {name: value}))
    try:
        setattr(rope, name, value)
    except ssm.ConfigError as error:
        assert str(error).startswith(f"RotaryEmbedding: {name} cannot be set on a built module")
        built = f"RotaryEmbedding(d_head={fresh.d_head!r}, theta={fresh.theta!r}, scaling={fresh.scaling!r}"
        assert built in str(error)
        for got, kept in zip(rope(positions, torch.float64), before, strict=True):
            torch.testing.assert_close(got, kept, rtol=0, atol=0)
        return
    for got, expected in zip(rope(positions, torch.float64), fresh(positions, torch.float64), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("route", ["assign", "register_buffer"])
@pytest.mark.parametrize("name", ["inv_freq", "long_inv_freq"])
def test_frequencies_set_on_a_built_rotary_are_refused_and_the_same_ones_accepted(route: str, name: str) -> None:
    """The frequencies are derived from the arguments (and computed from them again after a load and in bfloat16):
    others set on a built module, by assignment or `register_buffer`, would be half applied, so they are refused
    naming what builds them; the same values are accepted."""
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 8, "factor": 2.0}  # fmt: skip
    rope = ssm.RotaryEmbedding(8, 10000.0, longrope)
    current = getattr(rope, name)

    def put(value: torch.Tensor) -> None:
        if route == "register_buffer":
            rope.register_buffer(name, value, persistent=False)
        else:
            setattr(rope, name, value)

    with pytest.raises(ssm.ConfigError, match=rf"^RotaryEmbedding: {name} cannot be set on a built module: .*theta="):
        put(current / 4)
    assert getattr(rope, name) is current
    put(current.clone())
    torch.testing.assert_close(getattr(rope, name), current, rtol=0, atol=0)


def test_what_else_a_rotary_derives_is_refused_and_its_frequencies_may_be_cast() -> None:
    """What a call reads besides the frequencies (YaRN's attention factor, the rule by length) is derived from the
    arguments too: set, refused; a parametrization (which deletes the frequencies first) is refused; the frequencies
    cast by assignment are the same values, and accepted."""
    from torch.nn.utils import parametrize

    yarn = ssm.RotaryEmbedding(8, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    with pytest.raises(ssm.ConfigError, match=r"^RotaryEmbedding: attention_factor cannot be set"):
        yarn.attention_factor = 1.0
    dynamic = ssm.RotaryEmbedding(8, 10000.0, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8})
    with pytest.raises(ssm.ConfigError, match=r"^RotaryEmbedding: by_length cannot be set"):
        dynamic.by_length = False

    class Twice(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return 2 * t

    with pytest.raises(ssm.ConfigError, match=r"^RotaryEmbedding: inv_freq cannot be set"):
        parametrize.register_parametrization(yarn, "inv_freq", Twice())
    rope = ssm.RotaryEmbedding(8, 10000.0)
    rope.inv_freq = rope.inv_freq.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.bfloat16


def test_a_rotarys_scaling_read_back_is_a_copy_editing_it_edits_nothing() -> None:
    """`rotary.scaling["factor"] = ...` once edited what the config read and not the frequencies built from it (0.205
    off a module rebuilt from its config): what it returns is a copy, and the module computes as it did."""
    module = ssm.MultiHeadAttention(32, 4, rope_theta=1e4, rope_scaling=LLAMA3, dtype=torch.float64).eval()
    assert module.rotary is not None
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    before, config = module(x, is_causal=True), module.config
    scaling = module.rotary.scaling
    assert scaling is not None
    scaling["factor"] = 2.0
    assert module.config == config
    torch.testing.assert_close(module(x, is_causal=True), before, rtol=0, atol=0)


_WRITES = {  # every route of writing a rotary's frequencies in place
    "mul_": lambda f: f.mul_(2.0),
    "copy_": lambda f: f.copy_(f * 0.5),
    "data =": lambda f: setattr(f, "data", f / 4),
    "index write": lambda f: f.__setitem__(0, 3.0),
    "a view written": lambda f: f.view(-1)[1:].fill_(0.25),
}
_SAME = {  # and of giving it the values it has
    "copy_ of itself": lambda m: m.rotary.inv_freq.copy_(m.rotary.inv_freq.clone()),
    "data = a clone": lambda m: setattr(m.rotary.inv_freq, "data", m.rotary.inv_freq.clone()),
    "load_state_dict": lambda m: m.load_state_dict(m.state_dict()),
    "a bfloat16 round trip": lambda m: m.bfloat16().double(),
    "a float16 round trip": lambda m: m.half().double(),
}


@pytest.mark.parametrize("scaling", [None, "longrope"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_frequencies_written_in_place_are_refused_until_reset_and_their_own_values_are_not(
    kind: str, scaling: str | None
) -> None:
    """A rotary's frequencies are derived from `d_head`, `theta` and `scaling` (the module's config): written in place
    by any route (`mul_`, `copy_`, `.data =`, an index), the next call is a ConfigError naming the buffer, and after
    `reset_parameters()` the module equals one rebuilt from its config. Writing the values it has, or a round trip
    through bfloat16 or float16, is no change: it computes as the rebuilt module does (a round trip used to keep the
    rounded frequencies: 5.8e-4 off at 512 positions)."""
    torch.manual_seed(0)
    options: dict[str, Any] = {"rope_theta": 1e4}
    if scaling == "longrope":
        half = 2 if kind == "mla" else 4
        factors = {"short_factor": [1.0] * half, "long_factor": [2.0] * half, "factor": 4.0}
        options["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": 8}
    if kind == "mha":
        module: Any = ssm.MultiHeadAttention(32, 4, **options)
    else:
        module = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=6, **options)
    module = module.double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)

    def agrees() -> None:
        rebuilt = type(module).from_config(module.config).double().eval()
        rebuilt.load_state_dict(module.state_dict())
        torch.testing.assert_close(module(x, is_causal=True), rebuilt(x, is_causal=True), rtol=0, atol=0)

    agrees()
    buffers = ["inv_freq"] + (["long_inv_freq"] if scaling == "longrope" else [])
    for buffer in buffers:
        for write in _WRITES.values():
            with torch.no_grad():
                write(getattr(module.rotary, buffer))
            with pytest.raises(ssm.ConfigError, match=rf"RotaryEmbedding: {buffer} was written in place"):
                module(x, is_causal=True)
            module.rotary.reset_parameters()
            agrees()
    for same in _SAME.values():
        with torch.no_grad():
            same(module)
        agrees()
