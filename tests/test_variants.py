"""QK-norm, sliding windows, softcapping, a custom query scale, partial rotary and interleaved RoPE: the module
equals the per-head reference, decoding equals one causal forward, and a sliding-window cache keeps only what the
window still sees."""

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import attention_configs, attention_inputs

F64 = {"atol": 1e-10, "rtol": 1e-8}


@st.composite
def variants(draw: Any) -> dict[str, Any]:
    """Options of the variants, each on or off, values small enough to matter at the drawn sizes."""
    return {
        "qk_norm": draw(st.booleans(), label="qk_norm"),
        # "per_head": each head's own weights (Cohere's), with or without its centring
        "qk_norm_over": draw(st.sampled_from(["head", "all", "per_head"]), label="qk_norm_over"),
        "qk_norm_centred": draw(st.booleans(), label="qk_norm_centred"),  # a LayerNorm without bias, per head
        "qk_norm_offset": draw(st.sampled_from([0.0, 1.0]), label="qk_norm_offset"),  # 1.0: Gemma 3's 1 + weight
        "window": draw(st.one_of(st.none(), st.integers(1, 12)), label="window"),
        "logit_softcap": draw(st.one_of(st.none(), st.floats(0.05, 5.0)), label="logit_softcap"),
        "query_pre_attn_scalar": draw(st.one_of(st.none(), st.floats(0.5, 300.0)), label="query_pre_attn_scalar"),
        "attention_sinks": draw(st.booleans(), label="attention_sinks"),
        "alibi": draw(st.booleans(), label="alibi"),  # Bloom's and MPT's position biases, beside RoPE or not
        "qk_norm_after_rope": draw(st.booleans(), label="qk_norm_after_rope"),  # HunYuan, with a per-head norm
        "output_gate": draw(st.booleans(), label="output_gate"),  # Qwen3-Next's, without clip_qkv or an "all" norm
        "clip_qkv": draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="clip_qkv"),  # bounds the projections meet
        # Llama 4's: floor scales the drawn sequences cross, so the factor steps within them
        "temperature_tuning": draw(
            st.one_of(st.none(), st.tuples(st.integers(1, 6), st.floats(0.05, 2.0))), label="temperature_tuning"
        ),
        # Llama 4's chunked attention: chunks shorter than the drawn sequences (not beside a window: refused)
        "chunk_size": draw(st.one_of(st.none(), st.integers(1, 6)), label="chunk_size"),
        # with RoPE: rotate a part of each head (drawn as a share of d_head, rounded to pairs), pairs adjacent
        "rope_share": draw(st.one_of(st.none(), st.floats(0.0, 1.0)), label="rope_share"),
        "rope_interleaved": draw(st.booleans(), label="rope_interleaved"),
    }


def _rope_options(config: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The module's RoPE options of a drawn variant: only where the config has RoPE."""
    if config.rope_theta is None:
        return {}
    share = options.get("rope_share")
    rope_dim = None if share is None else 2 * max(1, round(share * config.d_head / 2))
    return {"rope_dim": rope_dim, "rope_interleaved": options.get("rope_interleaved", False)}


def _centred(options: dict[str, Any]) -> bool:
    """The drawn QK-norm subtracts each head's mean (Cohere's): only a norm of each head can."""
    return options.get("qk_norm_centred", False) and options["qk_norm"] and options["qk_norm_over"] != "all"


def _offset(options: dict[str, Any]) -> float:
    """The drawn QK-norm's scale offset (Gemma 3's 1 + weight): only an RMSNorm with one weight for every head."""
    plain = not _centred(options) and options.get("qk_norm_over") != "per_head"
    return options.get("qk_norm_offset", 0.0) if plain else 0.0


def _after_rope(options: dict[str, Any]) -> bool:
    """The drawn QK-norm comes after RoPE: only a per-head RMSNorm can (HunYuan's)."""
    head = options["qk_norm"] and options["qk_norm_over"] == "head" and not _centred(options)
    return options.get("qk_norm_after_rope", False) and head


def _gated(options: dict[str, Any]) -> bool:
    """The drawn output gate: not beside clip_qkv or a QK-norm over every head, which no model combines."""
    every = options["qk_norm"] and options["qk_norm_over"] == "all"
    return options.get("output_gate", False) and options.get("clip_qkv") is None and not every


def _module_options(options: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in options.items() if k not in ("rope_share", "rope_interleaved")}
    chunk = options.get("chunk_size") if options.get("window") is None else None
    return {**kept, "qk_norm_after_rope": _after_rope(options), "output_gate": _gated(options), "chunk_size": chunk,
            "qk_norm_centred": _centred(options), "qk_norm_offset": _offset(options)}  # fmt: skip


def _module(config: Any, options: dict[str, Any], data: st.DataObject) -> ssm.MultiHeadAttention:
    base = config.module()
    module = ssm.MultiHeadAttention(
        config.d_model,
        config.num_heads,
        config.num_kv_heads,
        d_head=config.d_head,
        bias=config.bias,
        rope_theta=config.rope_theta,
        dtype=torch.float64,
        **_module_options(options),
        **_rope_options(config, options),
    )
    gated = module.output_gate  # its q_proj twice as wide: its own random weights
    module.load_state_dict({k: v for k, v in base.state_dict().items() if not (gated and k.startswith("q_proj"))},
                           strict=False)  # fmt: skip
    if options["qk_norm"]:
        seed = data.draw(st.integers(0, 2**16), label="norm seed")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # learned norm weights, not the ones they start at
            for norm in (module.q_norm, module.k_norm):
                shape = norm.weight.shape  # d_head, every head's features ("all") or (heads, d_head) ("per_head")
                norm.weight.copy_(torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5)
    if options.get("attention_sinks"):
        sinks = data.draw(st.lists(st.floats(-3.0, 3.0), min_size=config.num_heads, max_size=config.num_heads))
        with torch.no_grad():  # logits near the scores' size, where a sink takes a share of each row
            module.sinks.copy_(torch.tensor(sinks, dtype=torch.float64))  # pyright: ignore[reportOptionalMemberAccess]
    return module


def _reference(module: ssm.MultiHeadAttention, x: torch.Tensor, options: dict[str, Any], **kwargs: Any) -> torch.Tensor:
    offset = _offset(options)  # the reference's RMSNorm scales by its weights: offset + weight
    norms = (offset + module.q_norm.weight, offset + module.k_norm.weight) if options["qk_norm"] else None
    scalar = options["query_pre_attn_scalar"]
    return per_head_attention(
        x, x, x, module.weights(), num_heads=module.num_heads, num_kv_heads=module.num_kv_heads,
        rope_theta=module.rope_theta, qk_norm=norms, window=options["window"],
        logit_softcap=options["logit_softcap"], scale=None if scalar is None else scalar**-0.5,
        rotary_dim=module.rope_dim, rope_style="interleaved" if module.rope_interleaved else "half",
        qk_norm_over=options.get("qk_norm_over", "head"), sinks=module.sinks, clip_qkv=options.get("clip_qkv"),
        alibi_slopes=module.alibi_slopes,
        qk_norm_after_rope=_after_rope(options), output_gate=module.gate_weights() if module.output_gate else None,
        qk_norm_centred=_centred(options), temperature_tuning=options.get("temperature_tuning"),
        chunk_size=module.chunk_size, **kwargs,
    )  # fmt: skip


@given(data=st.data(), options=variants())
def test_each_variant_equals_the_per_head_reference(data: st.DataObject, options: dict[str, Any]) -> None:
    """Any mix of QK-norm, window, softcap, query scale, attention sinks, ALiBi, clip_qkv, an output gate,
    temperature tuning and chunked attention, with or without RoPE (full or partial, halves or adjacent pairs),
    causal or not, padded or not, MHA/GQA/MQA: the module (with and without grad, so every path) equals the
    reference, head by head, given each option as a keyword or reading them from the module's config."""
    rope = data.draw(st.booleans(), label="rope")
    config = data.draw(attention_configs(cross=False, max_seq=24, rope=rope), label="config")
    module = _module(config, options, data)
    x = data.draw(attention_inputs(config)).query
    is_causal = data.draw(st.booleans(), label="is_causal")
    padding = None
    if data.draw(st.booleans(), label="padded"):
        padding = torch.rand(config.batch, config.seq) < 0.3
    expected = _reference(module, x, options, is_causal=is_causal, key_padding_mask=padding)
    torch.testing.assert_close(module(x, is_causal=is_causal, key_padding_mask=padding), expected, **F64)
    norms = (module.q_norm.weight, module.k_norm.weight) if options["qk_norm"] else None
    gate = module.gate_weights() if module.output_gate else None
    tensors = {"qk_norm": norms, "sinks": module.sinks, "alibi_slopes": module.alibi_slopes, "output_gate": gate}
    read = per_head_attention(x, x, x, module.weights(), module.config, is_causal=is_causal, key_padding_mask=padding,
                              **tensors)  # fmt: skip
    torch.testing.assert_close(read, expected, **F64)
    with torch.no_grad():
        out, weights = module(x, is_causal=is_causal, key_padding_mask=padding, need_weights=True)
        torch.testing.assert_close(out, expected, **F64)
    if options["window"] is not None:  # no query sees a key window or more positions back
        back = torch.arange(config.seq)[:, None] - torch.arange(config.seq)[None, :]
        assert not weights[..., back >= options["window"]].any()


@given(data=st.data(), options=variants())
def test_decoding_each_variant_equals_one_causal_forward(data: st.DataObject, options: dict[str, Any]) -> None:
    """Prefill in a chunk, then token by token, through a cache as small as the window allows
    (`new_cache(batch, capacity)`, `capacity >= window`): the same outputs as one causal forward."""
    config = data.draw(attention_configs(cross=False, max_seq=30, rope=True), label="config")
    module = _module(config, options, data)
    x = data.draw(attention_inputs(config)).query
    window = options["window"]
    capacity = config.seq if window is None else data.draw(st.integers(window, window + 6), label="capacity")
    cache = module.new_cache(config.batch, capacity)
    prefill = data.draw(st.integers(0, config.seq), label="prefill")
    steps = [module(x[:, :prefill], is_causal=True, kv_cache=cache)]
    steps += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, config.seq)]
    torch.testing.assert_close(torch.cat(steps, dim=1), module(x, is_causal=True), **F64)
    assert len(cache) == config.seq
    if window is not None:
        assert cache.kept <= capacity and cache.keys_buffer.shape[2] == capacity


@given(data=st.data())
def test_padding_mask_over_every_position_seen_is_cut_to_the_window(data: st.DataObject) -> None:
    """Left-padded batched generation with a sliding-window cache: a growing key_padding_mask over every
    position seen gives what one padded causal forward gives."""
    window = data.draw(st.integers(2, 6), label="window")
    config = data.draw(attention_configs(cross=False, max_seq=20, rope=True), label="config")
    options = {"qk_norm": False, "window": window, "logit_softcap": None, "query_pre_attn_scalar": None}
    module = _module(config, options, data)
    x = data.draw(attention_inputs(config)).query
    lengths = [data.draw(st.integers(1, config.seq), label="length") for _ in range(config.batch)]
    padding = torch.arange(config.seq)[None, :] < torch.tensor([config.seq - n for n in lengths])[:, None]
    cache = module.new_cache(config.batch, window)
    steps = [
        module(x[:, i : i + 1], is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : i + 1])
        for i in range(config.seq)
    ]
    full = module(x, is_causal=True, key_padding_mask=padding)
    real = ~padding  # padded queries see nothing real; compare where the query is a token
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], **F64)


def test_a_window_cache_holds_at_most_its_capacity_for_any_length() -> None:
    """1000 decoding steps with window 16 in a cache of 32 positions: 32 positions of memory, len() 1000."""
    module = ssm.MultiHeadAttention(32, 4, 2, window=16, rope_theta=10000.0)
    cache = module.new_cache(1, 32)
    before = cache.nbytes
    with torch.no_grad():
        for _ in range(1000):
            module(torch.randn(1, 1, 32), is_causal=True, kv_cache=cache)
    assert (len(cache), cache.nbytes) == (1000, before)
    assert 15 <= cache.kept <= 32


def test_a_chunk_longer_than_the_window_cache_passes_through() -> None:
    """A 50-token prefill into a window cache of 8: attends like the full forward, keeps the last window - 1."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, 1, window=5, rope_theta=10000.0, dtype=torch.float64)
    x = torch.randn(2, 53, 16, dtype=torch.float64)
    cache = module.new_cache(2, 8)
    out = torch.cat([module(x[:, :50], is_causal=True, kv_cache=cache)] + [
        module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(50, 53)
    ], dim=1)  # fmt: skip
    torch.testing.assert_close(out, module(x, is_causal=True), **F64)
    assert len(cache) == 53


@pytest.mark.parametrize("grad", [True, False])
def test_a_call_failing_after_its_write_slid_the_window_cache_changes_nothing(grad: bool) -> None:
    """Before every step a call fails after writing (an o_proj hook raises), some of them when the write slides the
    full buffer: the steps that follow still decode what one causal forward computes (keys and values restored,
    not only len()), whether the cache is written out of place (autograd) or in place (no_grad)."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, 2, window=4, rope_theta=10000.0, dtype=torch.float64)
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    cache = module.new_cache(2, 6)

    def explode(*_: Any) -> None:
        raise RuntimeError("boom")

    steps = []
    with torch.set_grad_enabled(grad):
        for i in range(14):
            handle = module.o_proj.register_forward_pre_hook(explode)
            with pytest.raises(RuntimeError, match="boom"):
                module(torch.randn(2, 1, 16, dtype=torch.float64), is_causal=True, kv_cache=cache)
            handle.remove()
            assert len(cache) == i
            steps.append(module(x[:, i : i + 1], is_causal=True, kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), module(x, is_causal=True), **F64)


def test_reset_of_a_window_cache_that_slid_starts_over() -> None:
    """After sliding, reset() gives len() == 0, and a new prompt with its own padding mask (over its own positions)
    is accepted and computes what the same prompt computes without a cache."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, 2, window=3, rope_theta=10000.0, dtype=torch.float64)
    cache = module.new_cache(2, 4)
    for _ in range(9):
        module(torch.randn(2, 1, 16, dtype=torch.float64), is_causal=True, kv_cache=cache)
    assert len(cache) == 9 and cache.kept < 9
    cache.reset()
    assert len(cache) == 0
    prompt = torch.randn(2, 4, 16, dtype=torch.float64)
    padding = torch.tensor([[True, False, False, False], [False, False, False, False]])
    out = module(prompt, is_causal=True, kv_cache=cache, key_padding_mask=padding)
    expected = module(prompt, is_causal=True, key_padding_mask=padding)
    torch.testing.assert_close(out, expected, **F64)
    assert len(cache) == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window must be a positive int"),
        ({"window": 2.5}, "window must be a positive int"),
        ({"logit_softcap": -1.0}, "logit softcap must be a finite positive number"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a finite positive number"),
        ({"clip_qkv": 0}, r"\): clip_qkv must be a finite positive number, but got 0\.$"),
        ({"logit_softcap": True}, r"logit softcap must be a finite positive number, but got True\.$"),  # not 1.0
        ({"query_pre_attn_scalar": "8"}, r"query_pre_attn_scalar must be a finite positive number, but got '8'\.$"),
        ({"rope_dim": 2}, r"rope_dim was given, but the module has no rotary embeddings \(rope_theta=None\)"),
        ({"rope_interleaved": True}, r"rope_interleaved was given, but the module has no rotary embeddings"),
        ({"rope_theta": 1e4, "rope_dim": 3}, r"rope_dim=3, but .* an even int in \[2, d_head=4\] \(for example 2\)"),
        ({"rope_theta": 1e4, "rope_dim": 6}, r"rope_dim=6, but the rotary part of a head must be an even int in"),
        ({"rope_theta": 1e4, "rope_dim": 2.0}, r"rope_dim=2.0, but the rotary part"),
        ({"rope_theta": 1e4, "rope_interleaved": 1}, r"rope_interleaved must be True or False, but got 1"),
        (
            {"qk_norm": True, "qk_norm_over": "rows"},
            r"qk_norm_over must be 'head' .*, 'all' .* or 'per_head' .* but got 'rows'",
        ),
        ({"qk_norm_centred": True}, r"qk_norm_centred=True needs qk_norm=True over each head"),
        (
            {"qk_norm": True, "qk_norm_over": "all", "qk_norm_centred": True},
            r"qk_norm_centred=True needs qk_norm=True over each head .* qk_norm_over='all'",
        ),
        (
            {"qk_norm": True, "qk_norm_over": "per_head", "qk_norm_offset": 1.0},
            r"qk_norm_offset=1.0 with qk_norm_centred=False, qk_norm_over='per_head': the scale 1 \+ weight",
        ),
        ({"qk_norm": True, "qk_norm_offset": float("nan")}, r"qk_norm_offset must be a finite number .* got nan"),
        ({"qk_norm": True, "qk_norm_offset": "1"}, r"qk_norm_offset must be a finite number \(Gemma 3: 1.0\)"),
    ],
)
def test_bad_variant_options_are_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ssm.ConfigError, match=message):
        ssm.MultiHeadAttention(16, 4, **kwargs)


def test_a_cache_smaller_than_the_window_is_refused() -> None:
    module = ssm.MultiHeadAttention(16, 4, window=8)
    with pytest.raises(ssm.ConfigError, match=r"capacity=4 is less than window=8"):
        module.new_cache(1, 4)


def test_a_padding_mask_of_the_kept_positions_only_names_seen() -> None:
    """Once the window cache has dropped positions, a mask over the kept ones (not all seen) is a ShapeError."""
    module = ssm.MultiHeadAttention(16, 4, window=3)
    cache = module.new_cache(1, 4)
    for _ in range(6):
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    kept = cache.kept + 1
    with pytest.raises(ssm.ShapeError, match=r"key_padding_mask covers \d+ key positions, but .* has seen 7"):
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache, key_padding_mask=torch.zeros(1, kept).bool())
    assert len(cache) == 6  # unchanged by the failed call


def test_qk_norm_normalises_each_head_before_rope() -> None:
    """With QK-norm and unit weights every head's query has RMS 1 whatever the input's scale."""
    module = ssm.MultiHeadAttention(32, 4, 2, qk_norm=True, norm_eps=0.0, rope_theta=10000.0)
    seen: list[torch.Tensor] = []
    module.q_norm.register_forward_hook(lambda _module, _args, out: seen.append(out))
    module(torch.randn(2, 5, 32) * 1000)
    (q,) = seen
    assert q.shape == (2, 4, 5, 8)  # per head, before RoPE (which would keep the RMS anyway)
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 4, 5), atol=1e-4, rtol=1e-4)


def test_qk_norm_over_every_head_normalises_the_projection_before_the_split() -> None:
    """qk_norm_over="all" (OLMo-2): with unit weights the RMS over every head's features together is 1, not each
    head's; the weights are num_heads * d_head and num_kv_heads * d_head wide; a head-parallel split is refused."""
    module = ssm.MultiHeadAttention(32, 4, 2, qk_norm=True, qk_norm_over="all", norm_eps=0.0, rope_theta=10000.0)
    assert module.q_norm.weight.shape == (32,) and module.k_norm.weight.shape == (16,)
    seen: list[torch.Tensor] = []
    module.q_norm.register_forward_hook(lambda _module, _args, out: seen.append(out))
    module(torch.randn(2, 5, 32) * 1000)
    (q,) = seen
    assert q.shape == (2, 5, 32)  # before the head split
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 5), atol=1e-4, rtol=1e-4)
    assert "qk_norm_over='all'" in repr(module)
    config = ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4, qk_norm=True, qk_norm_over="all", tp=2)
    refusal = (
        r"qk_norm_over='all' normalises every head's features together \(OLMo-2\), so a rank holding some of the heads "
        r"cannot compute it; only a QK-norm of each head \(qk_norm_over='head' or 'per_head'\) is split by heads\."
    )
    with pytest.raises(ssm.ConfigError, match=refusal):
        ssm.trace_forward(config)


@pytest.mark.parametrize("decode", [False, True])
def test_qk_norm_over_every_head_is_proven_for_every_batch_and_seq(decode: bool) -> None:
    module = ssm.MultiHeadAttention(64, 8, 2, qk_norm=True, qk_norm_over="all", rope_theta=1e4)
    proof = ssm.prove(module, is_causal=True, decode=decode)
    assert proof.ok, proof.failures
    rows = {name: (named, symbolic) for name, named, symbolic in proof.stages}
    assert rows["k_norm"] == ("batch new num_kv_heads*d_head", "(batch, 1, 16)" if decode else "(batch, seq, 16)")


def test_a_qk_norm_of_each_head_with_its_own_weights_is_traced_and_proven() -> None:
    """qk_norm_over="per_head", qk_norm_centred (Cohere): HeadNorms of (heads, d_head) weights in the qk_norm stage,
    the keys' at num_kv_heads; with unit weights each head's features have mean 0 and variance 1."""
    module = ssm.MultiHeadAttention(32, 4, 2, qk_norm=True, qk_norm_over="per_head", qk_norm_centred=True,
                                    norm_eps=0.0, rope_theta=1e4)  # fmt: skip
    assert (module.q_norm.weight.shape, module.k_norm.weight.shape) == ((4, 8), (2, 8))
    assert "qk_norm_over='per_head', qk_norm_centred=True" in repr(module)
    q = module.q_norm(torch.randn(2, 4, 5, 8, dtype=torch.float32))
    torch.testing.assert_close(q.mean(-1), torch.zeros(2, 4, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close((q * q).mean(-1), torch.ones(2, 4, 5), atol=1e-4, rtol=0)
    config = ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=4, qk_norm=True, qk_norm_over="per_head",
                             qk_norm_centred=True, rope_theta=1e4)  # fmt: skip
    walk = {s.name: s for s in ssm.trace_forward(config).stages}
    assert walk["k_norm"].named_shape == "batch num_kv_heads new d_head"
    assert ssm.prove(module, is_causal=True).ok and ssm.prove(module, is_causal=True, decode=True).ok


def test_a_qk_norm_offset_of_one_scales_by_one_plus_weight_and_starts_at_a_scale_of_one() -> None:
    """qk_norm_offset=1.0 (Gemma 3): the norms are OffsetRMSNorms whose weights start at 0 (scale 1, as Gemma's
    checkpoints store them) and scale by 1 + weight."""
    module = ssm.MultiHeadAttention(32, 4, 2, qk_norm=True, qk_norm_offset=1.0, norm_eps=0.0, rope_theta=1e4)
    assert torch.equal(module.q_norm.weight, torch.zeros(8)) and "qk_norm_offset=1.0" in repr(module)
    x = torch.randn(3, 8)
    with torch.no_grad():
        module.q_norm.weight.fill_(0.5)
    torch.testing.assert_close(module.q_norm(x), 1.5 * x / x.pow(2).mean(-1, keepdim=True).sqrt())


@pytest.mark.parametrize("attention_sinks", [False, True])
def test_under_autocast_the_weights_are_in_the_dtype_autocast_computes_in(attention_sinks: bool) -> None:
    """A float32 module under bfloat16 autocast returns bfloat16 weights, float32 attention sinks or not: a sink
    takes part in its row's softmax at the scores' precision, like every other logit."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2, attention_sinks=attention_sinks)
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(torch.tensor([0.3, -1.1, 2.7, 0.1234]))
    with torch.autocast("cpu", torch.bfloat16):
        out, weights = module(torch.randn(2, 5, 32), is_causal=True, need_weights=True)
    assert out.dtype == weights.dtype == torch.bfloat16


def test_public_attention_takes_window_and_softcap() -> None:
    """`scaled_dot_product_attention(window=, softcap=)` == the probabilities computed by hand, then @ v."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True, window=3, softcap=2.0)
    scores = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5 / 2.0)
    position = torch.arange(6)[:, None] + 3
    back = position - torch.arange(9)[None, :]
    expected = scores.masked_fill((back < 0) | (back >= 3), float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ssm.ConfigError, match="window must be a positive int"):
        ssm.scaled_dot_product_attention(q, k, v, window=0)


COMPILED_VARIANTS = {
    "qk_norm": {"qk_norm": True},
    "qk_norm over every head": {"qk_norm": True, "qk_norm_over": "all"},
    "qk_norm of 1 + weight": {"qk_norm": True, "qk_norm_offset": 1.0},
    "qk_norm after RoPE": {"qk_norm": True, "qk_norm_after_rope": True},
    "window": {"window": 3},
    "softcap": {"logit_softcap": 2.0, "query_pre_attn_scalar": 5},
    "attention sinks": {"attention_sinks": True},
    "ALiBi": {"alibi": True},
    "clip_qkv": {"clip_qkv": 0.5},
    "output gate": {"output_gate": True},
    "temperature tuning": {"temperature_tuning": (2, 0.5)},
    "chunked attention": {"chunk_size": 3},
    "partial rotary": {"rope_theta": 10000.0, "rope_dim": 4},
    "interleaved RoPE": {"rope_theta": 10000.0, "rope_interleaved": True},
    "partial, interleaved RoPE": {"rope_theta": 10000.0, "rope_dim": 2, "rope_interleaved": True},
}


@pytest.mark.parametrize("options", COMPILED_VARIANTS.values(), ids=list(COMPILED_VARIANTS))
def test_each_variant_compiles_fullgraph_with_no_graph_breaks(options: dict[str, Any]) -> None:
    import torch._dynamo

    module = ssm.MultiHeadAttention(32, 4, 2, **{"rope_theta": 10000.0, **options}).eval()
    x = torch.randn(2, 6, 32)
    explanation = torch._dynamo.explain(lambda t: module(t, is_causal=True))(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(lambda t: module(t, is_causal=True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), module(x, is_causal=True))


def test_latent_attention_compiles_fullgraph_with_no_graph_breaks() -> None:
    import torch._dynamo

    mla = ssm.LatentAttention(32, 4, q_lora_rank=8, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=6).eval()
    x = torch.randn(2, 6, 32)
    explanation = torch._dynamo.explain(lambda t: mla(t, is_causal=True))(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(lambda t: mla(t, is_causal=True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), mla(x, is_causal=True))


@pytest.mark.parametrize("options", COMPILED_VARIANTS.values(), ids=list(COMPILED_VARIANTS))
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_gqa_and_mqa_stay_zero_copy_in_every_variant(options: dict[str, Any], num_kv_heads: int) -> None:
    """No stage ever holds keys or values at num_heads heads: prefill and decoding, every variant."""
    traced = {k: v for k, v in options.items() if k != "query_pre_attn_scalar"}  # a scale changes no shape
    for decode in (None, 12):
        config = ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=num_kv_heads, seq=6, decode=decode, **traced)
        stages = ssm.trace_forward(config).stages
        kv = [s for s in stages if s.name in ("split_k", "split_v", "k_norm", "rotary_k", "cache_k", "cache_v")]
        assert ("rotary_k" in {s.name for s in stages}) == ("rope_theta" in options)
        per_head = [s for s in kv if s.named_shape.startswith("batch num_kv_heads")]
        assert kv and all(s.shape[1] == num_kv_heads for s in per_head)
        # a norm over every head's features sees the keys before the split: num_kv_heads * d_head wide
        assert all(s.shape[-1] == num_kv_heads * 8 for s in kv if s not in per_head)
        assert all(s.allocated_bytes < 8 * 13 * 8 * 2 for s in stages if s.name in ("cache_k", "cache_v"))


def test_a_cache_with_a_narrower_window_than_the_module_is_refused() -> None:
    """A cache that would drop keys the module's window still sees (or any key, for a module without a window)
    is a ShapeError naming kv_cache; a plain cache, or a wider window, is fine."""
    x = torch.randn(1, 1, 32)
    windowed = ssm.MultiHeadAttention(32, 4, 2, window=4)
    with pytest.raises(ssm.ShapeError, match=r"kv_cache keeps a window of 2 positions, but the module attends over a"):
        windowed(x, is_causal=True, kv_cache=ssm.KVCache(1, 2, 6, 8, dtype=torch.float32, window=2))
    with pytest.raises(
        ssm.ShapeError, match=r"kv_cache keeps a window of 4 positions, but the module attends over every"
    ):
        ssm.MultiHeadAttention(32, 4, 2)(
            x, is_causal=True, kv_cache=ssm.KVCache(1, 2, 6, 8, dtype=torch.float32, window=4)
        )
    for fine in (ssm.KVCache(1, 2, 6, 8, dtype=torch.float32), ssm.KVCache(1, 2, 6, 8, dtype=torch.float32, window=6)):
        assert windowed(x, is_causal=True, kv_cache=fine).shape == (1, 1, 32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_softcap": float("inf")}, "logit softcap must be a finite positive number"),
        ({"qk_norm": True, "norm_eps": -1.0}, "norm_eps must be a finite number >= 0"),
        ({"qk_norm": True, "norm_eps": "1e-6"}, "norm_eps must be a finite number >= 0"),
        ({"qk_norm": True, "norm_eps": float("inf")}, "norm_eps must be a finite number >= 0"),
    ],
)
def test_an_infinite_cap_or_a_bad_norm_eps_is_refused(kwargs: dict[str, Any], message: str) -> None:
    """inf * tanh(s / inf) is NaN, and a negative epsilon NaNs the norm: refused when the module is built."""
    with pytest.raises(ssm.ConfigError, match=message):
        ssm.MultiHeadAttention(32, 4, 2, **kwargs)
    with pytest.raises(ssm.ConfigError, match=r"softcap|norm_eps"):
        if "logit_softcap" in kwargs:
            ssm.scaled_dot_product_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                             softcap=float("inf"))  # fmt: skip
        else:
            ssm.LatentAttention(16, 4, kv_lora_rank=6, d_nope=3, d_rope=2, d_value=5, norm_eps=kwargs["norm_eps"])


def test_alibi_weights_a_key_d_positions_back_by_minus_d_times_its_heads_slope() -> None:
    """With queries of zeros every score is its ALiBi bias alone: a head's weights are softmax(-d * slope) over the
    keys d positions back (causal, lower-right aligned, decoding after a prefill included), the slopes Press et al.'s
    2 ** (-8 h / n) for 8 heads; alibi= other than a bool is a ConfigError."""
    module = ssm.MultiHeadAttention(16, 8, 2, alibi=True, dtype=torch.float64)
    assert module.alibi_slopes is not None and "alibi_slopes" in module.state_dict()
    torch.testing.assert_close(module.alibi_slopes, 2.0 ** (-torch.arange(1, 9, dtype=torch.float64)))
    with torch.no_grad():
        module.q_proj.weight.zero_()
        module.q_proj.bias.zero_()  # pyright: ignore[reportOptionalMemberAccess]
        x = torch.randn(1, 5, 16, dtype=torch.float64)
        _, weights = module(x, is_causal=True, need_weights=True)
        cache = module.new_cache(1, 7)
        module(x, is_causal=True, kv_cache=cache)
        _, step = module(torch.randn(1, 2, 16, dtype=torch.float64), is_causal=True, kv_cache=cache, need_weights=True)
    back = torch.arange(5)[:, None] - torch.arange(5)[None, :]
    slopes = module.alibi_slopes[:, None, None]
    expected = (-back * slopes).masked_fill(back < 0, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights[0], expected, **F64)
    back = torch.arange(5, 7)[:, None] - torch.arange(7)[None, :]
    expected = (-back * slopes).masked_fill(back < 0, float("-inf")).softmax(-1)
    torch.testing.assert_close(step[0], expected, **F64)
    with pytest.raises(ssm.ConfigError, match="alibi must be True or False, but got 'yes'"):
        ssm.MultiHeadAttention(16, 8, alibi="yes")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float64])
def test_the_alibi_slopes_are_in_the_modules_dtype(dtype: torch.dtype | None) -> None:
    """The slopes buffer is held in the dtype of the parameters (the default dtype where none is given), as every
    other tensor of the module is: the state dict saves them so, and a checkpoint's slopes load into that dtype."""
    module = ssm.MultiHeadAttention(16, 8, 2, alibi=True, dtype=dtype)
    assert module.alibi_slopes is not None
    assert module.alibi_slopes.dtype == module.q_proj.weight.dtype == (dtype or torch.get_default_dtype())
    assert module.state_dict()["alibi_slopes"].dtype == module.q_proj.weight.dtype


# Each option away from its default, with the options it needs (rope_dim and the pairs need RoPE, the QK-norm's
# options a QK-norm); the repr must show these arguments, as given, and nothing else beyond the sizes.
REPR_OPTIONS: list[dict[str, Any]] = [
    {},
    {"rope_theta": 10000.0},
    {"rope_theta": 500000.0, "rope_dim": 4},
    {"rope_theta": 10000.0, "rope_interleaved": True},
    {"qk_norm": True},
    {"qk_norm": True, "qk_norm_over": "all"},
    {"qk_norm": True, "qk_norm_over": "per_head", "qk_norm_centred": True},
    {"qk_norm": True, "qk_norm_offset": 1.0},
    {"qk_norm": True, "qk_norm_after_rope": True},
    {"window": 3},
    {"logit_softcap": 5.0},
    {"query_pre_attn_scalar": 4.0},
    {"clip_qkv": 2.0},
    {"temperature_tuning": (8192, 0.1)},
    {"chunk_size": 4},
    {"attention_sinks": True},
    {"alibi": True},
    {"output_gate": True},
]


@pytest.mark.parametrize("options", REPR_OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_the_repr_names_the_sizes_and_exactly_the_options_given(options: dict[str, Any], dropout: float) -> None:
    """The first line of the module's repr is its sizes and dropout, then `name=value` for each option given away
    from its default (the value as it was passed) and for no other: a reader can rebuild the module from it."""
    module = ssm.MultiHeadAttention(32, 4, 2, dropout=dropout, **options)
    sizes = f"d_model=32, num_heads=4, num_kv_heads=2, d_head=8, dropout={dropout}"
    assert module.extra_repr() == ", ".join([sizes, *(f"{name}={value!r}" for name, value in options.items())])
    assert repr(module).startswith(f"MultiHeadAttention(\n  {module.extra_repr()}\n")


@pytest.mark.parametrize(
    "idle",
    [{"rope_theta": 10000.0, "rope_dim": 8}, {"qk_norm_offset": 1.0}, {"qk_norm_over": "all"}],
    ids=["rope_dim=d_head", "qk_norm_offset without qk_norm", "qk_norm_over without qk_norm"],
)
def test_an_option_that_changes_nothing_is_not_shown(idle: dict[str, Any]) -> None:
    """rope_dim=d_head is what rope_dim=None means, and a QK-norm's options without a QK-norm do nothing: the repr
    is that of the module without them."""
    given = ssm.MultiHeadAttention(32, 4, 2, **idle)
    plain = ssm.MultiHeadAttention(32, 4, 2, **({"rope_theta": 10000.0} if "rope_theta" in idle else {}))
    assert given.extra_repr() == plain.extra_repr()


def test_gate_weights_of_a_module_without_a_gate_is_a_config_error_saying_so() -> None:
    """Only a gated q_proj holds gate rows; asking an ungated module for them names the method and the option."""
    message = r"^MultiHeadAttention\.gate_weights\(\): this module has no output gate \(output_gate=False\)\.$"
    with pytest.raises(ssm.ConfigError, match=message):
        ssm.MultiHeadAttention(32, 4, 2).gate_weights()


def test_a_gated_module_without_biases_gives_its_query_and_gate_rows_and_no_bias() -> None:
    """bias=False with an output gate: weights() and gate_weights() hand back each head's query rows and gate rows of
    q_proj (interleaved per head in it) with None for their biases, and the module equals the reference given them."""
    module = ssm.MultiHeadAttention(16, 4, 2, bias=False, output_gate=True, dtype=torch.float64)
    rows = module.q_proj.weight.unflatten(0, (4, 2, 4))
    weights, (gate, gate_bias) = module.weights(), module.gate_weights()
    assert weights.b_q is None and gate_bias is None
    assert torch.equal(weights.w_q, rows[:, 0].flatten(0, 1)) and torch.equal(gate, rows[:, 1].flatten(0, 1))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    expected = per_head_attention(x, x, x, weights, num_heads=4, num_kv_heads=2, is_causal=True,
                                  output_gate=(gate, gate_bias))  # fmt: skip
    torch.testing.assert_close(module(x, is_causal=True), expected, **F64)


@pytest.mark.parametrize(
    "options",
    [
        {"qk_norm": True},
        {"window": 2},
        {"logit_softcap": 0.5},
        {"query_pre_attn_scalar": 2.0},
        {"attention_sinks": True},
        {"clip_qkv": 0.1},
        {"output_gate": True},
        {"temperature_tuning": (2, 0.5)},
        {"chunk_size": 2},
    ],
    ids=lambda options: next(iter(options)),
)
def test_a_variant_module_fit_for_torchs_fused_kernel_still_computes_its_variant_without_grad(
    options: dict[str, Any],
) -> None:
    """Biased MHA whose heads tile d_model, in eval, not causal, under no_grad: what torch's fused MHA kernel needs,
    but that kernel computes none of these variants (nor Llama 4's temperature tuning or chunks), so the
    no-grad output is still the grad-mode one."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, bias=True, dtype=torch.float64, **options).eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with_grad = module(x)
    with torch.no_grad():
        without_grad = module(x)
    torch.testing.assert_close(without_grad, with_grad, **F64)


def test_the_reference_given_a_config_refuses_a_keyword_the_config_describes() -> None:
    """An option given both in the config and as a keyword could disagree: the reference names it and computes
    nothing; an option of the config whose tensors start random (the gate's rows) needs them passed."""
    module = ssm.MultiHeadAttention(8, 2, window=2, output_gate=True, dtype=torch.float64)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"per_head_attention\(\): window given with config="):
        per_head_attention(x, x, x, module.weights(), module.config, window=3, output_gate=module.gate_weights())
    with pytest.raises(TypeError, match=r"pass output_gate=module\.gate_weights\(\)"):
        per_head_attention(x, x, x, module.weights(), module.config)
