

def test_a_float32_layer_that_differs_by_less_than_float32s_tolerance_is_left() -> None:
    """Cohere's interleaved RoPE differs from ours by about 2e-4 of the output: under the probe's float32
    tolerance, so the conversion is verified on a float64 copy, which tells them apart."""
    config = transformers.CohereConfig(**SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    done = shapesafe_mha.hf.replace_attention(model)
    assert not done.replaced and list(done.left) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "the converted layer differs from CohereAttention by" in done.left["model.layers.0.self_attn"]
    assert all(param.dtype == torch.float32 for param in model.parameters())  # the copy was the probe's
