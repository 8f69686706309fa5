"""Differential attention (DiffLlama): the module equals the per-head reference beside the other variants, MHA and
GQA, every path and decoding; `from_hf` of DiffLlama's layer equals it and the reference, `to_hf` writes it back;
a bug planted in our differential heads is refused by from_hf's probe."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute import kernels as K
from shapesafe_mha.reference import per_head_attention

F64 = {"atol": 1e-10, "rtol": 1e-8}


@st.composite
def differential_modules(draw: Any) -> ssm.MultiHeadAttention:
    """A float64 module with differential attention, sizes drawn by construction (an even number of KV heads, then
    the group: MHA or GQA), beside drawn RoPE, window, softcap, sinks, ALiBi and QK-norm, lambdas of any sign."""
    num_kv_heads = draw(st.sampled_from([2, 4]), label="num_kv_heads")
    group = draw(st.integers(1, 3), label="group")
    d_head = draw(st.sampled_from([2, 4, 8]), label="d_head")
    options = {
        "rope_theta": draw(st.sampled_from([None, 10000.0]), label="rope_theta"),
        "window": draw(st.one_of(st.none(), st.integers(1, 8)), label="window"),
        "logit_softcap": draw(st.one_of(st.none(), st.floats(0.5, 5.0)), label="logit_softcap"),
        "attention_sinks": draw(st.booleans(), label="attention_sinks"),
        "alibi": draw(st.booleans(), label="alibi"),
        "qk_norm": draw(st.booleans(), label="qk_norm"),
        "norm_eps": draw(st.sampled_from([1e-6, 1e-2]), label="norm_eps"),
        "differential_lambda_init": draw(st.floats(0.0, 0.8), label="lambda_init"),
    }
    seed = draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    module = ssm.MultiHeadAttention(16, num_kv_heads * group, num_kv_heads, d_head=d_head, dtype=torch.float64,
                                    **options)  # fmt: skip
    with torch.no_grad():  # lambdas whose exponentials differ (lambda far from lambda_init), sinks that matter
        for name in K.LAMBDAS:
            getattr(module, name).uniform_(-0.6, 0.6)
        if module.sinks is not None:
            module.sinks.uniform_(-2.0, 2.0)
    return module


def _reference(module: ssm.MultiHeadAttention, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    lambdas = tuple(getattr(module, name) for name in K.LAMBDAS)
    norms = (module.q_norm.weight, module.k_norm.weight) if module.qk_norm else None
    return per_head_attention(
        x, x, x, module.weights(), num_heads=module.num_heads, num_kv_heads=module.num_kv_heads,
        rope_theta=module.rope_theta, window=module.window, logit_softcap=module.logit_softcap, sinks=module.sinks,
        alibi_slopes=module.alibi_slopes, qk_norm=norms, norm_eps=module.norm_eps,
        differential=(*lambdas, module.differential_lambda_init), **kwargs,
    )  # fmt: skip


def _fed(module: ssm.MultiHeadAttention, x: torch.Tensor, ends: list[int], **kwargs: Any) -> torch.Tensor:
    """`x` fed through a cache (as small as the window allows) in causal calls ending at `ends`."""
    cache = module.new_cache(x.shape[0], module.window or x.shape[1])
    starts = [0, *ends[:-1]]
    calls = zip(starts, ends, strict=True)
    return torch.cat([module(x[:, a:b], is_causal=True, kv_cache=cache, **kwargs) for a, b in calls], dim=1)


@settings(max_examples=max(5, settings().max_examples // 2))  # (each example checks five kinds of call anew)
@given(module=differential_modules(), data=st.data())
def test_differential_attention_equals_the_per_head_reference_on_every_route_and_step_kind(
    module: ssm.MultiHeadAttention, data: st.DataObject
) -> None:
    """With or without autograd (separate or fused projections), GQA on torch's kernel or folded: one call (causal
    or not, padded or not) equals the reference; fed a token at a time or in chunks through the module's cache, the
    sequence gives its one causal call; a left-padded batch with its own positions equals the reference."""
    batch, seq = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(1, 9), label="seq")
    x = torch.randn(batch, seq, 16, dtype=torch.float64)
    is_causal = data.draw(st.booleans(), label="is_causal")
    padding = torch.rand(batch, seq) < 0.3 if data.draw(st.booleans(), label="padded") else None
    step = data.draw(st.integers(1, 4), label="chunk")
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch), label="lengths"))
    left = torch.arange(seq)[None, :] < (seq - lengths)[:, None]
    positions = (~left).long().cumsum(1).sub(1).clamp(min=0) if module.rope_theta is not None else None
    folded = data.draw(st.booleans(), label="GQA folded")
    with pytest.MonkeyPatch.context() as patch, torch.set_grad_enabled(data.draw(st.booleans(), label="grad")):
        if folded:
            patch.setattr(K, "native_gqa", lambda *args: False)
        expected = _reference(module, x, is_causal=is_causal, key_padding_mask=padding)
        torch.testing.assert_close(module(x, is_causal=is_causal, key_padding_mask=padding), expected, **F64)
        causal = module(x, is_causal=True)
        torch.testing.assert_close(_fed(module, x, sorted({*range(step, seq, step), seq})), causal, **F64)
        padded = module(x, is_causal=True, key_padding_mask=left, positions=positions)
        expected = _reference(module, x, is_causal=True, key_padding_mask=left, positions=positions)
        torch.testing.assert_close(padded, expected, **F64)


def _diffllama(layer_idx: int, num_kv_heads: int, implementation: str = "sdpa") -> tuple[Any, Any, Any]:
    """DiffLlama's layer (float64, weights and lambdas drawn in [-0.6, 0.6]), its config and its rotary class."""
    import transformers
    from transformers.models.diffllama import modeling_diffllama as modeling

    config = transformers.DiffLlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                                          num_hidden_layers=4, attn_implementation=implementation)  # fmt: skip
    torch.manual_seed(0)
    layer = modeling.DiffLlamaAttention(config, layer_idx=layer_idx).to(torch.float64).eval()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.uniform_(-0.6, 0.6)
    return layer, config, modeling.DiffLlamaRotaryEmbedding(config)


def _hf_steps(layer: Any, config: Any, rotary: Any, x: torch.Tensor, prefill: int) -> tuple[Any, Any]:
    """DiffLlama's causal forward, and its prefill then single-token steps through a DynamicCache, as its model
    calls it (its rotary tables, transformers' causal mask)."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    def call(chunk: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        positions = torch.arange(start, start + chunk.shape[1])[None].expand(chunk.shape[0], -1)
        mask = create_causal_mask(config=config, inputs_embeds=chunk, attention_mask=None, cache=cache,
                                  position_ids=positions)  # fmt: skip
        return layer(chunk, position_embeddings=rotary(chunk, positions), attention_mask=mask, cache=cache)[0]

    cache = DynamicCache(config=config)
    steps = [call(x[:, :prefill], 0, cache)] + [call(x[:, i : i + 1], i, cache) for i in range(prefill, x.shape[1])]
    return call(x, 0, None), torch.cat(steps, dim=1)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize(("layer_idx", "num_kv_heads"), [(3, 2), (0, 4)])
def test_from_hf_of_diffllama_equals_it_and_the_reference_forward_and_decoding(
    layer_idx: int, num_kv_heads: int, implementation: str
) -> None:
    """float64: our forward and our cache's decoding equal DiffLlama's forward and its DynamicCache's decoding, and
    the reference; 1e-10 under sdpa, 1e-6 under eager (its softmax in float32)."""
    layer, config, rotary = _diffllama(layer_idx, num_kv_heads, implementation)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert ours.differential_lambda_init == 0.8 - 0.6 * math.exp(-0.3 * layer_idx) and ours.num_kv_heads == num_kv_heads
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tol = {"atol": 1e-10, "rtol": 0} if implementation == "sdpa" else {"atol": 1e-6, "rtol": 0}
    with torch.no_grad():
        forward, decoding = _hf_steps(layer, config, rotary, x, prefill=3)
        torch.testing.assert_close(forward, decoding, atol=1e-10, rtol=0)  # (theirs agree with themselves)
        cache = ours.new_cache(2, 9)
        steps = [ours(x[:, :3], is_causal=True, kv_cache=cache)] + [
            ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(3, 9)
        ]
        torch.testing.assert_close(ours(x, is_causal=True), forward, **tol)
        torch.testing.assert_close(torch.cat(steps, dim=1), decoding, **tol)
        reference = _reference(ours, x, is_causal=True)
        torch.testing.assert_close(reference, forward, **tol)


def test_to_hf_writes_diffllama_back_and_refuses_another_lambda_init() -> None:
    """from_hf then to_hf (layer 0 of the config) gives a layer computing the same with the same lambdas; a module
    with another layer's lambda_init is refused for that config, naming differential_lambda_init."""
    layer, config, rotary = _diffllama(0, 2)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    back = ours.to_hf(config).to(torch.float64).eval()
    for name in K.LAMBDAS:
        assert torch.equal(getattr(back, name), getattr(layer, name)), name
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_hf_steps(back, config, rotary, x, 2), _hf_steps(layer, config, rotary, x, 2))
    other, _, _ = _diffllama(2, 2)
    with pytest.raises(ssm.ConfigError, match=r"differential_lambda_init=0\.2\d* \(module: 0\.47"):
        ssm.MultiHeadAttention.from_hf(other).to_hf(config)


def _pairs_the_wrong_way(original: Any) -> Any:  # head p paired with the pair's other head: lambda on the wrong map
    return lambda first, second, lam, lambda_init, eps: original(first.flip(1), second.flip(1), lam, lambda_init, eps)


def _without_lambda_init(original: Any) -> Any:  # lambda_init dropped from the norm's scale
    return lambda first, second, lam, lambda_init, eps: original(first, second, lam, 0.0, eps)


@pytest.mark.parametrize("bug", [_pairs_the_wrong_way, _without_lambda_init])
def test_a_bug_planted_in_our_differential_heads_is_refused_by_from_hf(
    bug: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, _, _ = _diffllama(1, 2)
    monkeypatch.setattr(K, "differential_heads", bug(K.differential_heads))
    where = r"differs from DiffLlamaAttention by [0-9.e-]+ in a (causal forward|decoding step)"
    with pytest.raises(ssm.ConfigError, match=where):
        ssm.MultiHeadAttention.from_hf(layer)


def test_need_weights_gives_each_head_s_map_as_diffllama_returns_it() -> None:
    """The probabilities asked for are each head's softmax map (the first of DiffLlama's two calls returns them)."""
    layer, _, rotary = _diffllama(1, 2, "eager")
    ours = ssm.MultiHeadAttention.from_hf(layer)
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    positions = torch.arange(5)[None]
    causal = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        theirs = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal)[1]
        _, weights = ours(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(weights, theirs, atol=1e-6, rtol=0)  # (eager's softmax in float32)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"num_kv_heads": 3, "num_heads": 3}, r"differential_lambda_init=0\.2 needs an even num_kv_heads: .* got 3\.$"),
     ({"dropout": 0.1}, r"differential_lambda_init=0\.2 with dropout=0\.1: no model computes them together"),
     ({"output_gate": True}, r"with output_gate=True: no model computes them together")],
)  # fmt: skip
def test_what_differential_attention_does_not_take_is_refused_by_name(options: dict[str, Any], message: str) -> None:
    sizes = {"d_model": 24, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ssm.ConfigError, match=message):
        ssm.MultiHeadAttention(**(sizes | options), differential_lambda_init=0.2)


def test_a_lambda_written_through_data_after_a_verdict_is_checked_again() -> None:
    """A lambda of another width written through `.data` (no attribute set, so nothing re-derived) is in the verdict's
    key: the next call is checked and names it, where broadcasting a (1,) lambda would compute silently."""
    module = ssm.MultiHeadAttention(16, 4, 2, differential_lambda_init=0.2)
    x = torch.randn(1, 3, 16)
    module(x, is_causal=True)
    module.lambda_k2.data = torch.zeros(1)
    with pytest.raises(ssm.ShapeError, match=r"lambda_k2"):
        module(x, is_causal=True)
