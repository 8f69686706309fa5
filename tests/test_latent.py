"""Multi-head latent attention: equals its per-head reference, decodes as one causal forward, caches the latent
only, explains its shape mistakes, and computes what transformers' DeepseekV3Attention computes."""

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_latent_attention

F64 = {"atol": 1e-10, "rtol": 1e-8}


@st.composite
def latent_layers(draw: Any) -> ssm.LatentAttention:
    """A float64 LatentAttention of drawn sizes, with random weights (norms included)."""
    sizes = {
        "num_heads": draw(st.integers(1, 4), label="num_heads"),
        "kv_lora_rank": draw(st.integers(1, 12), label="kv_lora_rank"),
        "d_nope": draw(st.integers(1, 6), label="d_nope"),
        "d_rope": 2 * draw(st.integers(1, 3), label="d_rope / 2"),
        "d_value": draw(st.integers(1, 6), label="d_value"),
        "q_lora_rank": draw(st.one_of(st.none(), st.integers(1, 12)), label="q_lora_rank"),
        "bias": draw(st.booleans(), label="bias"),
        "interleaved": draw(st.booleans(), label="interleaved"),
        "rope_theta": draw(st.sampled_from([10.0, 10000.0]), label="rope_theta"),
    }
    d_model = draw(st.integers(1, 24), label="d_model")
    module = ssm.LatentAttention(d_model, dtype=torch.float64, **sizes)
    seed = draw(st.integers(0, 2**16), label="seed")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.rand(param.shape, generator=generator, dtype=torch.float64) - 0.5)
    return module


def _reference(module: ssm.LatentAttention, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return per_head_latent_attention(
        x, module.state_dict(), num_heads=module.num_heads, kv_lora_rank=module.kv_lora_rank, d_nope=module.d_nope,
        d_rope=module.d_rope, d_value=module.d_value, rope_theta=module.rope_theta, interleaved=module.interleaved,
        **kwargs,
    )  # fmt: skip


@given(module=latent_layers(), data=st.data())
def test_latent_attention_equals_the_per_head_reference(module: ssm.LatentAttention, data: st.DataObject) -> None:
    """Bottleneck or not, interleaved RoPE or not, causal or not, padded or not; with grad and without."""
    batch, seq = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(1, 12), label="seq")
    x = torch.randn(batch, seq, module.d_model, dtype=torch.float64)
    is_causal = data.draw(st.booleans(), label="is_causal")
    padding = (torch.rand(batch, seq) < 0.3) if data.draw(st.booleans(), label="padded") else None
    expected = _reference(module, x, is_causal=is_causal, key_padding_mask=padding)
    torch.testing.assert_close(module(x, is_causal=is_causal, key_padding_mask=padding), expected, **F64)
    with torch.no_grad():
        torch.testing.assert_close(module(x, is_causal=is_causal, key_padding_mask=padding), expected, **F64)


@given(module=latent_layers(), data=st.data())
def test_decoding_from_the_latent_cache_equals_one_causal_forward(
    module: ssm.LatentAttention, data: st.DataObject
) -> None:
    """A prefill chunk, then token by token, each step rebuilding keys and values from the cached latent."""
    batch, seq = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(1, 12), label="seq")
    x = torch.randn(batch, seq, module.d_model, dtype=torch.float64)
    cache = module.new_cache(batch, seq)
    prefill = data.draw(st.integers(0, seq), label="prefill")
    steps = [module(x[:, :prefill], is_causal=True, kv_cache=cache)]
    steps += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, seq)]
    torch.testing.assert_close(torch.cat(steps, dim=1), module(x, is_causal=True), **F64)
    assert len(cache) == seq


def test_the_cache_holds_the_latent_and_one_rotary_key_only() -> None:
    """DeepSeek-V3's sizes on `meta`: 576 numbers per position and sequence, against 128 heads of K and V
    (40960 numbers) for a K/V cache: 71x less; and what is cached is exactly the latent and the rotary key."""
    mla = ssm.LatentAttention(
        7168, 128, q_lora_rank=1536, kv_lora_rank=512, d_nope=128, d_rope=64, d_value=128, device="meta",
        dtype=torch.bfloat16,
    )  # fmt: skip
    cache = mla.new_cache(batch=1, capacity=4096)
    assert cache.buffer.shape == (1, 4096, 512 + 64)
    kv = ssm.KVCache(1, 128, 4096, 192, dtype=torch.bfloat16, device="meta")  # K/V at every head (d_value padded)
    assert kv.nbytes // cache.nbytes == 2 * 128 * 192 // 576
    small = ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    cache = small.new_cache(2, 8)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        small(x, kv_cache=cache)
        compressed = small.kv_a_proj_with_mqa(x)
        torch.testing.assert_close(cache.latent(), small.kv_a_layernorm(compressed[..., :6]))
        assert cache.rope_keys().shape == (2, 1, 3, 2)  # rotated: one key shared by the 4 heads


def test_latent_shape_mistakes_are_shape_errors_naming_the_dimension() -> None:
    mla = ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    with pytest.raises(ssm.ShapeError, match=r"query has d_model=12 \(axis 2\), but the module set d_model=16"):
        mla(torch.randn(1, 3, 12))
    other = ssm.LatentCache(1, 8, kv_lora_rank=7, d_rope=2, dtype=torch.float32)
    with pytest.raises(ssm.ShapeError, match="kv_lora_rank"):
        mla(torch.randn(1, 3, 16), kv_cache=other)
    assert len(other) == 0
    with pytest.raises(ssm.ShapeError, match=r"kv_cache must be a shapesafe_mha\.LatentCache"):
        mla(torch.randn(1, 3, 16), kv_cache=ssm.KVCache(1, 4, 8, 5, dtype=torch.float32))  # type: ignore[arg-type]
    with pytest.raises(ssm.ShapeError, match=r"key_padding_mask has kv_seq=2 \(axis 1\)"):
        mla(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ssm.ConfigError, match=r"d_rope=3 is odd, but rotary embeddings rotate pairs"):
        ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=3, d_value=5)
    with pytest.raises(ssm.ConfigError, match="kv_lora_rank must be a positive int"):
        ssm.LatentAttention(16, 4, kv_lora_rank=0, d_nope=3, d_rope=2, d_value=5)


def test_the_trace_shows_the_latent_stages_and_the_cache_per_position() -> None:
    """Decoding attends the cache as it is (a view, one head of keys); a prefill rebuilds every head's keys."""
    report = ssm.trace_latent(ssm.LatentTraceConfig(decode=100))
    stages = {s.name: s for s in report.stages}
    assert stages["latent"].named_shape == "batch seq kv_lora_rank"
    assert stages["cache_latent"].named_shape == "batch kv_seq kv_lora_rank"
    assert stages["keys_latent"].named_shape == "batch 1 kv_seq kv_lora_rank+d_rope"
    assert stages["keys_latent"].aliases == "cache_buffer"  # no key is rebuilt or copied to decode
    assert "kv_b_proj" not in stages
    assert stages["q_nope"].aliases == "q_b_proj"  # the heads are a view of the projection
    totals = report.totals
    assert totals["kv_cache_bytes_per_position"] == (512 + 64) * 2
    assert totals["kv_cache_bytes_per_position_mha"] == 128 * (128 + 64 + 128) * 2
    prefill = {s.name: s for s in ssm.trace_latent(ssm.LatentTraceConfig(seq=16)).stages}
    assert prefill["k"].named_shape == "batch num_heads kv_seq d_nope+d_rope"
    assert prefill["kv_b_proj"].named_shape == "batch kv_seq num_heads*(d_nope+d_value)"


@given(module=latent_layers(), data=st.data())
def test_decoding_by_absorption_equals_rebuilding(module: ssm.LatentAttention, data: st.DataObject) -> None:
    """Without autograd a one-token step absorbs kv_b_proj into the query and the output and attends the cached
    latent as it is; it equals the rebuilding step (taken with grad on), padded or not."""
    batch, seq = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(1, 10), label="seq")
    x = torch.randn(batch, seq + 1, module.d_model, dtype=torch.float64)
    padding = (torch.rand(batch, seq + 1) < 0.3) if data.draw(st.booleans(), label="padded") else None
    outputs = []
    for grad in (True, False):
        cache = module.new_cache(batch, seq + 1)
        with torch.set_grad_enabled(grad):
            module(
                x[:, :seq],
                is_causal=True,
                kv_cache=cache,
                key_padding_mask=None if padding is None else padding[:, :seq],
            )
            outputs.append(module(x[:, seq:], is_causal=True, kv_cache=cache, key_padding_mask=padding))
    torch.testing.assert_close(outputs[1], outputs[0].detach(), **F64)


def test_a_hooked_or_adapted_kv_b_proj_is_called_not_absorbed() -> None:
    """Absorption reads kv_b_proj's weight; with a hook on it the module calls it instead (and the hook fires)."""
    mla = ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    calls: list[int] = []
    mla.kv_b_proj.register_forward_hook(lambda _module, _args, _out: calls.append(1))
    cache = mla.new_cache(1, 8)
    with torch.no_grad():
        mla(torch.randn(1, 3, 16), is_causal=True, kv_cache=cache)
        mla(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    assert len(calls) == 2


# --- Hugging Face ---------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


# DeepSeek-V3's YaRN (mscale = mscale_all_dim: the score scale times mscale**2, tables unscaled), DeepSeek-V2's
# (0.707 both), and one with mscale alone (the tables scaled by the attention factor, the score scale as it is)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
ROPES = {
    "default": None,
    "yarn-v3": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    "yarn-v2": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn-mscale-only": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.0},
}


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("q_lora_rank", [12, None])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope", ROPES)
def test_from_hf_equals_deepseek_v3_attention_full_and_decoding(
    implementation: str, q_lora_rank: int | None, interleave: bool, rope: str
) -> None:
    """float64; HF computes its RMSNorms (and the eager softmax) in float32, so 1e-6. With YaRN the tables are
    the scaled ones and the score scale DeepSeek's (times yarn_get_mscale(factor, mscale_all_dim)**2)."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1, rope_interleave=interleave,
        attn_implementation=implementation, max_position_embeddings=160,
        **({} if ROPES[rope] is None else {"rope_parameters": ROPES[rope]}),
    )  # fmt: skip
    torch.manual_seed(0)
    layer = DeepseekV3Attention(config, layer_idx=0).to(torch.float64).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.5, 0.5)
    ours = ssm.LatentAttention.from_hf(layer)
    assert (ours.q_lora_rank, ours.interleaved) == (q_lora_rank, interleave)
    assert ours.scale == pytest.approx(layer.scaling, rel=1e-12)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    positions = torch.arange(9).expand(2, 9)
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
    with torch.no_grad():
        expected = layer(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
        torch.testing.assert_close(ours(x, is_causal=True), expected, atol=1e-6, rtol=1e-6)
        cache = ours.new_cache(2, 9)
        steps = [ours(x[:, :3], is_causal=True, kv_cache=cache)]
        steps += [ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(3, 9)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ssm.ConfigError, match=r"LatentAttention.from_hf"):
        ssm.MultiHeadAttention.from_hf(layer)


def test_a_rope_type_we_do_not_compute_is_refused_by_its_field() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    )  # fmt: skip
    refused = r"^LatentAttention.from_hf\(\): rope_parameters\['rope_type'\]='linear'"
    with pytest.raises(ssm.ConfigError, match=refused):
        ssm.LatentAttention.from_hf(DeepseekV3Attention(config, layer_idx=0))


@pytest.mark.parametrize("context", [5, 64])
def test_dynamic_rope_loads_and_frequencies_that_never_turn_are_refused(
    context: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3 with dynamic RoPE: its rotary part scaled past max_position_embeddings as transformers scales it,
    verified by the probe (a second one from context - 5 on, where the plain one stays short); frequencies that
    never turn are refused in the decoding step that passes the length."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from shapesafe_mha._compute import rotary

    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1, max_position_embeddings=context,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    layer = DeepseekV3Attention(config, layer_idx=0).double()
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.5, 0.5)
    assert ssm.LatentAttention.from_hf(layer).rotary.context == context
    never = rotary.inverse_frequencies  # the bug: the short frequencies at every length
    monkeypatch.setattr(rotary, "long_frequencies", lambda d, theta, scaling, length, **held: never(d, theta, scaling))
    where = "a decoding step" + (f" at {context}" if context > 5 else "")
    with pytest.raises(ssm.ConfigError, match=rf"differs from DeepseekV3Attention by .* in {where} \(probe"):
        ssm.LatentAttention.from_hf(layer)


def test_a_layer_scaling_scores_otherwise_than_its_yarn_config_is_refused_naming_scaling() -> None:
    """DeepSeek-V3's YaRN multiplies 1/sqrt(qk_head_dim) by mscale**2; a layer holding another scaling (1/sqrt
    alone, as a port that forgot mscale computes) is refused naming scaling and what the config makes it."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1, max_position_embeddings=160,
        rope_parameters=ROPES["yarn-v3"],
    )  # fmt: skip
    layer = DeepseekV3Attention(config, layer_idx=0)
    layer.scaling = (6 + 4) ** -0.5
    with pytest.raises(ssm.ConfigError, match=r"scaling=0.316.*the config makes it"):
        ssm.LatentAttention.from_hf(layer)


def test_decoding_with_a_growing_padding_mask_is_checked_a_few_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verdicts by relations, as for MultiHeadAttention: a prefill and 22 steps are checked in full only when
    a size relation is new (the first step, and kv_seq passing one of the module's sizes)."""
    import shapesafe_mha._modules.latent as latent

    mla = ssm.LatentAttention(24, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    cache = mla.new_cache(2, 40)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, :2] = True
    sessions: list[int] = []
    original = latent.Session

    def counting(*args: Any, **kwargs: Any) -> Any:
        sessions.append(len(cache))
        return original(*args, **kwargs)

    monkeypatch.setattr(latent, "Session", counting)
    with torch.no_grad():
        mla(torch.randn(2, 8, 24), is_causal=True, kv_cache=cache, key_padding_mask=padding[:, :8])
        for t in range(8, 30):
            mla(torch.randn(2, 1, 24), is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : t + 1])
    assert len(sessions) <= 6, sessions
    assert len(cache) == 30


def test_a_latent_cache_split_otherwise_is_named_not_a_torch_error() -> None:
    """kv_lora_rank and d_rope swapped: the same total width, so only the split tells; named, cache unchanged."""
    mla = ssm.LatentAttention(64, 8, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=6)
    swapped = ssm.LatentCache(2, 8, 4, 16, dtype=torch.float32)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ssm.ShapeError, match=r"kv_cache holds kv_lora_rank=4"):
            mla(torch.randn(2, 1, 64), kv_cache=swapped)
    assert len(swapped) == 0
    cache = mla.new_cache(2, 8).to(torch.float64)
    assert cache.dtype == torch.float64 and cache.buffer.shape == (2, 8, 20)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("d_rope", [2, 6])
def test_a_latent_cache_of_another_d_rope_is_refused_after_a_verdict_for_a_right_one(grad: bool, d_rope: int) -> None:
    """The right kv_lora_rank but another d_rope: once prefill and a decoding step with the right cache have been
    accepted (verdicts remembered), the wrong cache is still a ShapeError naming the width, and is left empty."""
    mla = ssm.LatentAttention(64, 8, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=6)
    with torch.set_grad_enabled(grad):
        right = mla.new_cache(2, 8)
        mla(torch.randn(2, 3, 64), kv_cache=right, is_causal=True)
        mla(torch.randn(2, 1, 64), kv_cache=right, is_causal=True)
        for seq in (3, 1):
            wrong = ssm.LatentCache(2, 8, 16, d_rope, dtype=torch.float32)
            with pytest.raises(ssm.ShapeError, match=rf"kv_cache has kv_lora_rank\+d_rope={16 + d_rope} \(axis 2\)"):
                mla(torch.randn(2, seq, 64), kv_cache=wrong, is_causal=True)
            assert len(wrong) == 0
