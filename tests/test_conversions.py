"""Conversions verify themselves: each result equals its source on a probe, or is refused by name.

Every conversion of a real transformers class is compared in float64 with the class itself, called as its
model calls it; what we do not compute is a ConfigError naming the field or the structure behind it, and
what no field names is caught by the probe.
"""

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shapesafe_mha as ssm
from shapesafe_mha._interop import hf as _hf
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import check_attention

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402

SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2}
F64 = {"atol": 1e-10, "rtol": 1e-8}


def _layer(model_type: str, cls_name: str | None = None, **config: Any) -> nn.Module:
    """A real transformers attention layer of `model_type`, float64, with weights drawn far from their init."""
    config_cls = CONFIG_MAPPING[model_type]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    name = cls_name or f"{config_cls.__name__.removesuffix('Config')}Attention"
    torch.manual_seed(0)
    layer = getattr(modeling, name)(config_cls(**{**SIZES, **config}), layer_idx=0).to(torch.float64)
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.4, 0.4)
    return layer.eval()


def _ours_equal_theirs(ours: nn.Module, layer: nn.Module) -> float:
    """The largest difference between `ours` and `layer` (as its model calls it), full forward and decoding."""
    x = torch.randn(2, 7, layer.config.hidden_size, dtype=torch.float64)
    theirs = _hf.hf_outputs(layer, x[:, :6], decode=False)["a causal forward"]
    with torch.no_grad():
        full = ours(x[:, :5], is_causal=True)
        cache = ours.new_cache(2, max(16, getattr(ours, "window", None) or 0))
        steps = [ours(x[:, :3], is_causal=True, kv_cache=cache)]
        steps += [ours(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(3, 5)]
    return max(float((full - theirs).abs().max()), float((torch.cat(steps, 1) - theirs).abs().max()))


# model type, config keywords, what the ConfigError's first line must say
REFUSED = {
    "persimmon qk_layernorm": (
        "persimmon",
        {},
        r"q_layernorm='LayerNorm': the layer holds a submodule with parameters \(LayerNorm\) that",
    ),
    "gptj rotary_dim wider than a head": (
        "gptj", {}, r"rotary_dim=64: the rotated part must be an even number of features in \[2, head_dim=8\]"),
    "olmo clip_qkv of 0": ("olmo", {"clip_qkv": 0.0}, r"config.clip_qkv=0.0: a clip bound must be a positive number"),
    "stablelm qk_layernorm": ("stablelm", {"qk_layernorm": True}, r"q_layernorm='StableLmLayerNormPerHead'"),
    "bitnet attn_sub_norm": ("bitnet", {}, r"attn_sub_norm='BitNetRMSNorm': the layer holds a submodule"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_from_hf_refuses_what_it_would_compute_differently_naming_why(case: str) -> None:
    """Each of these layers converted silently to something else (0.7 to 46 off); now a ConfigError names why."""
    model_type, config, message = REFUSED[case]
    with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention.from_hf\(\): " + message):
        ssm.MultiHeadAttention.from_hf(_layer(model_type, **config))


def _edited(model_type: str, edit: Callable[[nn.Module], Any], **config: Any) -> Callable[[], nn.Module]:
    """A builder of `_layer(model_type, **config)` edited in place by `edit` (a field or a part set otherwise)."""

    def build() -> nn.Module:
        layer = _layer(model_type, **config)
        edit(layer)
        return layer

    return build


def _llama4(layer_idx: int = 3, chunk: int | None = None, **config: Any) -> Callable[[], nn.Module]:
    """A builder of Llama 4's layer `layer_idx` (3: its NoPE layer) with temperature tuning on, chunked by `chunk`
    (the config read after it as `config`, a field set otherwise)."""

    def build() -> nn.Module:
        llama4 = importlib.import_module("transformers.models.llama4.modeling_llama4")
        text = CONFIG_MAPPING["llama4_text"](
            **SIZES | {"num_hidden_layers": 4}, attention_chunk_size=chunk, attn_temperature_tuning=True
        )
        for field, value in config.items():
            setattr(text, field, value)
        return llama4.Llama4TextAttention(text, layer_idx=layer_idx).to(torch.float64)

    return build


_WHY_NORM = (
    "neither each head's d_head=8, every head's together (32) nor each head's with weights of its own, as q_norm does"
)
# what from_hf finds -> its refusal after "MultiHeadAttention.from_hf(): ", pinned whole (field, value and why)
REFUSED_READINGS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "a rotated share over 1": (
        _edited("phi", lambda layer: layer.config.rope_parameters.update(partial_rotary_factor=1.5)),
        "rope_parameters['partial_rotary_factor']=1.5: the rotated share of a head must be a number in (0, 1]",
    ),
    "a rotated share that is a bool": (
        _edited("phi", lambda layer: layer.config.rope_parameters.update(partial_rotary_factor=True)),
        "rope_parameters['partial_rotary_factor']=True: the rotated share of a head must be a number in (0, 1]",
    ),
    "a rotated share of an odd width": (
        _edited("phi", lambda layer: layer.config.rope_parameters.update(partial_rotary_factor=0.375)),
        "rope_parameters['partial_rotary_factor']=0.375: it rotates 3 of head_dim=8 features, not an even number",
    ),
    "a negative attention multiplier": (
        _edited("granite", lambda layer: None, attention_multiplier=-1.0),
        "attention_multiplier=-1.0: only a positive multiplier, alone, is supported",
    ),
    "a scaling of its own": (
        _edited("llama", lambda layer: setattr(layer, "scaling", 0.3)),
        "scaling=0.3: only 1/sqrt(query_pre_attn_scalar or head_dim) = 0.353553 is supported",
    ),
    "a bidirectional layer": (
        _edited("llama", lambda layer: setattr(layer, "is_causal", False)),
        "is_causal=False: only causal (decoder) attention layers are supported",
    ),
    "a QK-norm without an epsilon": (
        _edited("qwen3", lambda layer: delattr(layer.q_norm, "variance_epsilon")),
        "q_norm='Qwen3RMSNorm': a QK-norm without an epsilon is not an RMSNorm we know",
    ),
    "a QK-norm of 5 features": (
        _edited("qwen3", lambda layer: setattr(layer, "q_norm", type(layer.q_norm)(5).double())),
        f"q_norm='Qwen3RMSNorm': it normalises features (5,), {_WHY_NORM}",
    ),
    "a QK-norm without weight": (
        _edited("qwen3", lambda layer: setattr(layer, "q_norm", nn.Identity())),
        f"q_norm='Identity': it normalises features None, {_WHY_NORM}",
    ),
    "sinks of another width than the heads": (
        _edited("gpt_oss", lambda layer: setattr(layer, "sinks", nn.Parameter(torch.zeros(3, dtype=torch.float64)))),
        "sinks=(3,): attention sinks are one logit per query head (4,)",
    ),
    "a parameter of the layer's own": (
        _edited("llama", lambda layer: setattr(layer, "extra", nn.Parameter(torch.zeros(2, dtype=torch.float64)))),
        "parameters=['extra']: the layer holds parameters of its own (attention sinks?) that are not loaded",
    ),
    "temperature tuning with a floor scale of 0": (
        _llama4(floor_scale=0, attn_scale=0.4),
        "config.floor_scale=0: temperature tuning needs a positive int floor_scale",
    ),
    "temperature tuning with an infinite attention scale": (
        _llama4(floor_scale=3, attn_scale=float("inf")),
        "config.attn_scale=inf: temperature tuning needs a finite attn_scale",
    ),
    "a chunked layer of chunks 0 long": (
        _llama4(layer_idx=0, chunk=8, attention_chunk_size=0),
        "config.attention_chunk_size=0: a chunked layer needs a positive int chunk size",
    ),
    "a chunked layer of no chunk size": (
        _llama4(layer_idx=0, chunk=8, attention_chunk_size=None),
        "config.attention_chunk_size=None: a chunked layer needs a positive int chunk size",
    ),
    "an output projection of other sizes than the config's": (
        _edited("llama", lambda layer: setattr(layer, "o_proj", nn.Linear(32, 16, bias=False, dtype=torch.float64))),
        "o_proj.weight=(16, 32): the config's sizes make it (32, 32) (hidden_size=32, num_attention_heads=4, "
        "num_key_value_heads=2, head_dim=8)",
    ),
    "an older config's scaling of another type": (
        _edited("llama", lambda layer: setattr(layer.config, "rope_parameters", {"type": "linear", "factor": 2.0})),
        "rope_parameters['rope_type']='linear': only default, llama3, yarn, dynamic, longrope RoPE is supported",
    ),
    "a rotated share over 1 on the config": (
        _edited("llama", lambda layer: setattr(layer.config, "partial_rotary_factor", 1.5)),
        "partial_rotary_factor=1.5: the rotated share of a head must be a number in (0, 1]",
    ),
    "an older config's rotated share over 1": (
        _edited("llama", lambda layer: setattr(layer.config, "rotary_pct", 1.5)),
        "rotary_pct=1.5: the rotated share of a head must be a number in (0, 1]",
    ),
}


@pytest.mark.parametrize("case", REFUSED_READINGS)
def test_what_from_hf_cannot_read_is_refused_naming_the_field_its_value_and_why(case: str) -> None:
    """The refusal is the user's only lead to what to change: its one line names the field (or the part), the
    value found there and why it is refused, every word of it pinned."""
    build, message = REFUSED_READINGS[case]
    whole = f"MultiHeadAttention.from_hf(): {message}; this layer would compute something else, so it is refused."
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(whole)}$"):
        ssm.MultiHeadAttention.from_hf(build())


def _raising(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError  # an exception without a message


def _raising_why(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a shape it did not expect\non two lines")


def test_a_layer_without_q_proj_or_one_that_fails_to_run_is_refused_saying_what_is_supported_or_why() -> None:
    """A layer whose projections are not nn.Linear is refused listing the layouts that load, a latent one sent to
    LatentAttention.from_hf; one that fails when run as its model runs it (even with an error of no message) is
    refused naming the error and verify=False."""
    layer = _edited("llama", lambda layer: setattr(layer, "q_proj", nn.Identity()))()
    message = (
        "MultiHeadAttention.from_hf(): LlamaAttention has no nn.Linear q_proj; only the q/k/v/o_proj layout (Llama, "
        "Mistral, Qwen2; Phi's dense and GPT-J's out_proj as o_proj), GPT-NeoX's per-head query_key_value, Phi-3's "
        "stacked qkv_proj and CodeGen's qkv_proj in blocks are supported."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        ssm.MultiHeadAttention.from_hf(layer)
    message = (
        "MultiHeadAttention.from_hf(): DeepseekV3Attention is multi-head latent attention (kv_a_proj_with_mqa); load "
        "it with shapesafe_mha.LatentAttention.from_hf(layer)."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        ssm.MultiHeadAttention.from_hf(_layer("deepseek_v3", **LATENT))
    layer = _edited("llama", lambda layer: setattr(layer, "forward", _raising))()
    message = (
        "MultiHeadAttention.from_hf(): LlamaAttention could not be run as its model runs it, to verify the conversion "
        "(RuntimeError: ); pass verify=False to convert it unverified."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        ssm.MultiHeadAttention.from_hf(layer)
    layer = _edited("llama", lambda layer: setattr(layer, "forward", _raising_why))()
    with pytest.raises(ssm.ConfigError, match=re.escape("(RuntimeError: a shape it did not expect); pass verify=")):
        ssm.MultiHeadAttention.from_hf(layer)  # the error's first line


def test_rope_parameters_that_differ_by_layer_type_are_refused_for_a_layer_of_no_known_type() -> None:
    """Gemma 3 keeps a theta per layer type (1e6 full, 1e4 sliding): asked without a layer type, rope_of cannot
    tell which is the layer's, and names both types rather than take either; sets that agree are taken."""
    config = CONFIG_MAPPING["gemma3_text"](**SIZES)
    message = (
        "MultiHeadAttention.from_hf(): rope_parameters=['full_attention', 'sliding_attention']: RoPE parameters differ "
        "by layer type, and the layer's is not known; this layer would compute something else, so it is refused."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        _hf.rope_of(config)
    assert _hf.rope_of(config, "sliding_attention") == (1e4, None)
    shared = {"rope_type": "default", "rope_theta": 5e5}
    config.rope_parameters = {"full_attention": dict(shared), "sliding_attention": dict(shared)}
    assert _hf.rope_of(config) == (5e5, None)  # one set shared by every type: the layer's, whatever its type
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
    config.rope_parameters = {"full_attention": dict(yarn), "sliding_attention": dict(shared)}
    assert _hf.rope_of(config, "full_attention") == (1e6, yarn)  # as the set says: nothing added to compare in to_hf


@pytest.mark.parametrize(
    "model_type, config",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 3}),
        ("gemma2", {}),
        ("granite", {"attention_multiplier": 0.5}),
        ("gpt_oss", {"sliding_window": 3}),  # attention sinks (its own parameter), YaRN, a sliding layer 0
    ],
)
def test_from_hf_verified_layers_equal_their_source_full_and_decoding(model_type: str, config: Any) -> None:
    """What passes the probe equals the transformers layer on other inputs too, decoding included."""
    layer = _layer(model_type, **config)
    assert _ours_equal_theirs(ssm.MultiHeadAttention.from_hf(layer), layer) < 1e-6


def test_a_later_sliding_layer_converts_with_its_window_and_equals_the_layer() -> None:
    """Gemma 2's layer 2 slides (window 3) but is not the first sliding layer of its model: its window is read from
    its own layer type, its probe runs through the cache layer it writes, and it equals the layer."""
    gemma2 = importlib.import_module("transformers.models.gemma2.modeling_gemma2")
    config = CONFIG_MAPPING["gemma2"](**SIZES | {"num_hidden_layers": 4}, sliding_window=3)
    torch.manual_seed(0)
    layer = gemma2.Gemma2Attention(config, layer_idx=2).to(torch.float64).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.4, 0.4)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert ours.window == 3 and _ours_equal_theirs(ours, layer) < 1e-6  # its eager softmax is float32 inside


def test_a_smollm3_nope_layer_converts_both_ways_without_rope_or_temperature_tuning() -> None:
    """SmolLM3's no_rope_layers makes layer 1 a NoPE layer: loaded without RoPE, and without Llama 4's temperature
    tuning, which its config (no attn_temperature_tuning field) never asks for; verified. A module without RoPE goes
    into a config whose layer 0 is NoPE, its partial_rotary_factor (the other layers') not compared."""
    smollm3 = importlib.import_module("transformers.models.smollm3.modeling_smollm3")
    config = CONFIG_MAPPING["smollm3"](**SIZES, no_rope_layers=[1, 0])
    ours = ssm.MultiHeadAttention.from_hf(smollm3.SmolLM3Attention(config, layer_idx=1).to(torch.float64))
    assert (ours.rope_theta, ours.temperature_tuning) == (None, None)
    nope_first = {"no_rope_layers": [0, 1], "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    plain = ssm.MultiHeadAttention(32, 4, 2, d_head=8, bias=False)
    back = plain.to_hf(CONFIG_MAPPING["smollm3"](**SIZES, **nope_first))
    assert isinstance(back, smollm3.SmolLM3Attention)  # to_hf's layer 0 rotates nothing: its partial factor unread


def test_the_probe_catches_a_conversion_that_reads_a_field_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that forgets the window (as a moved config field would make it) is refused by the probe;
    `verify=False` returns it unverified."""
    layer = _layer("mistral", sliding_window=2)
    honest = _hf.variant_options

    def forgets_the_window(attention: nn.Module, config: Any) -> dict[str, Any]:
        return {k: v for k, v in honest(attention, config).items() if k != "window"}

    monkeypatch.setattr(_hf, "variant_options", forgets_the_window)
    with pytest.raises(ssm.ConfigError, match=r"the converted layer differs from MistralAttention by [0-9.e-]+ in a"):
        ssm.MultiHeadAttention.from_hf(layer)
    unverified = ssm.MultiHeadAttention.from_hf(layer, verify=False)
    assert unverified.window is None and _ours_equal_theirs(unverified, layer) > 1e-3


def _verdict(layer: nn.Module) -> str:
    try:
        ssm.MultiHeadAttention.from_hf(layer)
    except ssm.ConfigError as refusal:
        return str(refusal).split(" by ")[0]  # the refusal without its figures, which depend on the dtype
    return "converted"


@pytest.mark.parametrize("model_type", ["cohere", "ernie4_5", "helium", "llama"])
def test_a_float32_layer_gets_the_verdict_of_its_float64_copy(model_type: str) -> None:
    """The probe's tolerance is relative to the largest output: with a floor of 1.0 under it, a float32 layer
    with the weights of its own init (std 0.02, outputs near 0.01) was allowed 1e-3, a tenth of its outputs,
    and Cohere's interleaved RoPE (2e-4 off) converted silently where its float64 copy was refused."""
    config_cls = CONFIG_MAPPING[model_type]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    model = modeling.__dict__[f"{config_cls.__name__.removesuffix('Config')}ForCausalLM"](config_cls(**SIZES))
    layer = model.model.layers[0].self_attn.to(torch.float64)
    assert _verdict(layer.to(torch.float32)) == _verdict(layer.to(torch.float64))
    assert all(p.dtype == torch.float64 for p in layer.parameters())  # the probe copied; the layer is left as it is


def test_a_centring_qk_norm_with_one_weight_for_every_head_is_found_centred() -> None:
    """A LayerNorm without bias over each head's features, with one weight row shared by the heads (Cohere's norm
    class at width d_head, set as Qwen3's norms), is found centred and converts (verified)."""
    cohere = importlib.import_module("transformers.models.cohere.modeling_cohere")
    layer = _layer("qwen3")
    layer.q_norm, layer.k_norm = (cohere.CohereLayerNorm(8, eps=1e-5).double() for _ in range(2))
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert (ours.qk_norm_centred, ours.qk_norm_over) == (True, "head")


def test_a_float16_layer_s_qk_norm_is_compared_at_float16_s_precision() -> None:
    """load_norms compares the layer's QK-norm with ours on a probe in the layer's dtype, at a tolerance float16's
    rounding meets: a float16 Qwen3 layer's norm is found the RMSNorm it is, and the layer converts (verified)."""
    assert ssm.MultiHeadAttention.from_hf(_layer("qwen3").to(torch.float16)).qk_norm


def test_from_hf_on_meta_loads_without_a_probe() -> None:
    """Meta layers hold no values to compare: the conversion's shapes only (a huge config costs nothing)."""
    with torch.device("meta"):
        layer = importlib.import_module("transformers.models.llama.modeling_llama").LlamaAttention(
            CONFIG_MAPPING["llama"](**SIZES), layer_idx=0
        )
    assert ssm.MultiHeadAttention.from_hf(layer).q_proj.weight.device.type == "meta"


def _gemma3() -> nn.Module:
    """Gemma 3's text layer (its model_type, gemma3_text, has no module of that name), float64, weights drawn."""
    modeling = importlib.import_module("transformers.models.gemma3.modeling_gemma3")
    torch.manual_seed(0)
    layer = modeling.Gemma3Attention(CONFIG_MAPPING["gemma3_text"](**SIZES), layer_idx=0).to(torch.float64)
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-0.4, 0.4)
    return layer.eval()


@pytest.mark.parametrize(
    ("build", "dtype"),
    [
        (lambda: _layer("qwen3"), torch.bfloat16),
        (_gemma3, torch.bfloat16),
        (lambda: _layer("cohere", use_qk_norm=True), torch.float16),
    ],
    ids=["qwen3", "gemma3", "cohere"],
)
def test_half_precision_qk_norms_load_as_the_float32_probe_shows_them(
    build: Callable[[], nn.Module], dtype: torch.dtype
) -> None:
    """A half-precision layer is probed in float32, its QK-norms too: their own rounding (bfloat16 RMSNorm,
    float16 LayerNorm) put them past the norm probe's rtol 1e-3 in their dtype, and they were refused as
    computing neither norm. Loaded in its dtype, Gemma 3's `1 + weight` found, and the layer verified."""
    layer = build().to(dtype)
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert ours.qk_norm and ours.q_proj.weight.dtype == dtype
    torch.testing.assert_close(ours.q_norm.weight, layer.q_norm.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "build",
    [lambda: _layer("qwen3"), _gemma3, lambda: _layer("cohere", use_qk_norm=True)],
    ids=["qwen3", "gemma3", "cohere"],
)
def test_a_meta_layer_with_qk_norm_converts_to_what_its_materialized_twin_does(build: Callable[[], nn.Module]) -> None:
    """On meta, which holds no values, the norms are probed on CPU copies of their class with drawn weights: the
    module (Gemma 3's `1 + weight`, Cohere's centred norm) is the one the same layer with values converts to,
    and it stays on meta. (A meta layer with QK-norm raised torch's RuntimeError, and skipping the probe there
    would load Gemma 3 and Cohere as plain RMSNorms, silently.)"""
    with torch.device("meta"):
        meta = build()
    ours = ssm.MultiHeadAttention.from_hf(meta)
    assert ours.qk_norm and {p.device.type for p in ours.parameters()} == {"meta"}
    assert repr(ours) == repr(ssm.MultiHeadAttention.from_hf(build()))


def test_a_users_subclass_of_a_transformers_layer_is_converted_and_verified_as_its_base() -> None:
    """A subclass defined outside transformers (a user's module) finds its base's rotary class and RoPE there:
    one that computes what its base does loads, verified; one whose forward differs is refused by the probe.
    (The rotary class was looked up beside the subclass, and every such subclass was refused.)"""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    same = type("MyAttention", (llama.LlamaAttention,), {"__module__": "my_project.layers"})
    doubled = type("MyAttention", (same,), {"forward": _doubled(llama.LlamaAttention.forward)})
    layer = same(CONFIG_MAPPING["llama"](**SIZES), layer_idx=0).double().eval()
    assert _ours_equal_theirs(ssm.MultiHeadAttention.from_hf(layer), layer) < 1e-6  # its rotary tables: float32
    other = doubled(CONFIG_MAPPING["llama"](**SIZES), layer_idx=0).double().eval()
    with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention\.from_hf\(\): the converted layer differs from"):
        ssm.MultiHeadAttention.from_hf(other)


def test_dropout_is_carried_from_the_config() -> None:
    layer = _layer("llama", attention_dropout=0.1)
    assert ssm.MultiHeadAttention.from_hf(layer).dropout == 0.1


LATENT = {
    "q_lora_rank": None,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "head_dim": 4,  # the rotary width, as DeepSeek's configs set it
    "v_head_dim": 4,
    "num_key_value_heads": 4,
}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_latent_from_hf_pairs_rope_as_the_layer_does(model_type: str) -> None:
    """DeepSeek-V2 has no rope_interleave field and always interleaves: the probe shows it (it was 2.45 off)."""
    layer = _layer(model_type, **LATENT)
    ours = ssm.LatentAttention.from_hf(layer)
    assert ours.interleaved
    assert _ours_equal_theirs(ours, layer) < 1e-5  # V2 rotates in complex64


def test_latent_from_hf_refuses_a_layer_that_computes_something_else() -> None:
    """Kimi-Linear's latent attention has no rotary embedding: refused, the RoPE named (it was 0.89 off)."""
    layer = _layer("kimi_linear", "KimiLinearAttention", **LATENT)
    with pytest.raises(ssm.ConfigError, match=r"LatentAttention.from_hf\(\): .* the rotary embeddings"):
        ssm.LatentAttention.from_hf(layer)


def test_latent_from_hf_reads_the_theta_the_norm_s_epsilon_and_the_dropout_and_keeps_a_meta_layer_on_meta() -> None:
    """The theta of rope_parameters (5e5, not the default 1e4), kv_a_layernorm's own epsilon (0.1, not the default
    1e-6) and the config's attention_dropout are the module's, verified on the probe; a layer on meta loads on
    meta, without a probe (as MultiHeadAttention.from_hf does)."""
    layer = _layer("deepseek_v3", **LATENT, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    layer.kv_a_layernorm.variance_epsilon = 0.1
    layer.config.attention_dropout = 0.2
    ours = ssm.LatentAttention.from_hf(layer)
    assert (ours.rope_theta, ours.kv_a_layernorm.eps, ours.dropout) == (5e5, 0.1, 0.2)
    biased = ssm.LatentAttention.from_hf(_layer("deepseek_v3", **LATENT, attention_bias=True))  # verified
    assert biased.kv_a_proj_with_mqa.bias is not None
    deepseek = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    with torch.device("meta"):
        layer = deepseek.DeepseekV3Attention(CONFIG_MAPPING["deepseek_v3"](**SIZES | LATENT), layer_idx=0)
    assert {p.device.type for p in ssm.LatentAttention.from_hf(layer).parameters()} == {"meta"}


def test_latent_from_hf_names_a_layer_it_cannot_load_and_what_does_not_fit() -> None:
    """A q/k/v/o layer is sent to MultiHeadAttention.from_hf by its class's name; a latent layer holding a part of
    its own is refused listing the parts that do not fit; one that shares KV heads is refused naming both counts;
    a part of another shape than its config makes is refused naming it and the sizes (not torch's size mismatch)."""
    cases = {
        "LlamaAttention is not a multi-head latent attention layer (no .config and kv_a_proj_with_mqa); for "
        "q/k/v/o_proj layers use MultiHeadAttention.from_hf.": _layer("llama"),
        "DeepseekV3Attention's parameters do not match the layout: missing [], unexpected ['extra.weight', "
        "'extra.bias'].": _edited("deepseek_v3", lambda layer: setattr(layer, "extra", nn.Linear(2, 2)), **LATENT)(),
        "Linear is not a multi-head latent attention layer (no .config and kv_a_proj_with_mqa); for q/k/v/o_proj "
        "layers use MultiHeadAttention.from_hf.": nn.Linear(2, 2),
        "num_key_value_heads=2 != num_attention_heads=4: latent attention rebuilds a key and a value for every head; "
        "this layer would compute something else, so it is refused.": _layer(
            "deepseek_v3", **LATENT | {"num_key_value_heads": 2}
        ),
        "kv_b_proj.weight.shape=(28, 8): the config makes it (32, 8) (hidden_size=32, num_attention_heads=4, "
        "kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4); this layer would "
        "compute something else, so it is refused.": _edited(
            "deepseek_v3", lambda layer: setattr(layer, "kv_b_proj", nn.Linear(8, 28, bias=False)), **LATENT
        )(),
    }
    for message, layer in cases.items():
        with pytest.raises(ssm.ConfigError, match=f"^{re.escape('LatentAttention.from_hf(): ' + message)}$"):
            ssm.LatentAttention.from_hf(layer)


def _doubled(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)  # its signature, which the probe reads to call it as its model does
    def twice(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        return (2 * out[0], *out[1:])

    return twice


def test_latent_from_hf_s_probe_refuses_a_layer_that_differs_headed_by_its_own_name() -> None:
    """DeepSeek-V3's config names its RoPE pairing (rope_interleave), so one probe decides: a layer that computes
    otherwise (here, twice its output) is refused, and the refusal is LatentAttention.from_hf()'s."""
    layer = _layer("deepseek_v3", **LATENT)
    layer.forward = _doubled(layer.forward)
    with pytest.raises(ssm.ConfigError, match=r"^LatentAttention\.from_hf\(\): the converted layer differs from "):
        ssm.LatentAttention.from_hf(layer)


def test_to_hf_names_a_model_type_without_attention_and_a_bias_the_layer_does_not_hold() -> None:
    """A config whose model has no attention class (Mamba) is refused naming its model_type; a module with biases
    is refused for a Llama config without attention_bias, naming the projection and both sides' bias."""
    message = "MultiHeadAttention.to_hf(): no transformers attention class for model_type='mamba'."
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        ssm.MultiHeadAttention(32, 4, 2).to_hf(CONFIG_MAPPING["mamba"](hidden_size=32))
    biased = ssm.MultiHeadAttention(32, 4, 2, d_head=8, bias=True, rope_theta=1e4)
    message = (
        "MultiHeadAttention.to_hf(): q_proj has bias=True here but False in LlamaAttention (config.attention_bias?)."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        biased.to_hf(CONFIG_MAPPING["llama"](**SIZES))


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def test_to_hf_compares_rope_scaling_and_dropout_and_verifies_the_layer() -> None:
    """to_hf ignored rope_scaling (0.59 off) and dropout; now both are compared, and the layer is probed."""
    scaled = ssm.MultiHeadAttention(32, 4, 2, d_head=8, bias=False, rope_theta=1e4, rope_scaling=LLAMA3)
    plain = CONFIG_MAPPING["llama"](**SIZES)
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters \(scaling\)=None \(module: \{'rope_type': 'llama3'"):
        scaled.to_hf(plain)
    with pytest.raises(ssm.ConfigError, match=r"rope_parameters \(scaling\)=\{'rope_type': 'llama3'.*\(module: None\)"):
        ssm.MultiHeadAttention(32, 4, 2, bias=False, rope_theta=1e4).to_hf(
            CONFIG_MAPPING["llama"](**SIZES, rope_parameters={**LLAMA3, "rope_theta": 1e4})
        )
    layer = scaled.to_hf(CONFIG_MAPPING["llama"](**SIZES, rope_parameters={**LLAMA3, "rope_theta": 1e4}))
    assert _ours_equal_theirs(scaled.double(), layer.double().eval()) < 1e-6
    with pytest.raises(ssm.ConfigError, match=r"attention_dropout=0.0 \(module: 0.1\)"):
        ssm.MultiHeadAttention(32, 4, 2, bias=False, rope_theta=1e4, dropout=0.1).to_hf(plain)


@pytest.mark.parametrize(
    "options",
    [
        {"rope_theta": 1e4},
        {"window": 3},
        {"logit_softcap": 5.0},
        {"qk_norm": True},
        {"query_pre_attn_scalar": 4.0},
        {"attention_sinks": True},
        {"alibi": True},
        {"clip_qkv": 1.0},
    ],
)
def test_to_torch_refuses_each_variant_by_name(options: dict[str, Any]) -> None:
    """nn.MultiheadAttention computes none of them: it differed by 0.02-0.35 without a word."""
    name = next(iter(options))
    with pytest.raises(ssm.ConfigError, match=rf"to_torch\(\): nn.MultiheadAttention computes none of {name}="):
        ssm.MultiHeadAttention(32, 4, **options).to_torch()


@pytest.mark.parametrize("biased", ["qkvo", "o", "v", "qk", "qkv", ""])
def test_from_weights_and_to_torch_keep_any_subset_of_biases(biased: str) -> None:
    """from_weights dropped every bias without b_q (0.25 off); to_torch crashed on partial biases."""
    source = ssm.MultiHeadAttention(32, 4, dtype=torch.float64)
    w = source.weights()
    weights = ssm.AttentionWeights(
        w.w_q, w.w_k, w.w_v, w.w_o, **{f"b_{r}": getattr(w, f"b_{r}") if r in biased else None for r in "qkvo"}
    )
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=4)
    assert [p.bias is not None for p in (module.q_proj, module.k_proj, module.v_proj, module.o_proj)] == [
        r in biased for r in "qkvo"
    ]
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    expected = per_head_attention(x, x, x, weights, num_heads=4, num_kv_heads=4)
    torch.testing.assert_close(module(x), expected, **F64)
    theirs = module.to_torch().eval()
    torch.testing.assert_close(theirs(x, x, x, need_weights=False)[0], expected, **F64)


def test_check_attention_with_an_output_bias_only_passes_from_weights() -> None:
    """check_attention(bias="o") failed a from_weights-built implementation (0.84 off)."""

    def attention(x: torch.Tensor, weights: ssm.AttentionWeights, *, num_heads: int, num_kv_heads: int,
                  is_causal: bool) -> torch.Tensor:  # fmt: skip
        module = ssm.MultiHeadAttention.from_weights(weights, num_heads=num_heads, num_kv_heads=num_kv_heads)
        return module(x, is_causal=is_causal)

    check_attention(attention, bias="o", max_examples=10, dtype=torch.float64)


def test_from_weights_names_a_weight_of_the_wrong_rank_or_dtype() -> None:
    w = ssm.MultiHeadAttention(16, 4).weights()
    with pytest.raises(ssm.ShapeError, match=r"w_q is 3-D, but a weight is 2-D"):
        ssm.MultiHeadAttention.from_weights(ssm.AttentionWeights(w.w_q[None], w.w_k, w.w_v, w.w_o), num_heads=4)
    ints = ssm.AttentionWeights(*(t.long() for t in (w.w_q, w.w_k, w.w_v, w.w_o)))
    with pytest.raises(ssm.ShapeError, match=r"w_q has dtype int64, but weights must be floating point"):
        ssm.MultiHeadAttention.from_weights(ints, num_heads=4)


def test_the_probe_costs_little_beside_the_load() -> None:
    """The probe runs on float64 copies and leaves the layer and the result as they were (dtype, mode, weights)."""
    layer = _layer("llama").float().train()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    ours = ssm.MultiHeadAttention.from_hf(layer)
    assert ours.training and ours.q_proj.weight.dtype == torch.float32 and layer.training
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


def test_to_torch_is_probed_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """A to_torch that forgets a window (as a variant it stopped naming would make it) is refused by the probe;
    `verify=False` returns it unverified, computing full causal attention where the module sees one key."""
    from shapesafe_mha._interop import torch_nn

    module = ssm.MultiHeadAttention(32, 4, window=1, dtype=torch.float64)
    monkeypatch.setattr(torch_nn, "_variants", lambda module: [])
    with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention\.to_torch\(\): the converted layer differs from"):
        module.to_torch()
    unverified = module.to_torch(verify=False).eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with torch.no_grad():
        difference = (unverified(x, x, x, attn_mask=causal, need_weights=False)[0] - module(x, is_causal=True)).abs()
    assert float(difference.max()) > 1e-3


def test_to_hf_is_probed_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """A to_hf that reads a window the layer does not compute (as a moved config field would make it) is refused
    by the probe; `verify=False` returns the layer unverified."""
    module = ssm.MultiHeadAttention(32, 4, 2, d_head=8, bias=False, rope_theta=1e4, window=1, dtype=torch.float64)
    honest = _hf.variant_options
    monkeypatch.setattr(_hf, "variant_options", lambda attention, config: {**honest(attention, config), "window": 1})
    config = CONFIG_MAPPING["llama"](**SIZES)
    with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention\.to_hf\(\): the converted layer differs from"):
        module.to_hf(config)
    layer = module.to_hf(config, verify=False).to(torch.float64).eval()
    assert _ours_equal_theirs(module, layer) > 1e-3


def test_a_layer_that_keeps_no_config_converts_with_its_models() -> None:
    """Bloom's attention keeps no config: from_hf(layer) says to pass the model's, and with it the layer converts
    (its sizes and ALiBi read from that config)."""
    from transformers.models.bloom.modeling_bloom import BloomAttention

    config = CONFIG_MAPPING["bloom"](hidden_size=16, n_head=4, n_layer=1)
    config._attn_implementation = "eager"  # Bloom's only implementation
    layer = BloomAttention(config, layer_idx=0).to(torch.float64).eval()
    message = (
        "MultiHeadAttention.from_hf(): BloomAttention has no .config; pass a transformers attention layer, and for one "
        "that keeps no config (Bloom's, MPT's) its model's: from_hf(layer, config=model.config)."
    )
    with pytest.raises(ssm.ConfigError, match=f"^{re.escape(message)}$"):
        ssm.MultiHeadAttention.from_hf(layer)
    ours = ssm.MultiHeadAttention.from_hf(layer, config=config)
    assert (ours.d_model, ours.num_heads, ours.alibi_slopes is not None) == (16, 4, True)


class _OtherScale(ssm.MultiHeadAttention):
    """A subclass computing another function: its scores scaled by 0.1 instead of d_head ** -0.5."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["scale"] = 0.1  # (past the refusal of `module.scale = ...`: a derived attribute)


def test_from_weights_probes_what_the_class_built_unless_told_not_to() -> None:
    """The probe compares what the class built with the per-head reference of the weights: a subclass that
    computes another function is refused, and `verify=False` returns it unverified."""
    weights = ssm.MultiHeadAttention(32, 4, 2, dtype=torch.float64).weights()
    with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention\.from_weights\(\): the converted layer differs"):
        _OtherScale.from_weights(weights, num_heads=4, num_kv_heads=2)
    unverified = _OtherScale.from_weights(weights, num_heads=4, num_kv_heads=2, verify=False)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        difference = (unverified(x) - per_head_attention(x, x, x, weights, num_heads=4, num_kv_heads=2)).abs()
    assert isinstance(unverified, _OtherScale) and float(difference.max()) > 1e-3
