"""Hugging Face state after failures, and hooks after a replacement: a failed call changes nothing, anywhere in
the cache object; a hook on a replaced layer still runs, or the layer is left and says why.

The cache is compared whole: every attribute of the `Cache` and of each of its layers, all the way down, tensors by
value (dtype, device, shape, elements), before and after a call that fails, for each kind of transformers cache
layer (dynamic, sliding, static, static sliding; empty, prefilled, and one the call would have made), and each
way a call can fail (a mask over the wrong keys, after the write; hidden states of another width and positions of
another length, before it; a mask transformers' layers do not take; a cache a replaced layer does not read).
"""

import copy
import functools
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_hf_models import SIZES, _batch  # noqa: E402  (the same tiny models and batch)

import shapesafe_mha.hf  # noqa: E402

# model: (config class, extra config)
MODELS = {
    "llama": ("LlamaConfig", {}),
    "mistral (sliding window 3)": ("MistralConfig", {"sliding_window": 3}),
    "qwen3 (QK-norm)": ("Qwen3Config", {}),
}
# cache: (model, how it is made, the kind of its layers)
CACHES: dict[str, tuple[str, Any, str]] = {
    "dynamic": ("llama", lambda config: transformers.DynamicCache(config=config), "DynamicLayer"),
    "dynamic, layers made by the call": ("llama", lambda config: transformers.DynamicCache(), "DynamicLayer"),
    "dynamic sliding": (
        "mistral (sliding window 3)", lambda config: transformers.DynamicCache(config=config),
        "DynamicSlidingWindowLayer",
    ),
    "static": ("llama", lambda config: transformers.StaticCache(config=config, max_cache_len=16), "StaticLayer"),
    "static sliding": (
        "mistral (sliding window 3)", lambda config: transformers.StaticCache(config=config, max_cache_len=16),
        "StaticSlidingWindowLayer",
    ),
}  # fmt: skip
HIDDEN, HEADS, D_HEAD = SIZES["hidden_size"], SIZES["num_attention_heads"], SIZES["head_dim"]


@functools.cache
def _models(name: str) -> tuple[Any, Any]:
    """The model as built (float64, eval), and a copy with its attention replaced (built once: tests copy them)."""
    config_name, options = MODELS[name]
    config = getattr(transformers, config_name)(**SIZES, **options)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    ours = copy.deepcopy(theirs.eval())
    done = shapesafe_mha.hf.replace_attention(ours)
    assert len(done.replaced) == SIZES["num_hidden_layers"], str(done)
    return theirs, ours


def _state(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """Everything `value` holds, all the way down, as plain values: tensors as (dtype, device, shape, a copy)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.device, tuple(value.shape), value.detach().clone())
    if id(value) in seen:
        return ("cycle", type(value))
    seen = seen | {id(value)}
    if isinstance(value, list | tuple):
        return (type(value), [_state(item, seen) for item in value])
    if isinstance(value, dict):
        return (dict, {key: _state(item, seen) for key, item in value.items()})
    if hasattr(value, "__dict__") and not isinstance(value, type) and type(value).__module__.startswith("transformers"):
        return (type(value), _state(vars(value), seen))
    return value


def _same(before: Any, after: Any, where: str = "cache") -> None:
    """Equal states, or an AssertionError naming the first attribute that differs."""
    if isinstance(before, tuple) and before[:1] == ("tensor",):
        assert isinstance(after, tuple) and after[:4] == before[:4], f"{where}: {before[:4]} -> {after[:4]}"
        assert torch.equal(after[4], before[4]), f"{where}: its values changed"
    elif isinstance(before, tuple) and len(before) == 2 and isinstance(before[0], type):
        assert isinstance(after, tuple) and after[0] is before[0], f"{where}: {before[0]} -> {after[0]}"
        inner, other = before[1], after[1]
        if isinstance(inner, dict):
            assert set(other) == set(inner), f"{where}: attributes {sorted(inner)} -> {sorted(other)}"
            for key in inner:
                _same(inner[key], other[key], f"{where}.{key}")
        elif isinstance(inner, list):
            assert len(other) == len(inner), f"{where}: {len(inner)} items -> {len(other)}"
            for i, (a, b) in enumerate(zip(inner, other, strict=True)):
                _same(a, b, f"{where}[{i}]")
        else:
            _same(inner, other, where)
    else:
        assert after == before, f"{where}: {before!r} -> {after!r}"


def _failing_calls(seen: int) -> dict[str, tuple[dict[str, Any], type]]:
    """Calls of a replaced layer that fail, after `seen` cached positions: keyword arguments, and the error."""
    hidden = torch.randn(1, 2, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seen, seen + 2)[None]
    return {
        "a mask over the wrong keys (after the write)": (
            {"hidden_states": hidden, "attention_mask": torch.ones(1, 1, 2, seen + 9, dtype=torch.bool),
             "position_ids": positions}, shapesafe_mha.ShapeError,
        ),
        "hidden states of another width": (
            {"hidden_states": torch.randn(1, 2, HIDDEN + 1, dtype=torch.float64), "position_ids": positions},
            shapesafe_mha.ShapeError,
        ),
        "positions of another length": (
            {"hidden_states": hidden, "position_ids": torch.arange(seen, seen + 3)[None]}, shapesafe_mha.ShapeError,
        ),
        "a 2-D padding mask": (
            {"hidden_states": hidden, "attention_mask": torch.ones(1, 2, dtype=torch.bool), "position_ids": positions},
            shapesafe_mha.ConfigError,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("prefilled", [False, True], ids=["empty", "prefilled"])
@pytest.mark.parametrize("cache_kind", list(CACHES))
def test_a_failed_call_leaves_every_field_of_the_cache_as_it_was(cache_kind: str, prefilled: bool) -> None:
    model_name, make, layer_kind = CACHES[cache_kind]
    theirs, ours = _models(model_name)
    cache = make(ours.config)
    ids, _ = _batch()
    seen = 5 if prefilled else 0
    if prefilled:  # by the model itself: each kind of layer filled as transformers fills it
        with torch.no_grad():
            theirs(ids[:1, :seen], cache=cache, use_cache=True)
    if cache.layers:
        assert type(cache.layers[0]).__name__ == layer_kind
    layer = ours.model.layers[0].self_attn
    static = layer_kind.startswith("Static")  # refused before anything is read: a ConfigError naming it
    for failure, (kwargs, error) in _failing_calls(seen).items():
        before = _state(cache)
        layers = list(cache.layers)
        with torch.no_grad(), pytest.raises(shapesafe_mha.ConfigError if static else error):
            layer(past_key_values=cache, **kwargs)
        _same(before, _state(cache), f"{cache_kind} cache, {failure}: cache")
        assert all(a is b for a, b in zip(cache.layers, layers, strict=True)), "the layers are the cache's own"
    with torch.no_grad():  # and a failed call of the whole model (position ids of another length than the tokens)
        before = _state(cache)
        with pytest.raises(shapesafe_mha.ConfigError if static else shapesafe_mha.ShapeError):
            ours(ids[:1, :3], position_ids=torch.arange(seen, seen + 4)[None], cache=cache)
        _same(before, _state(cache), f"{cache_kind} cache, a model call with positions of another length: cache")


HOOKS = {
    "forward pre-hook": lambda m, record: m.register_forward_pre_hook(lambda *_: record()),
    "forward hook": lambda m, record: m.register_forward_hook(lambda *_: record()),
    "forward pre-hook with kwargs": lambda m, record: m.register_forward_pre_hook(
        lambda *_: record(), with_kwargs=True
    ),
    "forward hook with kwargs": lambda m, record: m.register_forward_hook(lambda *_: record(), with_kwargs=True),
    "full backward hook": lambda m, record: m.register_full_backward_hook(lambda *_: record()),
}


# (a layer left as it was is called with its hidden states by keyword: torch's full backward hook then fires on
# the gradients of its outputs, and says so)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed with respect to module")
@pytest.mark.parametrize("hook", list(HOOKS))
@pytest.mark.parametrize("site", ["", "q_proj", "o_proj", "q_norm", "k_norm"], ids=lambda s: s or "the layer")
def test_a_hook_on_a_layer_still_runs_after_the_replacement_or_the_layer_is_left_saying_why(
    site: str, hook: str
) -> None:
    """A hook on the attention module or on one of its submodules: after `replace_attention` either the layer is
    left, its reason naming the hooks, or the hook runs on the model's forward (and backward) as it did."""
    theirs, _ = _models("qwen3 (QK-norm)")
    model = copy.deepcopy(theirs).train()
    path = "model.layers.0.self_attn"
    calls: list[int] = []
    HOOKS[hook](model.get_submodule(".".join(filter(None, [path, site]))), lambda: calls.append(1))
    done = shapesafe_mha.hf.replace_attention(model)
    ids, _ = _batch()
    if path in done.left:
        assert "has hooks (1 " in done.left[path] and "which the replacement would not run" in done.left[path]
        assert type(model.get_submodule(path)).__name__ == "Qwen3Attention"
    else:
        assert path in done.replaced
    calls.clear()  # (a conversion's probe runs the layer it verifies)
    model(ids, labels=ids).loss.backward()
    assert calls, f"the {hook} on {site or 'the layer'} did not run after the replacement ({done})"
