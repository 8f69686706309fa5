"""`replace_attention`: our checked layers in a transformers model's place generate what the model generates.

Tiny causal LMs built from their configs (random weights, float64, no downloads), each against an
untouched copy of itself: logits, a left-padded batch, greedy and 2-beam `generate()` tokens (beam search
reorders transformers' own Cache, which the replaced layers read and write), training gradients. What
is left is named with why; a failure names the module path and the dimension.
"""

import copy
from typing import Any

import pytest
import torch
from torch import nn

import shapesafe_mha as ssm

transformers = pytest.importorskip("transformers")
from test_hf_models import SIZES, _batch  # noqa: E402  (the same tiny models and batch)

import shapesafe_mha.hf  # noqa: E402

# architecture: (config class, extra config, the model's attn_implementation, dtype, logits tolerance)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str, torch.dtype, float]] = {
    "llama": ("LlamaConfig", {}, "sdpa", torch.float64, 1e-10),
    "qwen2": ("Qwen2Config", {}, "sdpa", torch.float64, 1e-10),
    "qwen2 (layer 1 sliding, window 3)": (
        "Qwen2Config", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}, "sdpa",
        torch.float64, 1e-10,
    ),
    "mistral (sliding window 3)": ("MistralConfig", {"sliding_window": 3}, "sdpa", torch.float64, 1e-10),
    # transformers' RMSNorm (QK-norm here) computes in float32 inside
    "qwen3 (QK-norm)": ("Qwen3Config", {}, "sdpa", torch.float64, 1e-6),
    # partial rotary, with Phi's output projection named dense
    "phi (partial rotary)": ("PhiConfig", {}, "sdpa", torch.float64, 1e-10),
    # interleaved RoPE, computed in float32 inside by transformers' Cohere
    "cohere (interleaved RoPE)": ("CohereConfig", {}, "sdpa", torch.float64, 1e-6),
    "glm (partial, interleaved RoPE)": ("GlmConfig", {}, "sdpa", torch.float64, 1e-10),
    # dynamic RoPE: the prompts (9) within max_position_embeddings, the generations past it (each step rescaled)
    "llama (dynamic RoPE past 12 positions)": (
        "LlamaConfig", {"max_position_embeddings": 12, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                           "rope_theta": 10000.0}},
        "sdpa", torch.float64, 1e-10,
    ),
    # Cohere's use_qk_norm (a LayerNorm of each head, its weights adopted) computed in float32 inside
    "cohere (use_qk_norm of each head)": ("CohereConfig", {"use_qk_norm": True}, "sdpa", torch.float64, 1e-6),
    # QK-norm over every head (OLMo-2), of 1 + weight with sliding layers (Gemma 3): RMSNorms in float32 inside
    "olmo2 (QK-norm over every head)": ("Olmo2Config", {}, "sdpa", torch.float64, 1e-6),
    "gemma3 (1 + weight QK-norm, window 3)": ("Gemma3TextConfig", {"sliding_window": 3}, "sdpa", torch.float64, 1e-6),
    # the QK-norm after RoPE (HunYuan's query_layernorm, adopted): its RMSNorm in float32 inside
    "hunyuan (QK-norm after RoPE)": ("HunYuanDenseV1Config", {}, "sdpa", torch.float64, 1e-6),
    # eager's additive masks: its float64 padding rows are NaN in transformers itself, so float32
    "gemma2 (eager: softcap, window 3)": (
        "Gemma2Config", {"sliding_window": 3, "attn_logit_softcapping": 5.0}, "eager", torch.float32, 1e-5,
    ),
    # Llama 4: a chunked rope layer (chunks of 3, its weightless QK-norm after RoPE) and a NoPE layer with its
    # temperature tuning (a floor scale the prompt crosses); RoPE and the L2 norm in float32 inside
    "llama4 (chunks of 3, a tuned NoPE layer)": (
        "Llama4TextConfig", {"attention_chunk_size": 3, "no_rope_layers": [1, 0], "attn_temperature_tuning": True,
                             "floor_scale": 3, "attn_scale": 0.4, "intermediate_size_mlp": 64, "moe_layers": [],
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        "sdpa", torch.float64, 1e-6,
    ),
    # attention sinks (the model's own parameter, adopted), YaRN, a sliding layer 0; gpt-oss has no sdpa
    "gpt_oss (eager: sinks, window 3)": (
        "GptOssConfig", {"sliding_window": 3, "num_local_experts": 4, "num_experts_per_tok": 2}, "eager",
        torch.float32, 1e-5,
    ),
    # differential attention (DiffLlama): two maps of each head pair subtracted, its lambdas adopted
    "diffllama (differential attention)": ("DiffLlamaConfig", {}, "sdpa", torch.float64, 1e-10),
}  # fmt: skip


def _built(architecture: str) -> tuple[Any, Any]:
    """The model as built, and a copy of it (attention not replaced yet)."""
    config_name, options, implementation, dtype, _ = ARCHITECTURES[architecture]
    config = getattr(transformers, config_name)(**SIZES, **options)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=dtype)
    with torch.no_grad():  # gpt-oss's sinks start near 0; logits of the scores' size take a share of each row
        for module in theirs.modules():
            if isinstance(getattr(module, "sinks", None), nn.Parameter):
                module.sinks.normal_(0, 1)
    return theirs, copy.deepcopy(theirs.eval())


def _pair(architecture: str) -> tuple[Any, Any, shapesafe_mha.hf.Replacements]:
    """The model as built, and a copy of it with its attention replaced."""
    theirs, ours = _built(architecture)
    return theirs, ours, shapesafe_mha.hf.replace_attention(ours)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_replaced_layers_generate_the_models_own_tokens_greedy_and_beam(architecture: str) -> None:
    theirs, ours, done = _pair(architecture)
    assert list(done.replaced) == ["model.layers.0.self_attn", "model.layers.1.self_attn"] and not done.left
    assert all(isinstance(layer.self_attn, shapesafe_mha.hf.HFAttention) for layer in ours.model.layers)
    ids, mask = _batch()
    tolerance = ARCHITECTURES[architecture][4]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=tolerance, rtol=0)
        padded = (ours(ids, attention_mask=mask).logits - theirs(ids, attention_mask=mask).logits)[mask.bool()]
        assert float(padded.abs().max()) <= tolerance
        for options in ({}, {"num_beams": 2}):
            expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **options)
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **options)
            assert torch.equal(got, expected), options


@pytest.mark.parametrize(
    "architecture", ["llama", "gpt_oss (eager: sinks, window 3)", "diffllama (differential attention)"]
)
def test_the_model_keeps_its_parameters_and_trains_to_the_same_gradients(architecture: str) -> None:
    """The replaced model holds the model's own parameters (gpt-oss's sinks, DiffLlama's lambdas too) and trains
    them to the gradients the model gives them."""
    theirs, ours = _built(architecture)
    before = {name: p for name, p in ours.named_parameters()}
    assert shapesafe_mha.hf.replace_attention(ours).replaced
    assert list(ours.state_dict()) == list(theirs.state_dict())  # checkpoints load either way
    tolerance = ARCHITECTURES[architecture][4]
    ids, mask = _batch()
    losses = []
    for model in (theirs, ours):
        model.train()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=tolerance, rtol=0)
    for (name, mine), (_, other) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert mine is before[name], name  # the model's own tensors, not copies
        torch.testing.assert_close(mine.grad, other.grad, atol=tolerance, rtol=1e-4 if tolerance > 1e-8 else 1e-8,
                                   msg=name)  # fmt: skip


def test_torch_compile_of_the_replaced_model_equals_it_eager() -> None:
    _, ours, _ = _pair("llama")
    ids, mask = _batch()
    with torch.no_grad():
        compiled = torch.compile(ours, backend="eager")
        torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)


def test_a_hooked_and_an_unsupported_layer_are_left_and_named_with_why() -> None:
    config = transformers.LlamaConfig(**{**SIZES, "num_hidden_layers": 3})
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    ours = copy.deepcopy(theirs.eval())
    ours.model.layers[0].self_attn.register_forward_hook(lambda *_: None)
    theirs.model.layers[2].self_attn.scaling = ours.model.layers[2].self_attn.scaling = 0.25  # not 1/sqrt(head_dim)
    done = shapesafe_mha.hf.replace_attention(ours)
    assert list(done.replaced) == ["model.layers.1.self_attn"]
    assert list(done.left) == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    assert done.left["model.layers.0.self_attn"].startswith("it has hooks (1 forward hook), which the replacement")
    assert done.left["model.layers.2.self_attn"].startswith("MultiHeadAttention.from_hf(): scaling=0.25: only 1/sqrt")
    assert "left model.layers.2.self_attn: MultiHeadAttention.from_hf(): scaling=0.25" in str(done)
    ids, mask = _batch()
    with torch.no_grad():  # the layers left run as they were, beside the replaced one
        for options in ({}, {"num_beams": 2}):
            expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **options)
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **options)
            assert torch.equal(got, expected), options


def test_a_planted_bug_is_named_by_its_module_path_and_the_dimension() -> None:
    """Layer 1's key projection built for 3 KV heads, the config says 2: the replaced layer says which."""
    _, ours, _ = _pair("llama")
    attention = ours.model.layers[1].self_attn
    attention.k_proj = nn.Linear(32, 3 * 8, bias=False, dtype=torch.float64)
    ids, _mask = _batch()
    with pytest.raises(ssm.ShapeError) as caught:
        ours(ids, labels=ids)  # training-style call: the projections run separately
    first = str(caught.value).splitlines()[0]
    assert first.startswith("model.layers.1.self_attn (HFAttention, layer_idx=1): MultiHeadAttention.forward(): ")
    assert "num_kv_heads*d_head=24" in first and "num_kv_heads*d_head=16" in first


def test_a_failed_call_leaves_the_models_cache_as_it_was() -> None:
    _, ours, _ = _pair("llama")
    layer = ours.model.layers[0].self_attn
    cache = transformers.DynamicCache(config=ours.config)
    hidden = torch.randn(1, 4, 32, dtype=torch.float64)
    with torch.no_grad():
        layer(hidden, cache=cache, position_ids=torch.arange(4)[None])
        keys = cache.layers[0].keys
        wrong = torch.ones(1, 1, 1, 9, dtype=torch.bool)  # covers 9 keys; the cache holds 4 + 1
        with pytest.raises(ssm.ShapeError, match=r"^model\.layers\.0\.self_attn \(HFAttention, layer_idx=0\): "):
            layer(hidden[:, :1], attention_mask=wrong, cache=cache, position_ids=torch.tensor([[4]]))
    assert cache.get_seq_length(0) == 4 and cache.layers[0].keys is keys


def test_caches_and_masks_it_does_not_read_are_refused_by_name() -> None:
    _, ours, _ = _pair("llama")
    layer = ours.model.layers[0].self_attn
    hidden = torch.randn(1, 4, 32, dtype=torch.float64)
    with pytest.raises(ssm.ConfigError, match=r"passed a 2-D padding mask as attention_mask.*set_attn_implementation"):
        layer(hidden, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    static = transformers.StaticCache(config=ours.config, max_cache_len=8)
    with pytest.raises(ssm.ConfigError, match=r"the cache's layer 0 is a StaticLayer; a replaced layer reads"):
        layer(hidden, cache=static, position_ids=torch.arange(4)[None])
    with pytest.raises(ssm.ConfigError, match=r"transformers passed position_bias=a tensor \(1, 4, 4, 4\)"):
        layer(hidden, position_bias=torch.zeros(1, 4, 4, 4))


def test_the_replaced_layers_share_one_rotary_embedding_whose_tables_follow_the_positions() -> None:
    """The layers of one forward rotate by the same positions: one table for all of them, recomputed for
    another positions tensor, for one changed in place, and for another dtype."""
    _, ours, _ = _pair("llama")
    rotary = ours.model.layers[0].self_attn.rotary
    assert type(rotary).__name__ == "SharedRotary" and rotary is ours.model.layers[1].self_attn.rotary
    positions = torch.arange(5)[None]
    first = rotary(positions, torch.float64)
    assert rotary(positions, torch.float64) is first
    positions.add_(3)  # in place: another version
    moved = rotary(positions, torch.float64)
    expected = ssm.RotaryEmbedding(8, 10000.0)(torch.arange(3, 8)[None], torch.float64)
    torch.testing.assert_close(moved, expected, atol=0, rtol=0)
    assert rotary(positions, torch.float32)[0].dtype == torch.float32
    assert rotary(positions.clone(), torch.float64) is not moved


def test_a_float32_layer_that_differs_by_less_than_float32s_tolerance_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama whose RoPE scales its queries by 1.03 differs from ours by about 4e-6 at its init's weights: under
    the probe's float32 tolerance, so the conversion is verified on a float64 copy, which tells them apart."""
    from transformers.models.llama import modeling_llama

    honest = modeling_llama.apply_rotary_pos_emb

    def slightly_off(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        q, k = honest(q, k, *args, **kwargs)
        return q * 1.03, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", slightly_off)
    config = transformers.LlamaConfig(**SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    done = shapesafe_mha.hf.replace_attention(model)
    assert not done.replaced and list(done.left) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "the converted layer differs from LlamaAttention by" in done.left["model.layers.0.self_attn"]
    assert all(param.dtype == torch.float32 for param in model.parameters())  # the copy was the probe's
    with torch.no_grad():  # in float32 itself the difference is under the probe's tolerance
        assert ssm.MultiHeadAttention.from_hf(model.model.layers[0].self_attn).rope_theta is not None


def test_a_per_head_fused_layer_is_left_named_with_why() -> None:
    """GPT-NeoX converts with from_hf, but its q/k/v would be copies of its fused query_key_value: a replacement
    would not train the model's own parameters, so the layer is left, and why is said."""
    config = transformers.GPTNeoXConfig(**SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    done = shapesafe_mha.hf.replace_attention(model)
    assert not done.replaced and list(done.left) == ["gpt_neox.layers.0.attention", "gpt_neox.layers.1.attention"]
    assert "query_key_value fuses each head's query, key and value rows" in done.left["gpt_neox.layers.0.attention"]
    assert ssm.MultiHeadAttention.from_hf(model.gpt_neox.layers[0].attention).rope_dim == 2


@pytest.mark.parametrize("config_name", ["GPTJConfig", "CodeGenConfig"])
def test_gptj_is_replaced_and_codegens_blocks_are_left_both_generating_their_own_tokens(config_name: str) -> None:
    """GPT-J's layers (RoPE of rotary_dim features, out_proj) are replaced, and the model computes and generates
    as it did; CodeGen's, whose qkv_proj fuses blocks of [q; v; k], are left, named with why."""
    sizes = {k: SIZES[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                                   "pad_token_id", "eos_token_id", "bos_token_id")}  # fmt: skip
    config = getattr(transformers, config_name)(**sizes, rotary_dim=4)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    ours = copy.deepcopy(theirs.eval())
    done = shapesafe_mha.hf.replace_attention(ours)
    paths = ["transformer.h.0.attn", "transformer.h.1.attn"]
    if config_name == "GPTJConfig":
        assert list(done.replaced) == paths and not done.left
        assert isinstance(ours.transformer.h[0].attn, shapesafe_mha.hf.HFAttention)
    else:
        assert not done.replaced and list(done.left) == paths
        assert "qkv_proj fuses blocks of query, value and key rows (CodeGen's)" in done.left[paths[0]]
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-10, rtol=0)
        for options in ({}, {"num_beams": 2}):
            expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **options)
            got = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **options)
            assert torch.equal(got, expected), options


@pytest.mark.parametrize(("config_name", "options"), [("GPTBigCodeConfig", {"multi_query": True, "resid_pdrop": 0.0}),
                                                       ("FalconConfig", {"new_decoder_architecture": True,
                                                                         "num_kv_heads": 2}),
                                                       ("Phi3Config", {"num_key_value_heads": 2,
                                                                       "pad_token_id": 0})])  # fmt: skip
def test_a_multi_query_or_grouped_fused_layer_is_left_named_with_why(config_name: str, options: dict[str, Any]) -> None:
    """GPTBigCode's multi-query c_attn, Falcon-40B's grouped query_key_value and Phi-3's stacked qkv_proj convert
    with from_hf, as copies of the fused weight: a replacement would not train the model's own parameters, so the
    layers are left, named."""
    sizes = {k: SIZES[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")}
    config = getattr(transformers, config_name)(**sizes, **options)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float64)
    done = shapesafe_mha.hf.replace_attention(model)
    assert not done.replaced and len(done.left) == 2
    assert all("the query rows beside the keys' and values'" in why for why in done.left.values())
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    assert ssm.MultiHeadAttention.from_hf(layer).num_kv_heads == (1 if "multi_query" in options else 2)


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if "window" in a])
@pytest.mark.parametrize("window", [2, 5])
def test_replaced_layers_follow_a_window_their_models_config_changes_after_the_replacement(
    architecture: str, window: int
) -> None:
    """transformers builds its masks and sliding caches from `config.sliding_window` at each call: the replaced
    layers read it then too, and the model computes what the unreplaced one computes with the same change."""
    theirs, ours, _ = _pair(architecture)
    for model in (theirs, ours):
        model.config.sliding_window = window
        text = getattr(model.config, "text_config", None)
        if text is not None and text is not model.config:
            text.sliding_window = window
    ids, mask = _batch()
    tolerance = ARCHITECTURES[architecture][4]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=tolerance, rtol=0)
        expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), expected)
