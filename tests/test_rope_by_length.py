"""RoPE scaled by the length of each call ("dynamic" NTK, Phi-3's "longrope") against transformers' own classes.

Its tables are transformers' bit for bit; a Llama layer with dynamic RoPE and a Phi-3 layer with LongRoPE load
with `from_hf` and compute what they compute in float64, a one-shot forward and decoding step by step through a
`DynamicCache`, which differ from each other once the sequence passes the length the scaling turns at (the cached
keys keep the rotation of the call that wrote them); a bug planted in either scaling is refused by the probe of
`from_hf`, which names the output it differed in.
"""

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute import rotary as rotary_module
from shapesafe_mha.reference import per_head_attention

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding  # noqa: E402

SEQ, PREFILL = 11, 3
SHORT, LONG = [1.0, 1.1, 1.3, 1.7], [1.5, 2.5, 3.5, 4.5]


def _phi3(context: int = 6, implementation: str = "sdpa", **extra: Any) -> Any:
    """Phi-3-mini-128k's layout in small: LongRoPE past `context` positions, `factor` from the two lengths."""
    parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG, **extra}
    return transformers.Phi3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16 * context,
        original_max_position_embeddings=context, rope_parameters=parameters, attn_implementation=implementation,
    )  # fmt: skip


def _llama(context: int = 6, implementation: str = "sdpa") -> Any:
    return transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
        attn_implementation=implementation,
    )  # fmt: skip


CASES = {"phi3-longrope": (_phi3, Phi3Attention, Phi3RotaryEmbedding),
         "llama-dynamic": (_llama, LlamaAttention, LlamaRotaryEmbedding)}  # fmt: skip


def _layer(case: str, implementation: str = "sdpa", context: int = 6) -> tuple[Any, Any]:
    make, attention_cls, rotary_cls = CASES[case]
    torch.manual_seed(0)
    layer = attention_cls(make(context, implementation), layer_idx=0).to(torch.float64).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.6, 0.6)
    return layer, rotary_cls


def _hf_run(layer: Any, rotary: Any, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`layer` as its model runs it: chunks of `sizes` positions through one `DynamicCache`, one rotary class for
    all of them (its dynamic update keeps state between calls, as a model's does), transformers' causal mask."""
    cache = DynamicCache(config=layer.config) if len(sizes) > 1 else None
    pieces, done = [], 0
    for size in sizes:
        chunk = x[:, done : done + size]
        positions = torch.arange(done, done + size).expand(x.shape[0], -1)
        mask = create_causal_mask(config=layer.config, inputs_embeds=chunk, attention_mask=None, cache=cache,
                                  position_ids=positions)  # fmt: skip
        pieces.append(layer(chunk, position_embeddings=rotary(chunk, positions), attention_mask=mask, cache=cache)[0])
        done += size
    return torch.cat(pieces, dim=1)


def _our_decoding(ours: Any, x: torch.Tensor) -> torch.Tensor:
    cache = ours.new_cache(batch=x.shape[0], capacity=SEQ)
    steps = [ours(x[:, :PREFILL], is_causal=True, kv_cache=cache)]
    steps += [ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(PREFILL, SEQ)]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("length", [1, 5, 6, 7, 12, 100])
@pytest.mark.parametrize("case", CASES)
def test_tables_by_length_equal_transformers_bit_for_bit(case: str, length: int) -> None:
    """The cos/sin tables of a call `length` long, below, at and past the length it turns at (6), are those of
    the model's rotary class after its dynamic update (a fresh one: its first call), and the frequencies those of
    transformers' own ROPE_INIT_FUNCTIONS at that length; LongRoPE's attention factor is its own."""
    layer, rotary_cls = _layer(case)
    ours = ssm.MultiHeadAttention.from_hf(layer).rotary
    assert ours is not None
    positions = torch.arange(length)[None]
    x = torch.zeros(1, length, 32, dtype=torch.float64)
    for got, want in zip(ours(positions, torch.float64), rotary_cls(layer.config)(x, positions), strict=True):
        assert torch.equal(got, want)
    kind = layer.config.rope_parameters["rope_type"]
    frequencies, factor = ROPE_INIT_FUNCTIONS[kind](layer.config, "cpu", seq_len=torch.tensor(length))
    found = ssm.long_frequencies(ours.d_head, ours.theta, ours.scaling or {}, torch.tensor(length))
    assert torch.equal(found, frequencies) and ours.attention_factor == factor


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_from_hf_equals_the_layer_one_shot_and_decoding_as_its_model_decodes(case: str, implementation: str) -> None:
    """float64: our one-shot causal forward equals the layer's, and our decoding (a prefill of 3, then one token at
    a time through our cache) equals the layer's through a DynamicCache, 1e-10 under sdpa (measured ~1e-14), 1e-5
    under eager (its softmax in float32). The two differ from each other by far more (the sequence passes the
    length, 6, where the scaling turns): decoding is not checked against the one-shot forward here."""
    layer, rotary_cls = _layer(case, implementation)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    tol = {"atol": 1e-10, "rtol": 1e-8} if implementation == "sdpa" else {"atol": 1e-5, "rtol": 1e-5}
    x = torch.randn(2, SEQ, 32, dtype=torch.float64)
    with torch.no_grad():
        one_shot = _hf_run(layer, rotary_cls(layer.config), x, [SEQ])
        decoded = _hf_run(layer, rotary_cls(layer.config), x, [PREFILL] + [1] * (SEQ - PREFILL))
        torch.testing.assert_close(ours(x, is_causal=True), one_shot, **tol)
        torch.testing.assert_close(_our_decoding(ours, x), decoded, **tol)
    assert float((one_shot - decoded).abs().max()) > 0.1


@pytest.mark.parametrize("case", CASES)
def test_decoding_equals_the_reference_turning_each_key_by_its_calls_frequencies(case: str) -> None:
    """The per-head reference computes it too: each decoding step's query by the frequencies of its call's length,
    each cached key by those of the call that wrote it (`key_rope_frequencies`, one row a position)."""
    layer, _ = _layer(case)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    rotary = ours.rotary
    assert rotary is not None and rotary.scaling is not None
    x = torch.randn(2, SEQ, 32, dtype=torch.float64)

    def frequencies(length: int) -> torch.Tensor:
        return ssm.long_frequencies(rotary.d_head, rotary.theta, rotary.scaling or {}, length)

    written = [frequencies(PREFILL)] * PREFILL + [frequencies(n + 1) for n in range(PREFILL, SEQ)]
    keys = (torch.stack(written)[None], rotary.attention_factor)
    queries = (torch.stack(written)[None], rotary.attention_factor)  # a query is turned by its own call's too
    with torch.no_grad():
        expected = per_head_attention(
            x,
            x,
            x,
            ours.weights(),
            num_heads=4,
            num_kv_heads=2,
            is_causal=True,
            rope_theta=rotary.theta,
            rope_frequencies=queries,
            key_rope_frequencies=keys,
        )
        torch.testing.assert_close(_our_decoding(ours, x), expected, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("case", CASES)
def test_to_hf_round_trips_rope_scaled_by_length_and_refuses_another_context(case: str) -> None:
    layer, rotary_cls = _layer(case)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    back = ours.to_hf(layer.config).to(torch.float64).eval()
    x = torch.randn(2, SEQ, 32, dtype=torch.float64)
    sizes = [PREFILL] + [1] * (SEQ - PREFILL)
    with torch.no_grad():
        torch.testing.assert_close(_hf_run(back, rotary_cls(layer.config), x, sizes),
                                   _hf_run(layer, rotary_cls(layer.config), x, sizes), atol=1e-12, rtol=0)  # fmt: skip
    other = CASES[case][0](7)
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters \(scaling\)="):
        ours.to_hf(other)


def test_to_hf_of_dynamic_rope_reads_the_config_s_length_and_ignores_an_original_one() -> None:
    """Dynamic NTK turns past the config's max_position_embeddings; an original_max_position_embeddings beside it
    in rope_parameters (which transformers' dynamic ignores) is no part of the scaling compared, so a module of
    the config's length goes into it (and computes what the layer computes: verified)."""
    parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0, "original_max_position_embeddings": 4}
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=6,
        rope_parameters=parameters,
    )  # fmt: skip
    scaling = {"rope_type": "dynamic", "factor": 3.0, "max_position_embeddings": 6}
    ours = ssm.MultiHeadAttention(32, 4, 2, bias=False, rope_theta=1e4, rope_scaling=scaling, dtype=torch.float64)
    assert isinstance(ours.to_hf(config), LlamaAttention)


def test_a_sliding_window_layer_with_dynamic_rope_is_probed_past_the_turn() -> None:
    """Mistral with a window of 3 and dynamic NTK turning past 6 positions: the second probe, its positions shifted
    to the turn, runs ours through a cache that keeps every position (as the first does), and the layer converts."""
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = transformers.MistralConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, sliding_window=3, max_position_embeddings=6,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 3.0},
    )  # fmt: skip
    ours = ssm.MultiHeadAttention.from_hf(MistralAttention(config, layer_idx=0).to(torch.float64))
    assert (ours.window, ours.rotary.context) == (3, 6)


def _short_only(d_head: int, theta: float, scaling: Any, length: Any, **held: Any) -> torch.Tensor:
    """Bug: the frequencies never turn (LongRoPE's short factors, dynamic's unscaled ones, at every length)."""
    return rotary_module.inverse_frequencies(d_head, theta, scaling)


def _by_new_positions(self: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Bug: the length of a call read as its number of new positions, not `max(positions) + 1` (a decoding step
    of one token is then never past the length it turns at)."""
    length = torch.tensor(positions.shape[-1])
    inv_freq = rotary_module.long_frequencies(self.d_head, self.theta, self.scaling, length)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)


@pytest.mark.parametrize("context", [5, 4096])
@pytest.mark.parametrize("case", CASES)
def test_frequencies_that_never_turn_are_refused_by_the_probe_in_its_decoding_step(
    case: str, context: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted bug: the frequencies of the short regime at every length. The probe of from_hf refuses it in the
    decoding step that passes the length: the plain probe's where that length is its prompt's, 5, a second
    probe's, rotated from `context - 5` on, where it is Phi-3-mini-128k's 4096."""
    layer, _ = _layer(case, context=context)
    monkeypatch.setattr(rotary_module, "long_frequencies", _short_only)
    where = "a decoding step" + (f" at {context}" if context > 5 else "")
    with pytest.raises(ssm.ConfigError, match=rf"differs from {type(layer).__name__} by .* in {where} \(probe"):
        ssm.MultiHeadAttention.from_hf(layer)


@pytest.mark.parametrize("case", CASES)
def test_a_length_read_from_the_new_positions_is_refused_in_the_decoding_step(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer, _ = _layer(case, context=5)
    monkeypatch.setattr(ssm.RotaryEmbedding, "forward", _by_new_positions)
    with pytest.raises(ssm.ConfigError, match=r"in a decoding step \(probe"):
        ssm.MultiHeadAttention.from_hf(layer)


def test_longrope_without_its_attention_factor_is_refused_in_the_causal_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer, _ = _layer("phi3-longrope")
    monkeypatch.setattr(rotary_module, "attention_factor", lambda scaling=None: 1.0)
    with pytest.raises(ssm.ConfigError, match=r"differs from Phi3Attention by .* in a causal forward \(probe"):
        ssm.MultiHeadAttention.from_hf(layer)


def test_a_given_factor_or_attention_factor_is_transformers_own() -> None:
    """LongRoPE's attention factor: given; else from `factor` (given, or max / original lengths); 1 at factor 1."""
    for extra in ({"attention_factor": 1.7}, {"factor": 2.0}, {"factor": 1.0}, {}):
        layer = Phi3Attention(_phi3(6, **extra), layer_idx=0)
        ours = ssm.MultiHeadAttention.from_hf(layer).rotary
        assert ours is not None
        assert ours.attention_factor == ROPE_INIT_FUNCTIONS["longrope"](layer.config, "cpu")[1], extra


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3],
          "original_max_position_embeddings": 6, "factor": 2.0},
         r"rope_parameters\['long_factor'\] must be a list of d_head/2=4 positive numbers"),
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 6},
         r"rope_parameters\['factor'\] \(or 'attention_factor'\) must be given for rope_type='longrope'"),
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 2.0},
         r"rope_parameters\['original_max_position_embeddings'\] must be a positive finite number"),
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_parameters\['max_position_embeddings'\] must be a positive"),
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 1,
          "factor": 2.0}, r"rope_parameters\['original_max_position_embeddings'\]=1 leaves LongRoPE's attention"),
        ({"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 6.5},
         r"rope_parameters\['max_position_embeddings'\] must be a positive int for rope_type='dynamic'"),
    ],
)  # fmt: skip
def test_a_scaling_by_length_with_a_field_missing_or_wrong_names_it(scaling: dict[str, Any], message: str) -> None:
    with pytest.raises(ssm.ConfigError, match=rf"^RotaryEmbedding\(\): {message}"):
        ssm.MultiHeadAttention(32, 4, rope_theta=1e4, rope_scaling=scaling)


@pytest.mark.parametrize("case", CASES)
def test_the_trace_and_the_proof_hold_past_the_length_where_the_scaling_turns(case: str) -> None:
    """The rotary stages keep their named shapes when the call's length picks the frequencies (12 positions, past
    6), and `prove` holds for every batch and length, prefill and decoding."""
    ours = ssm.MultiHeadAttention.from_hf(_layer(case)[0])
    assert ours.rotary is not None
    config = ssm.TraceConfig(d_model=32, num_heads=4, num_kv_heads=2, seq=12, rope_theta=ours.rotary.theta,
                             rope_scaling=ours.rotary.scaling)  # fmt: skip
    walk = {s.name: s for s in ssm.trace_forward(config).stages}
    assert walk["rotary_q"].named_shape == "batch num_heads seq d_head"
    assert walk["rotary_k"].named_shape == "batch num_kv_heads seq d_head"
    assert ssm.prove(ours, is_causal=True).ok and ssm.prove(ours, is_causal=True, decode=True).ok


@st.composite
def _scalings_by_length(draw: Any, d_rope: int) -> dict[str, Any]:
    """A dynamic or LongRoPE scaling for `d_rope` rotated features, turning within a dozen positions."""
    longrope = draw(st.booleans(), label="longrope")
    context = draw(st.integers(2 if longrope else 1, 10), label="context")  # LongRoPE divides by log(context)
    if longrope:
        factors = st.lists(st.floats(1.0, 8.0), min_size=d_rope // 2, max_size=d_rope // 2)
        return {"rope_type": "longrope", "short_factor": draw(factors, label="short_factor"),
                "long_factor": draw(factors, label="long_factor"), "original_max_position_embeddings": context,
                "factor": draw(st.floats(0.5, 64.0), label="factor")}  # fmt: skip
    return {"rope_type": "dynamic", "factor": draw(st.floats(1.0, 8.0), label="factor"),
            "max_position_embeddings": context}  # fmt: skip


@given(data=st.data())
def test_decoding_by_length_equals_the_reference_for_drawn_sizes_and_scalings(data: st.DataObject) -> None:
    """For drawn heads, widths, a partial rotary part, a scaling by length turning within the sequence and a prefill
    length: our prefill-then-decode through a cache equals the per-head reference turning each query by its call's
    frequencies and each key by the frequencies of the call that wrote it (float64, 1e-10)."""
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    num_heads = num_kv_heads * data.draw(st.integers(1, 3), label="group")
    d_head = data.draw(st.sampled_from([4, 6, 8]), label="d_head")
    d_rope = data.draw(st.sampled_from([w for w in (4, 6, 8) if w <= d_head]), label="rope_dim")
    scaling = data.draw(_scalings_by_length(d_rope), label="scaling")
    seq = data.draw(st.integers(2, 12), label="seq")
    prefill = data.draw(st.integers(1, seq), label="prefill")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    ours = ssm.MultiHeadAttention(16, num_heads, num_kv_heads, d_head=d_head, rope_theta=100.0, rope_scaling=scaling,
                                  rope_dim=d_rope, dtype=torch.float64)  # fmt: skip
    rotary = ours.rotary
    assert rotary is not None
    x = torch.randn(2, seq, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = ours.new_cache(batch=2, capacity=seq)
        steps = [ours(x[:, :prefill], is_causal=True, kv_cache=cache)]
        steps += [ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, seq)]
        lengths = [prefill] * prefill + list(range(prefill + 1, seq + 1))  # each position's call's length
        each = torch.stack([ssm.long_frequencies(d_rope, 100.0, scaling, n) for n in lengths])[None]
        frequencies = (each, rotary.attention_factor)
        expected = per_head_attention(
            x, x, x, ours.weights(), num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=True,
            rope_theta=100.0, rotary_dim=d_rope, rope_frequencies=frequencies, key_rope_frequencies=frequencies,
        )  # fmt: skip
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-10, rtol=1e-8)
