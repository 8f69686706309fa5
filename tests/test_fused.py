"""Inference self-attention projects Q, K, V with one fused matmul; it computes exactly what the unfused path does."""

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import attention_configs, attention_inputs, projection_weights

F64 = {"atol": 1e-10, "rtol": 1e-8}


def _uses_fused_path(module: ssm.MultiHeadAttention, x: torch.Tensor) -> bool:
    with torch.no_grad():
        report_names = []
        from shapesafe_mha._core.trace import tracing

        with tracing() as tracer:
            module(x)
        report_names = [s.name for s in tracer.stages]
    return "qkv_proj" in report_names


@given(data=st.data())
def test_fused_inference_equals_reference(data: st.DataObject, device: str) -> None:
    """Under no_grad, self-attention (fused QKV) == the per-head reference, causal or not, with or without cache."""
    config = data.draw(attention_configs(cross=False), label="config")
    weights = data.draw(projection_weights(config, device=device))
    x = data.draw(attention_inputs(config, device=device)).query
    is_causal = data.draw(st.booleans(), label="is_causal")
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    expected = per_head_attention(
        x, x, x, weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=is_causal
    )
    with torch.no_grad():
        torch.testing.assert_close(module(x, is_causal=is_causal), expected, **F64)
        cache = module.new_cache(config.batch, config.seq)
        steps = [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(config.seq)]
    if is_causal:
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, **F64)
    assert _uses_fused_path(module, x)


@pytest.mark.parametrize("options", [{"clip_qkv": 0.5}, {"qk_norm": True, "qk_norm_over": "all"}])
def test_options_that_read_the_projections_before_the_head_split_are_fused_too(options: dict) -> None:
    """clip_qkv and a QK-norm over every head work on Q, K and V before the head split: the fused path separates
    the projections first, then splits each, and computes what the separate projections (grad mode) compute."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2, dtype=torch.float64, **options)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    assert _uses_fused_path(module, x)
    with torch.no_grad():
        fused = module(x, is_causal=True)
    torch.testing.assert_close(fused, module(x, is_causal=True), **F64)


def test_projection_rows_moved_from_one_to_another_are_refused_with_or_without_grad() -> None:
    """q_proj given 8 more rows and k_proj 8 fewer leaves the fused width as it was; the fused path, which
    splits its product by heads, would mix them silently. It takes only the widths the module's sizes fix, so
    the call is refused as in grad mode, after a verdict remembered for the fused path too."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2, bias=False)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        module(x)
        packed = module.q_proj.weight.detach().as_strided((64, 32), (32, 1))  # q, k, v side by side in one storage
        module.q_proj.weight.data = packed[:40]  # still one after another: only the widths tell them apart
        module.k_proj.weight.data = packed[40:48]
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ssm.ShapeError, match="q_proj returned a wrong value"):
            module(x)


def test_fusion_survives_dtype_and_device_moves_and_loading() -> None:
    """.double(), .to(), load_state_dict and optimizer steps keep the parameters fused and the result right."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(24, 6, 2)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    module = module.double()
    assert _uses_fused_path(module, x)
    other = ssm.MultiHeadAttention(24, 6, 2, dtype=torch.float64)
    other.load_state_dict(module.state_dict())
    assert _uses_fused_path(other, x)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    other(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        fused = other(x)
    torch.testing.assert_close(fused, other(x), **F64)  # grad-enabled: three separate projections
    torch.testing.assert_close(fused, per_head_attention(x, x, x, other.weights(), num_heads=6, num_kv_heads=2), **F64)


def _warm(m: ssm.MultiHeadAttention) -> None:
    with torch.no_grad():
        m(torch.randn(1, 3, 16, dtype=torch.float64))


def _vector_then_write(m: ssm.MultiHeadAttention) -> None:
    vector = nn.utils.parameters_to_vector(m.parameters())
    nn.utils.vector_to_parameters(vector, m.parameters())
    _warm(m)
    vector.mul_(1.5)  # the parameters are slices of it: written, their version counters unmoved


def _data_then_write(m: ssm.MultiHeadAttention) -> None:
    held = torch.randn_like(m.k_proj.weight)
    m.k_proj.weight.data = held
    _warm(m)
    held.add_(1.0)


def _optimizer_step(m: ssm.MultiHeadAttention) -> None:
    with torch.enable_grad():
        m(torch.randn(1, 3, 16, dtype=torch.float64)).square().sum().backward()
    torch.optim.SGD(m.parameters(), lr=0.5).step()


def _load_assign_then_write(m: ssm.MultiHeadAttention) -> None:
    state = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)
    _warm(m)
    state["v_proj.weight"].mul_(-1.0)


# Every route by which the values a projection computes with can change; each is a write the fused weight
# must see (it is a view of the parameters, never a copy), or a layout it must refuse to view.
WRITES = {
    "in place under no_grad": lambda m: m.k_proj.weight.add_(1.0),
    "through .data (no version counter moves)": lambda m: m.q_proj.weight.data.add_(1.0),
    "through .detach()": lambda m: m.v_proj.bias.detach().mul_(2.0),
    ".data = its transpose, at the same address": lambda m: setattr(m.k_proj.weight, "data", m.k_proj.weight.data.t()),
    ".data = another tensor, then that tensor written": _data_then_write,
    "a new Parameter": lambda m: setattr(m.k_proj, "weight", nn.Parameter(torch.randn_like(m.k_proj.weight))),
    "a new Parameter over the same storage read transposed": lambda m: setattr(
        m.k_proj, "weight", nn.Parameter(m.k_proj.weight.detach().as_strided((16, 16), (1, 16)))
    ),
    "vector_to_parameters, then the vector written": _vector_then_write,
    "load_state_dict": lambda m: m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()}),
    "load_state_dict(assign=True), then the state written": _load_assign_then_write,
    "an optimizer step": _optimizer_step,
    "copied to float32 and back": lambda m: m.float().double(),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_every_route_of_writing_a_projection_is_seen_by_the_next_inference_call(write) -> None:
    """Warm (its fused weight built) after the write computes what the reference computes with the parameters as
    they are now, in inference and with autograd, the same as a module deep-copied after it."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, dtype=torch.float64)
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    assert _uses_fused_path(module, x)
    with torch.no_grad():
        write(module)
    expected = per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=4)
    with torch.no_grad():
        torch.testing.assert_close(module(x), expected, **F64)
        torch.testing.assert_close(copy.deepcopy(module)(x), expected, **F64)
    torch.testing.assert_close(module(x), expected, **F64)


def test_the_fused_weight_is_a_view_of_the_parameters_and_comes_back_after_a_move() -> None:
    """No copy of the weights is made; written in place it stays in use; after parameters replaced by the user's
    own tensors the projections run separately (their storage is the user's), and `.to()` packs them again."""
    module = ssm.MultiHeadAttention(16, 4, 2, dtype=torch.float64)
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    assert _uses_fused_path(module, x)
    fused = module._fused
    assert fused is not None and fused.weight.data_ptr() == module.q_proj.weight.data_ptr()
    with torch.no_grad():
        module.v_proj.weight.data.add_(1.0)
    assert _uses_fused_path(module, x) and module._fused is fused
    module.k_proj.weight = nn.Parameter(torch.randn(8, 16, dtype=torch.float64))
    assert not _uses_fused_path(module, x)
    module.float().double()
    assert _uses_fused_path(module, x)
    assert _uses_fused_path(copy.deepcopy(module), x)


def test_state_dict_saves_and_loads_with_safetensors() -> None:
    """The q/k/v weights share one storage, side by side: safetensors saves them (it refuses overlapping tensors
    only), and what loads equals what was saved."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    module = ssm.MultiHeadAttention(16, 4, 2)
    state = module.state_dict()
    loaded = safetensors_torch.load(safetensors_torch.save(state))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    other = ssm.MultiHeadAttention(16, 4, 2)
    other.load_state_dict(loaded)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        assert torch.equal(other(x), module(x))


@given(data=st.data())
def test_torch_fused_kernel_path_equals_reference(data: st.DataObject, device: str) -> None:
    """Inference MHA self-attention with biases (up to 128 positions) runs torch's fused MHA kernel; == reference."""
    config = data.draw(attention_configs(kinds=("mha",), cross=False, bias=True, max_seq=128), label="config")
    config = type(config)(**(config.as_dict() | {"d_model": config.num_heads * config.d_head}))
    weights = data.draw(projection_weights(config, device=device))
    x = data.draw(attention_inputs(config, device=device)).query
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads).eval()
    calls = []
    kernel = torch._native_multi_head_attention  # pyright: ignore[reportPrivateImportUsage]
    with (
        torch.no_grad(),
        mock.patch.object(torch, "_native_multi_head_attention", lambda *a: calls.append(1) or kernel(*a)),
    ):
        out = module(x)
    assert calls, "torch's fused MHA kernel did not run"
    expected = per_head_attention(x, x, x, weights, num_heads=config.num_heads, num_kv_heads=config.num_heads)
    torch.testing.assert_close(out, expected, **F64)


# --- pinned from surviving generated mutants (mutmut) ---------------------------------------------------------


def _native_fit(**kwargs: object) -> ssm.MultiHeadAttention:
    """MHA with biases, heads tiling d_model, no RoPE: what torch's fused MHA kernel can compute."""
    torch.manual_seed(0)
    return ssm.MultiHeadAttention(16, 4, **kwargs).double().eval()  # type: ignore[arg-type]


def _kernel_calls(module: ssm.MultiHeadAttention, x: torch.Tensor) -> int:
    calls = []
    kernel = torch._native_multi_head_attention  # pyright: ignore[reportPrivateImportUsage]
    with (
        torch.no_grad(),
        mock.patch.object(torch, "_native_multi_head_attention", lambda *a: calls.append(1) or kernel(*a)),
    ):
        module(x)
    return len(calls)


def test_torch_fused_kernel_runs_up_to_128_positions_and_in_eval_mode_with_dropout() -> None:
    """The kernel's limits: 128 positions run it, 129 do not; dropout configured but in eval mode runs it."""
    assert _kernel_calls(_native_fit(), torch.randn(1, 128, 16, dtype=torch.float64)) == 1
    assert _kernel_calls(_native_fit(), torch.randn(1, 129, 16, dtype=torch.float64)) == 0
    assert _kernel_calls(_native_fit(dropout=0.1), torch.randn(1, 5, 16, dtype=torch.float64)) == 1


def test_torch_fused_kernel_path_is_exactly_nn_multihead_attentions_inference() -> None:
    """The same weights in nn.MultiheadAttention: its inference fast path and ours give the same bits."""
    module = _native_fit()
    torch_mha = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        torch_mha.in_proj_weight.copy_(torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]))
        torch_mha.in_proj_bias.copy_(torch.cat([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]))
        torch_mha.out_proj.weight.copy_(module.o_proj.weight)
        torch_mha.out_proj.bias.copy_(module.o_proj.bias)
        x = torch.randn(2, 7, 16, dtype=torch.float64)
        assert torch.equal(module(x), torch_mha(x, x, x, need_weights=False)[0])


def _both_modes(module: ssm.MultiHeadAttention, *args: torch.Tensor, **kwargs: object) -> None:
    """The call under no_grad (where the fast paths run) == the same call with autograd (separate projections)."""
    with torch.no_grad():
        fast = module(*args, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(fast, module(*args, **kwargs), **F64)  # type: ignore[arg-type]


def test_without_grad_a_key_or_value_other_than_the_query_is_projected_on_its_own() -> None:
    """module(x, x, y) and module(x, y, x): not self-attention, so no fused Q/K/V projection of x alone."""
    module = _native_fit()
    x, y = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    _both_modes(module, x, x, y)
    _both_modes(module, x, y, x)


def test_without_grad_a_module_fit_for_torchs_kernel_still_applies_masks_and_the_cache() -> None:
    """torch's kernel takes no mask here and no cache: with either, the fused path runs, and computes the call."""
    module = _native_fit()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    _both_modes(module, x, key_padding_mask=padding)
    _both_modes(module, x, attn_mask=torch.rand(5, 5) > 0.3)
    _both_modes(module, x, attn_mask=torch.rand(5, 5) > 0.3, key_padding_mask=padding)
    with torch.no_grad():
        cache = module.new_cache(2, 8)
        module(x[:, :2], kv_cache=cache)
        fast = module(x[:, 2:], kv_cache=cache)
    cache = module.new_cache(2, 8)
    module(x[:, :2], kv_cache=cache)
    torch.testing.assert_close(fast, module(x[:, 2:], kv_cache=cache), **F64)


def test_projections_of_different_dtypes_get_the_same_outcome_without_grad() -> None:
    """k_proj (or v_proj) in float32 beside float64 ones: no fused weight of mixed dtypes is made, so the call fails
    under no_grad exactly as with autograd (torch's own dtype error, from that projection)."""
    for name in ("k_proj", "v_proj"):
        module = _native_fit()
        getattr(module, name).float()
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        outcomes = []
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(Exception) as raised:
                module(x)
            outcomes.append((type(raised.value), str(raised.value).splitlines()[0]))
        assert outcomes[0] == outcomes[1]


def test_the_fused_weight_is_built_once_for_calls_that_change_nothing() -> None:
    """It is a cache: a second inference call reuses the concatenation the first one made."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        module(x)
        fused = module._fused
        module(x)
    assert fused is not None and module._fused is fused
