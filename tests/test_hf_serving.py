"""transformers' continuous batching (`generate_batch`: packed prefill, paged cache) on replaced layers: the tokens
sdpa gives, and a paging bug caught by name (before: no tokens and no error)."""

import pytest
import torch

import shapesafe_mha as ssm

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import shapesafe_mha.hf  # noqa: E402

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128)  # fmt: skip
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [9], [11, 12, 13, 14, 15]]


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = {
        "llama": lambda: transformers.LlamaConfig(**SIZES),
        "qwen2": lambda: transformers.Qwen2Config(**SIZES),
        "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=4),  # prompts longer than the window
        # eager: continuous batching runs it as "paged|eager"; softcapping, alternating sliding layers
        "gemma2": lambda: transformers.Gemma2Config(**SIZES, head_dim=16, sliding_window=4),
    }[kind]()
    implementation = "eager" if kind == "gemma2" else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def _tokens(model: torch.nn.Module, new: int = 6) -> dict[str, list[int]]:
    generation = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    serving = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=32)  # a small pool: quick to make on CPU
    outputs = model.generate_batch(  # pyright: ignore[reportCallIssue]
        PROMPTS, generation_config=generation, continuous_batching_config=serving, warmup=False
    )
    return {request: output.generated_tokens for request, output in outputs.items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_generate_batch_on_replaced_layers_gives_sdpas_tokens(kind: str) -> None:
    """Every request gets tokens, and the tokens sdpa's own layers give (a sliding window model included)."""
    model = _model(kind)
    expected = _tokens(model)
    done = shapesafe_mha.hf.replace_attention(model)
    assert len(done.replaced) == 2
    served = _tokens(model)
    assert all(len(tokens) == 6 for tokens in served.values())
    assert served == expected


def test_a_paged_cache_reading_one_slot_off_is_caught_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in transformers' paged layer (read indices off by one once a request has a past) is a
    ShapeError raised from generate_batch, naming the layer and the request, not wrong or missing tokens."""
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    model = _model("llama")
    shapesafe_mha.hf.replace_attention(model)
    right = full_attention.FullAttentionCacheAllocator.get_read_indices

    def off_by_one(self: object, request_id: str, past_length: int, query_length: int) -> list[int]:
        indices = right(self, request_id, past_length, query_length)  # pyright: ignore[reportArgumentType]
        return indices if past_length == 0 else [i + 1 for i in indices]

    monkeypatch.setattr(full_attention.FullAttentionCacheAllocator, "get_read_indices", off_by_one)
    named = r"model\.layers\.0\.self_attn .*request \d+ of the packed batch read back"
    with pytest.raises(ssm.ShapeError, match=named):
        _tokens(model, new=2)


def test_a_paged_cache_giving_back_other_values_is_caught_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in transformers' paged cache that returns the keys it wrote but its values one slot off (a
    value page's index wrong, the keys' right) is a ShapeError naming the layer and the request, as keys off are."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    model = _model("llama")
    shapesafe_mha.hf.replace_attention(model)
    right = PagedAttentionCache.update

    def values_off(self: object, keys: torch.Tensor, values: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        keys, values = right(self, keys, values, *args, **kwargs)  # pyright: ignore[reportArgumentType]
        return keys, values.roll(1, dims=-2)

    monkeypatch.setattr(PagedAttentionCache, "update", values_off)
    named = r"model\.layers\.0\.self_attn .*request \d+ of the packed batch read back other values than"
    with pytest.raises(ssm.ShapeError, match=named):
        _tokens(model, new=2)
