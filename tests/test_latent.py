"""Multi-head latent attention: equals its per-head reference, decodes as one causal forward, caches the latent
only, explains its shape mistakes, and computes what transformers' DeepseekV3Attention computes."""

import contextlib
import math
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


@pytest.mark.parametrize("name", ["batch", "capacity", "kv_lora_rank", "d_rope"])
def test_a_latent_cache_of_a_size_that_is_not_positive_is_refused_naming_it(name: str) -> None:
    sizes = {"batch": 2, "capacity": 8, "kv_lora_rank": 6, "d_rope": 2} | {name: 0}
    with pytest.raises(ssm.ConfigError, match=rf"^LatentCache\(\): {name} must be a positive int, but got 0\.$"):
        ssm.LatentCache(**sizes, dtype=torch.float32)


def test_a_reset_latent_cache_decodes_as_a_new_one_and_holds_no_graph() -> None:
    """reset() empties the cache (len 0, positions from 0 again) and drops the autograd graph of what it held."""
    mla = ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5)
    x = torch.randn(2, 3, 16)
    cache = mla.new_cache(2, 8)
    mla(torch.randn(2, 5, 16), is_causal=True, kv_cache=cache)
    assert cache.buffer.requires_grad  # written out of place, in the graph
    cache.reset()
    assert len(cache) == 0 and not cache.buffer.requires_grad and cache.buffer.shape == (2, 8, 8)
    torch.testing.assert_close(mla(x, is_causal=True, kv_cache=cache), mla(x, is_causal=True))
    assert len(cache) == 3


def test_a_latent_cache_moves_to_the_device_it_is_given() -> None:
    """to(device=...) moves the buffer (what it holds with it); to(dtype) keeps the device."""
    cache = ssm.LatentCache(2, 8, 6, 2, dtype=torch.float32)
    assert cache.to(device="meta") is cache
    assert cache.device.type == "meta" and cache.dtype == torch.float32
    assert cache.to(torch.float64).device.type == "meta" and cache.dtype == torch.float64


def test_the_repr_names_the_sizes_and_only_the_variants_set() -> None:
    """Defaults are not printed (interleaving, RoPE scaling, the default scale 1/sqrt(d_nope + d_rope))."""
    sizes = {"kv_lora_rank": 6, "d_nope": 3, "d_rope": 2, "d_value": 5}
    plain = (
        "d_model=16, num_heads=4, q_lora_rank=None, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5, rope_theta=10000.0"
    )
    assert ssm.LatentAttention(16, 4, **sizes).extra_repr() == plain
    assert ssm.LatentAttention(16, 4, **sizes, scale=5**-0.5).extra_repr() == plain  # the default, given
    assert ssm.LatentAttention(16, 4, **sizes, interleaved=True).extra_repr() == plain + ", interleaved=True"
    assert ssm.LatentAttention(16, 4, **sizes, scale=0.25).extra_repr() == plain + ", scale=0.25"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    scaled = ssm.LatentAttention(16, 4, **sizes, rope_scaling=yarn, interleaved=True, scale=0.5)
    text = scaled.extra_repr()
    assert text.startswith(plain + ", interleaved=True, rope_scaling=") and text.endswith(", scale=0.5")
    assert "yarn" in text and str(scaled.rotary.scaling) in text


def _count_sessions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per checked (full) forward of LatentAttention from now on."""
    import shapesafe_mha._modules.latent as latent

    sessions: list[int] = []
    original = latent.Session

    def counting(*args: Any, **kwargs: Any) -> Any:
        sessions.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(latent, "Session", counting)
    return sessions


# sizes none of which is 7, 9, 10 or 11 (nor d_nope + d_rope = 5, kv_lora_rank + d_rope = 8): lengths that are free
_FREE = {"kv_lora_rank": 6, "d_nope": 3, "d_rope": 2, "d_value": 5}


@pytest.mark.parametrize("mask", ["none", "key_padding_mask", "attn_mask"])
def test_calls_without_a_cache_are_checked_once_for_lengths_that_are_none_of_the_module_sizes(
    mask: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict covers every call whose sizes relate the same way: seq 7, 9 and 11 (free) share one."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    sessions = _count_sessions(monkeypatch)
    for seq in (7, 9, 11, 9):
        masks = {
            "none": {},
            "key_padding_mask": {"key_padding_mask": torch.zeros(2, seq, dtype=torch.bool)},
            "attn_mask": {"attn_mask": torch.zeros(seq, seq, dtype=torch.bool)},
        }[mask]
        mla(torch.randn(2, seq, 24), **masks)
    assert len(sessions) == 1


@pytest.mark.parametrize("grad", [True, False])
def test_decoding_without_a_mask_is_checked_for_the_prefill_and_the_first_step_only(
    grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unmasked, kv_seq is checked against nothing: its passing the module's sizes (4, 5, 6, 8) checks nothing again."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    cache = mla.new_cache(1, 16)
    sessions = _count_sessions(monkeypatch)
    with torch.set_grad_enabled(grad):
        mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=cache)
        for _ in range(10):
            mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=cache)
    assert len(sessions) == 2 and len(cache) == 13


@pytest.mark.parametrize("name", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("filled", [0, 4])
def test_a_one_column_mask_is_refused_once_the_cache_holds_more_after_a_verdict_for_a_full_one(
    name: str, filled: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mask of one key column would broadcast over every key: it is right only while kv_seq is 1. After a step with
    a mask of every key (of one column, from an empty cache, or of five) was accepted, a step with one column over
    more keys is a ShapeError naming kv_seq, and leaves the cache as it was."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    cache = mla.new_cache(1, 16)
    with torch.no_grad():
        if filled:
            mla(torch.randn(1, filled, 24), is_causal=True, kv_cache=cache)

        def mask(width: int) -> dict[str, torch.Tensor]:
            return {name: torch.zeros(1, width, dtype=torch.bool)}

        mla(torch.randn(1, 1, 24), kv_cache=cache, **mask(filled + 1))
        with pytest.raises(ssm.ShapeError, match=rf"{name} has kv_seq=1 .*but .*kv_seq={filled + 2}"):
            mla(torch.randn(1, 1, 24), kv_cache=cache, **mask(1))
    assert len(cache) == filled + 1


def test_is_causal_of_another_type_is_refused_after_a_verdict_for_a_bool() -> None:
    """`is_causal=1` equals True, but is refused as an int even once `is_causal=True` calls are remembered."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    x = torch.randn(1, 3, 24)
    mla(x, is_causal=True)
    with pytest.raises(ssm.ShapeError, match=r"^LatentAttention.forward\(\): is_causal must be bool, but got int 1"):
        mla(x, is_causal=1)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
def test_a_verdict_under_autocast_holds_for_that_autocast_dtype_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls under one autocast dtype share a verdict; another autocast dtype is checked again (its stage dtypes)."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    x = torch.randn(1, 3, 24)
    sessions = _count_sessions(monkeypatch)
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert mla(x).dtype == dtype
    assert len(sessions) == 2


def test_a_cache_made_for_another_batch_is_refused_after_verdicts_for_the_right_one() -> None:
    """Writing one sequence's latent into a cache of two would broadcast silently; refused, after a prefill and a
    step with a right cache were remembered, naming batch, and the cache left empty."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    right = mla.new_cache(1, 8)
    with torch.no_grad():
        mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=right)
        mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=right)
        wrong = mla.new_cache(3, 8)
        with pytest.raises(ssm.ShapeError, match=r"kv_cache has batch=3 \(axis 0\), but query set batch=1"):
            mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=wrong)
    assert len(wrong) == 0


def test_a_float_query_of_another_dtype_or_device_is_refused_naming_both() -> None:
    mla = ssm.LatentAttention(24, 4, **_FREE)
    dtype = (
        r"^LatentAttention.forward\(\): query has dtype float64, but the module's parameters are float32; cast one of "
        r"them \(query.to\(torch.float32\) or module.to\(torch.float64\)\)\.\n"
    )
    with pytest.raises(ssm.ShapeError, match=dtype):
        mla(torch.randn(1, 3, 24, dtype=torch.float64))
    device = r"^LatentAttention.forward\(\): query is on meta, but the module's parameters are on cpu\.\n"
    with pytest.raises(ssm.ShapeError, match=device):
        mla(torch.randn(1, 3, 24, device="meta"))


def test_a_refusal_lists_the_call_with_its_masks_and_positions() -> None:
    """The "Called with:" lines show every tensor argument given: both masks and the positions."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    with pytest.raises(ssm.ShapeError) as refused:
        mla(
            torch.randn(1, 3, 24),
            attn_mask=torch.zeros(3, 3, dtype=torch.bool),
            key_padding_mask=torch.zeros(1, 2, dtype=torch.bool),
            positions=torch.arange(3)[None],
        )
    called = str(refused.value).split("Called with:\n")[1].split("\nBound so far")[0]
    assert called.splitlines() == [
        "  query: f32[batch=1, seq=3, d_model=24]",
        "  attn_mask: bool[3, 3]",
        "  key_padding_mask: bool[1, 2]",
        "  positions: int64[batch=1, seq=3]",
    ]


def test_a_kv_cache_that_is_no_cache_at_all_is_a_shape_error() -> None:
    mla = ssm.LatentAttention(24, 4, **_FREE)
    with pytest.raises(ssm.ShapeError, match=r"kv_cache must be a shapesafe_mha\.LatentCache"):
        mla(torch.randn(1, 3, 24), kv_cache="cache")  # type: ignore[arg-type]


def test_is_causal_defaults_to_false() -> None:
    """By default the first query also attends the later keys."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    x = torch.randn(1, 4, 24)
    torch.testing.assert_close(mla(x), mla(x, is_causal=False))
    assert not torch.allclose(mla(x), mla(x, is_causal=True))


def test_a_remembered_decoding_step_computes_what_the_checked_one_did_bit_for_bit() -> None:
    """Two equal caches: the first step is checked, the same step on the other runs under the remembered verdict;
    both absorb kv_b_proj, so their outputs are equal exactly (absorbing and rebuilding differ in rounding)."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    x = torch.randn(1, 4, 24)
    with torch.no_grad():
        caches = [mla.new_cache(1, 8), mla.new_cache(1, 8)]
        for cache in caches:
            mla(x[:, :3], is_causal=True, kv_cache=cache)
        checked, remembered = (mla(x[:, 3:], is_causal=True, kv_cache=cache) for cache in caches)
    assert torch.equal(checked, remembered)


def test_each_decoding_path_is_checked_once_with_grad_or_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step without autograd (absorbed) and one with it (keys rebuilt) are checked once each, in any order."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    cache = mla.new_cache(1, 16)
    sessions = _count_sessions(monkeypatch)
    mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=cache)
    for grad in (False, True, False, True):
        with torch.set_grad_enabled(grad):
            mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=cache)
    assert len(sessions) == 3


def test_a_cache_cannot_be_written_under_vmap_and_the_refusal_names_the_module() -> None:
    mla = ssm.LatentAttention(24, 4, **_FREE)
    cache = mla.new_cache(1, 8)
    refused = r"^LatentAttention.forward\(\): kv_cache cannot be written under torch.vmap"
    with pytest.raises(ssm.ShapeError, match=refused):
        torch.vmap(lambda x: mla(x, kv_cache=cache))(torch.randn(2, 1, 3, 24))
    assert len(cache) == 0


@pytest.mark.parametrize("frozen", ["nothing", "kv_a"])
def test_an_earlier_steps_gradient_survives_later_steps(frozen: str) -> None:
    """Each differentiated step writes a new buffer: the graph of an earlier step keeps the one it saw, so backward
    through it after later steps gives the gradient it gave before them. With kv_a_proj_with_mqa frozen, a later
    step whose query needs no grad still writes out of place, the buffer being in the earlier graph."""
    mla = ssm.LatentAttention(24, 4, **_FREE, dtype=torch.float64)
    if frozen == "kv_a":
        mla.kv_a_proj_with_mqa.requires_grad_(False)
        mla.kv_a_layernorm.requires_grad_(False)
    x = torch.randn(1, 4, 24, dtype=torch.float64, requires_grad=True)
    cache = mla.new_cache(1, 8)
    first = mla(x[:, :3], is_causal=True, kv_cache=cache)
    (expected,) = torch.autograd.grad(first.sum(), x, retain_graph=True)
    mla(x[:, 3:].detach(), is_causal=True, kv_cache=cache)
    mla(x[:, 3:].detach(), is_causal=True, kv_cache=cache)
    (after,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(after, expected, **F64)


@pytest.mark.parametrize("frozen", [False, True])
def test_decoding_with_nothing_to_differentiate_writes_into_the_buffer_in_place(frozen: bool) -> None:
    """No new buffer a step, under no_grad or for a frozen module: the buffer held before decoding sees the steps."""
    mla = ssm.LatentAttention(24, 4, **_FREE).requires_grad_(not frozen)
    cache = mla.new_cache(1, 8)
    held = cache.buffer
    with torch.set_grad_enabled(frozen):
        mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=cache)
        mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=cache)
    assert cache.buffer is held and held[:, :4].abs().sum() > 0


@pytest.mark.parametrize("trainable", ["everything", "kv_a_layernorm"])
def test_a_differentiated_step_leaves_the_buffer_it_replaced_as_it_was(trainable: str) -> None:
    """A step whose latent needs grad writes a new buffer; the one held before stays empty. With kv_a_layernorm the
    only trainable part upstream, only the latent (not the rotary key) needs grad: out of place all the same."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    if trainable == "kv_a_layernorm":
        mla.requires_grad_(False).kv_a_layernorm.requires_grad_(True)
    cache = mla.new_cache(1, 8)
    held = cache.buffer
    mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=cache)
    assert cache.buffer is not held and not held.any() and cache.buffer[:, :3].any()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("masked_by", ["key_padding_mask", "attn_mask"])
def test_a_query_with_every_key_masked_gets_zeros_absorbed_or_rebuilt(grad: bool, masked_by: str) -> None:
    """The second sequence's step sees no key at all: its output is o_proj's bias alone (zero attention), absorbed
    (no grad) or rebuilt (grad); the first sequence's is as without the mask."""
    mla = ssm.LatentAttention(24, 4, **_FREE, bias=True, dtype=torch.float64)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    hidden = torch.zeros(2, 5, dtype=torch.bool)
    hidden[1] = True
    mask = {"key_padding_mask": hidden} if masked_by == "key_padding_mask" else {"attn_mask": ~hidden[:, None, None]}
    cache = mla.new_cache(2, 5)
    with torch.set_grad_enabled(grad):
        mla(x[:, :4], is_causal=True, kv_cache=cache)
        out = mla(x[:, 4:], kv_cache=cache, **mask)
    torch.testing.assert_close(out[1, 0], mla.o_proj.bias.detach(), **F64)
    torch.testing.assert_close(out[0], mla(x, is_causal=True)[0, 4:].detach(), **F64)


def _biased_kv_b(mla: ssm.LatentAttention) -> ssm.LatentAttention:
    old = mla.kv_b_proj
    mla.kv_b_proj = torch.nn.Linear(old.in_features, old.out_features, dtype=old.weight.dtype)
    return mla


def test_a_kv_b_proj_with_a_bias_is_rebuilt_not_absorbed() -> None:
    """Absorption has no place for kv_b_proj's bias: with one, decoding without grad still equals one causal forward."""
    mla = _biased_kv_b(ssm.LatentAttention(24, 4, **_FREE, dtype=torch.float64))
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    cache = mla.new_cache(1, 8)
    with torch.no_grad():
        steps = [mla(x[:, :3], is_causal=True, kv_cache=cache)]
        steps += [mla(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in (3, 4)]
    torch.testing.assert_close(torch.cat(steps, dim=1), mla(x, is_causal=True), **F64)


@pytest.mark.filterwarnings("ignore")  # torch.jit.trace's deprecation and its TracerWarnings
def test_a_decoding_step_under_jit_trace_computes_what_the_eager_one_does() -> None:
    """While torch.jit.trace records a one-token step it is rebuilt, never absorbed: kv_b_proj's bias counts."""
    mla = _biased_kv_b(ssm.LatentAttention(24, 4, **_FREE, dtype=torch.float64))
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    caches = [mla.new_cache(1, 8), mla.new_cache(1, 8)]
    outputs: list[torch.Tensor] = []

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mla = mla  # a submodule: its parameters are the graph's, not constants

        def forward(self, query: torch.Tensor) -> torch.Tensor:
            outputs.append(self.mla(query, is_causal=True, kv_cache=caches[1]))
            return outputs[-1]

    with torch.no_grad():
        for cache in caches:
            mla(x[:, :3], is_causal=True, kv_cache=cache)
        eager = mla(x[:, 3:], is_causal=True, kv_cache=caches[0])
        torch.jit.trace(Step(), (x[:, 3:],), check_trace=False)
    torch.testing.assert_close(outputs[0], eager, **F64)


def _traced_stages(run: Any) -> list[str]:
    from shapesafe_mha._core.trace import tracing

    with tracing() as tracer:
        run()
    return [s.name for s in tracer.stages]


def test_only_one_token_steps_without_grad_are_absorbed() -> None:
    """A step with autograd on, or a chunk of several tokens without, rebuilds keys (kv_b_proj); a one-token step
    without autograd attends the cached latent (keys_latent)."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    cache = mla.new_cache(1, 16)
    mla(torch.randn(1, 3, 24), is_causal=True, kv_cache=cache)
    grad_step = _traced_stages(lambda: mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=cache))
    with torch.no_grad():
        chunk = _traced_stages(lambda: mla(torch.randn(1, 2, 24), is_causal=True, kv_cache=cache))
        step = _traced_stages(lambda: mla(torch.randn(1, 1, 24), is_causal=True, kv_cache=cache))
    assert "kv_b_proj" in grad_step and "keys_latent" not in grad_step
    assert "kv_b_proj" in chunk and "keys_latent" not in chunk
    assert "keys_latent" in step and "kv_b_proj" not in step


def test_unchecked_turns_the_checks_off_under_tracing_too() -> None:
    """Inside unchecked() a traced call with a mask of the wrong width fails as torch fails, not as a ShapeError."""
    mla = ssm.LatentAttention(24, 4, **_FREE)
    bad = torch.zeros(1, 2, dtype=torch.bool)
    with ssm.unchecked(), pytest.raises(RuntimeError):
        _traced_stages(lambda: mla(torch.randn(1, 3, 24), key_padding_mask=bad))
    with pytest.raises(ssm.ShapeError, match="key_padding_mask has kv_seq=2"):
        _traced_stages(lambda: mla(torch.randn(1, 3, 24), key_padding_mask=bad))


def test_dropout_acts_in_training_only() -> None:
    """In eval a module with dropout computes what it computes without; in training its probabilities are dropped."""
    mla = ssm.LatentAttention(24, 4, **_FREE, dropout=0.5).eval()
    x = torch.randn(2, 6, 24)
    without = ssm.LatentAttention(24, 4, **_FREE)
    without.load_state_dict(mla.state_dict())
    torch.testing.assert_close(mla(x), without.eval()(x))
    torch.manual_seed(0)
    assert not torch.allclose(mla.train()(x), without.train()(x))


def test_absorbed_decoding_applies_an_attn_mask() -> None:
    """A one-token step with an attn_mask hiding some cached keys, absorbed (no grad), equals the rebuilt step."""
    mla = ssm.LatentAttention(24, 4, **_FREE, dtype=torch.float64)
    x = torch.randn(1, 6, 24, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False, True, True]])
    outputs = []
    for grad in (True, False):
        cache = mla.new_cache(1, 6)
        with torch.set_grad_enabled(grad):
            mla(x[:, :5], is_causal=True, kv_cache=cache)
            outputs.append(mla(x[:, 5:], attn_mask=mask, kv_cache=cache))
    torch.testing.assert_close(outputs[1], outputs[0].detach(), **F64)
    assert not torch.allclose(outputs[1], mla(x, is_causal=True)[:, 5:])


_OWNER = r"^LatentAttention\(d_model=16, num_heads=4\): "


@pytest.mark.parametrize("name", ["d_model", "num_heads", "kv_lora_rank", "d_nope", "d_rope", "d_value", "q_lora_rank"])
def test_a_module_size_that_is_not_positive_is_refused_naming_it(name: str) -> None:
    sizes = {"kv_lora_rank": 6, "d_nope": 3, "d_rope": 2, "d_value": 5, "q_lora_rank": 8}
    given = {"d_model": 16, "num_heads": 4, **sizes, name: 0}
    owner = _OWNER.replace("16", str(given["d_model"])).replace("=4", f"={given['num_heads']}")
    with pytest.raises(ssm.ConfigError, match=rf"{owner}{name} must be a positive int, but got 0\.$"):
        ssm.LatentAttention(given.pop("d_model"), given.pop("num_heads"), **given)


@pytest.mark.parametrize(
    ("variant", "refused"),
    [
        ({"d_rope": 3}, r"d_rope=3 is odd, but rotary embeddings rotate pairs of features"),
        ({"norm_eps": -1.0}, r"norm_eps must be a finite number >= 0, but got -1\.0\.$"),
        *[
            ({"dropout": p}, rf"dropout must be a number in \[0, 1\), but got {p!r}\.$")
            for p in (True, "0.1", 1.0, 1.5, -0.1)
        ],
        *[
            ({"scale": v}, rf"scale must be a finite positive number, but got {v!r}\.$")
            for v in (True, 0, -1.0, math.inf, "1")
        ],
    ],
)
def test_a_variant_out_of_range_is_refused_naming_the_module_and_the_value(
    variant: dict[str, Any], refused: str
) -> None:
    with pytest.raises(ssm.ConfigError, match=_OWNER + refused):
        ssm.LatentAttention(16, 4, **({"kv_lora_rank": 6, "d_nope": 3, "d_rope": 2, "d_value": 5} | variant))


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_biases_are_off_by_default_and_bias_true_puts_them_where_deepseek_has_them(q_lora_rank: int | None) -> None:
    """DeepSeek's attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj; q_proj, q_b_proj and kv_b_proj never."""
    for bias in (False, True):
        kwargs = {} if not bias else {"bias": True}
        mla = ssm.LatentAttention(16, 4, **_FREE, q_lora_rank=q_lora_rank, **kwargs)
        with_bias = {name for name, module in mla.named_modules() if getattr(module, "bias", None) is not None}
        expected = {"kv_a_proj_with_mqa", "o_proj"} | ({"q_a_proj"} if q_lora_rank else set())
        assert with_bias == (expected if bias else set())


def test_a_module_made_on_a_device_has_its_rotary_tables_there() -> None:
    mla = ssm.LatentAttention(16, 4, **_FREE, device="meta")
    assert {b.device.type for b in mla.buffers()} | {p.device.type for p in mla.parameters()} == {"meta"}


def test_a_cache_of_another_kv_lora_rank_is_refused_with_the_fix() -> None:
    mla = ssm.LatentAttention(16, 4, **_FREE)
    refused = (
        r"^LatentAttention.forward\(\): kv_cache holds kv_lora_rank=7 and d_rope=2 per position, but the module "
        r"\(kv_lora_rank=6, d_rope=2\) needs those; make it with module.new_cache\(batch, capacity\)\.\n"
    )
    with pytest.raises(ssm.ShapeError, match=refused):
        mla(torch.randn(1, 3, 16), kv_cache=ssm.LatentCache(1, 8, 7, 2, dtype=torch.float32))


@pytest.mark.parametrize("checked", [True, False])
def test_appending_past_the_capacity_is_refused_with_the_numbers_checked_or_not(checked: bool) -> None:
    mla = ssm.LatentAttention(16, 4, **_FREE)
    cache = mla.new_cache(1, 4)
    mla(torch.randn(1, 3, 16), kv_cache=cache)
    refused = (
        r"^LatentAttention.forward\(\): appending new=2 positions to the 3 in kv_cache would exceed its capacity=4; "
        r"make a larger cache or reset\(\) this one\."
    )
    with contextlib.nullcontext() if checked else ssm.unchecked(), pytest.raises(ssm.ShapeError, match=refused):
        mla(torch.randn(1, 2, 16), kv_cache=cache)
    assert len(cache) == 3


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_a_padding_mask_that_is_not_bool_is_refused_after_a_verdict_for_a_bool_one(dtype: torch.dtype) -> None:
    """A float one would be added to the scores unchecked: refused as the first call of its kind is."""
    mla = ssm.LatentAttention(16, 4, **_FREE)
    mla(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    name = str(dtype).removeprefix("torch.").replace("long", "int64")
    with pytest.raises(ssm.ShapeError, match=rf"key_padding_mask has dtype {name}, but it must be bool"):
        mla(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 3, dtype=dtype))


def test_float_positions_are_refused_after_a_verdict_for_integer_ones() -> None:
    """Float positions would rotate unchecked as they are: refused as the first call of their kind is."""
    mla = ssm.LatentAttention(16, 4, **_FREE)
    mla(torch.randn(1, 3, 16), positions=torch.arange(3)[None])
    with pytest.raises(ssm.ShapeError, match=r"positions has dtype float32, but it must be int"):
        mla(torch.randn(1, 3, 16), positions=torch.arange(3.0)[None])


def test_a_trace_begins_with_the_query_and_its_named_shape() -> None:
    from shapesafe_mha._core.trace import tracing

    mla = ssm.LatentAttention(16, 4, **_FREE)
    with tracing() as tracer:
        mla(torch.randn(1, 3, 16))
    first = tracer.stages[0]
    assert (first.name, first.named_shape) == ("query", "batch seq d_model")


def test_a_look_alike_cache_is_refused_after_verdicts_for_a_real_one() -> None:
    """An object with a LatentCache's buffer, d_rope and length, but no LatentCache: a ShapeError naming the kind,
    even once calls with a real cache of that buffer are remembered."""
    mla = ssm.LatentAttention(16, 4, **_FREE)
    real = mla.new_cache(1, 8)
    mla(torch.randn(1, 3, 16), kv_cache=real)

    class LookAlike:
        buffer, d_rope = real.buffer.detach().clone(), real.d_rope

        def __len__(self) -> int:
            return 3

    with pytest.raises(ssm.ShapeError, match=r"kv_cache must be a shapesafe_mha\.LatentCache"):
        mla(torch.randn(1, 3, 16), kv_cache=LookAlike())  # type: ignore[arg-type]


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
    with pytest.raises(ssm.ConfigError, match=r"^LatentAttention\.from_hf\(\): scaling=0.316.*the config makes it"):
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


def test_from_hf_verify_false_skips_the_probe() -> None:
    """A layer whose output a hook doubles computes otherwise than its weights say: refused verified, converted
    (from the weights) with verify=False."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_hidden_layers=1,
    )  # fmt: skip
    layer = DeepseekV3Attention(config, layer_idx=0)
    layer.register_forward_hook(lambda _module, _args, out: (out[0] * 2, *out[1:]))
    with pytest.raises(ssm.ConfigError, match="differs from DeepseekV3Attention"):
        ssm.LatentAttention.from_hf(layer)
    ours = ssm.LatentAttention.from_hf(layer, verify=False)
    torch.testing.assert_close(ours.kv_b_proj.weight, layer.kv_b_proj.weight)

