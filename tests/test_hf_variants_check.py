"""check_hf_attention computes the variants of real transformers classes, and catches a bug planted in each.

Each variant class passes in float64, full forward and step-by-step decoding against the per-head reference
(1e-10 where the class computes in float64 throughout under sdpa; where it rounds through float32 inside,
a norm or a RoPE that upcasts "to float32" which in float64 is a downcast, the float32-rounding tolerance);
a bug planted in the variant is caught, the property that broke named on the report's first line.
"""

import pytest
import torch
from hf_variant_bugs import VARIANT_BUGS, VariantBug

transformers = pytest.importorskip("transformers")

from shapesafe_mha.testing.hf import check_hf_attention  # noqa: E402

# variant: (model type's attention class, config class, implementation, atol: None = float32 rounding accepted)
VARIANTS = {
    "sliding window (Mistral)": ("mistral.MistralAttention", "MistralConfig", "sdpa", 1e-10),
    "attention_multiplier (Granite)": ("granite.GraniteAttention", "GraniteConfig", "sdpa", 1e-10),
    "partial rotary (Phi)": ("phi.PhiAttention", "PhiConfig", "sdpa", 1e-10),
    "partial rotary, per-head fused QKV (GPT-NeoX)": ("gpt_neox.GPTNeoXAttention", "GPTNeoXConfig", "sdpa", 1e-10),
    "partial, interleaved RoPE (GLM)": ("glm.GlmAttention", "GlmConfig", "sdpa", 1e-10),
    "interleaved RoPE (Cohere)": ("cohere.CohereAttention", "CohereConfig", "sdpa", None),
    "NoPE full layers, windowed sliding layers (Cohere 2)": ("cohere2.Cohere2Attention", "Cohere2Config", "sdpa", None),
    "QK-norm of each head (Qwen3)": ("qwen3.Qwen3Attention", "Qwen3Config", "sdpa", None),
    "QK-norm over every head (OLMo-2)": ("olmo2.Olmo2Attention", "Olmo2Config", "sdpa", None),
    "QK-norm 1 + weight, query_pre_attn_scalar, layer types (Gemma 3)": (
        "gemma3.Gemma3Attention", "Gemma3TextConfig", "sdpa", None),
    "QK-norm after RoPE (HunYuan)": ("hunyuan_v1_dense.HunYuanDenseV1Attention", "HunYuanDenseV1Config", "sdpa", None),
    "QK LayerNorm, partial rotary, per-head fused QKV (Persimmon)": (
        "persimmon.PersimmonAttention", "PersimmonConfig", "sdpa", None),
    "an RMSNorm of the merged heads (BitNet)": ("bitnet.BitNetAttention", "BitNetConfig", "sdpa", None),
    "multi_query fused query_key_value, alibi off (Falcon)": ("falcon.FalconAttention", "FalconConfig", "eager", None),
    "logit softcapping (Gemma 2)": ("gemma2.Gemma2Attention", "Gemma2Config", "eager", None),
    # eager takes the softmax in float32 inside: the float32-rounding tolerance
    "attention sinks, half-width rotary table (gpt-oss)": ("gpt_oss.GptOssAttention", "GptOssConfig", "eager", None),
    "multi_query MQA, one fused [q; k; v] (GPTBigCode)": (
        "gpt_bigcode.GPTBigCodeAttention", "GPTBigCodeConfig", "sdpa", 1e-10),
    # RoPE of the layer's own (sin, cos) tables on a drawn rotary_dim, adjacent pairs, at the theta read from them
    # (float32 angles, as the reference's are); CodeGen's qkv_proj in its blocks
    "RoPE on rotary_dim features, (sin, cos) tables of its own (GPT-J)": (
        "gptj.GPTJAttention", "GPTJConfig", "sdpa", 1e-10),
    "... behind qkv_proj in mp_num blocks of [q; v; k] (CodeGen)": (
        "codegen.CodeGenAttention", "CodeGenConfig", "sdpa", 1e-10),
    # an output gate in q_proj (each head's queries, then its gate), its QK-norm of 1 + weight, partial rotary
    "output gate, 1 + weight QK-norm, partial rotary (Qwen3-Next)": (
        "qwen3_next.Qwen3NextAttention", "Qwen3NextConfig", "sdpa", None),
    "output gate (Qwen3.5)": ("qwen3_5.Qwen3_5Attention", "Qwen3_5TextConfig", "sdpa", None),
    # ALiBi biases as their models build them (their only implementation, eager: the softmax in float32)
    "ALiBi, per-head fused query_key_value, residual 0 (Bloom)": ("bloom.BloomAttention", "BloomConfig", "eager", None),
    "ALiBi as position_bias, [q; k; v] Wqkv (MPT)": ("mpt.MptAttention", "MptConfig", "eager", None),
    # its RoPE and its L2 norm compute in float32 inside ("x.float()"): the float32-rounding tolerance
    "complex RoPE, weightless QK-norm after it, NoPE layers' temperature, chunked layers (Llama 4)": (
        "llama4.Llama4TextAttention", "Llama4TextConfig", "sdpa", None),
}  # fmt: skip


def _classes(where: str, config_name: str) -> tuple[type, type]:
    import importlib

    model, name = where.split(".")
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    return getattr(modeling, name), getattr(transformers, config_name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_variant_class_passes_in_float64_full_forward_and_decoding(variant: str) -> None:
    where, config_name, implementation, atol = VARIANTS[variant]
    attention_cls, config_cls = _classes(where, config_name)
    check_hf_attention(attention_cls, config_cls, attn_implementation=implementation, dtype=torch.float64,
                       atol=atol, max_examples=10)  # fmt: skip


@pytest.mark.parametrize("bug", VARIANT_BUGS, ids=[bug.variant for bug in VARIANT_BUGS])
def test_a_bug_planted_in_a_variant_is_caught_and_its_property_named(bug: VariantBug) -> None:
    with pytest.raises(AssertionError) as caught, bug.patch():
        check_hf_attention(bug.attention_cls, bug.config_cls)
    report = str(caught.value)
    assert report.splitlines()[0].startswith(f"[{bug.prop}] {bug.attention_cls.__name__} (eager, float32)"), report
    if bug.named is not None:
        assert "bug class:" in report and bug.named in report, report
