"""The built-in property suite that `shapesafe-mha check` runs on a user's machine, device and dtype."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from .._compute.reference import KVHeads, per_head_attention
from .._compute.stages import merge_heads, scaled_dot_product_attention, split_heads
from .._core.trace import storage_id
from .._core.weights import AttentionWeights
from .._modules.multihead import MultiHeadAttention
from ._strategies import AttentionConfig, Kind, attention_inputs, attention_masks, key_padding_masks, projection_weights
from ._toolkit import AttentionFn, FailedCheckError, _compare, _to, module_adapter, resolve, run_property, tolerance


@dataclass
class Outcome:
    """What one property did: examples run, the worst deviation seen, and the failure if any.

    After a failure, `worst` is the failing example's deviation (NaN where the failure is not one:
    an exception, a wrong shape).
    """

    name: str
    examples: int = 0
    worst: float = 0.0
    tolerance: float = 0.0
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


Property = Callable[[AttentionConfig, Any, str, torch.dtype], float]


def _deviation(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    worst = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    if not worst <= tolerance(dtype):
        raise FailedCheckError(f"{what} differs by {worst:.3g} (tolerance {tolerance(dtype):g})", worst)
    return worst


def _module_fn(x: torch.Tensor, w: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> Any:
    module = MultiHeadAttention.from_weights(w, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return module(x, is_causal=is_causal)


def _module_vs_reference(is_causal: bool) -> Property:
    def prop(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
        weights = data.draw(projection_weights(config, dtype=dtype, device=device))
        x = data.draw(attention_inputs(config, dtype=dtype, device=device)).query
        return _compare(_module_fn, config, x, weights, is_causal, dtype)

    return prop


def _masks_vs_reference(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
    weights = data.draw(projection_weights(config, dtype=dtype, device=device))
    inputs = data.draw(attention_inputs(config, dtype=dtype, device=device))
    mask = data.draw(attention_masks(config, device=device))
    padding = data.draw(key_padding_masks(config, device=device))
    is_causal = data.draw(st.booleans())
    module = MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    got = module(inputs.query, inputs.key, inputs.value, attn_mask=mask, key_padding_mask=padding, is_causal=is_causal)
    expected = per_head_attention(
        inputs.query.double(),
        inputs.key.double(),
        inputs.value.double(),
        _to(weights, torch.float64),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        attn_mask=mask,
        key_padding_mask=padding,
        is_causal=is_causal,
    )
    return _deviation(got, expected, dtype, "masked attention")


def _sdpa_vs_torch(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    b, h, hkv = config.batch, config.num_heads, config.num_kv_heads
    s, kv, d = config.seq, config.kv_seq, config.d_head

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = randn(b, h, s, d), randn(b, hkv, kv, d), randn(b, hkv, kv, d)
    ours = scaled_dot_product_attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    return _deviation(ours, theirs, dtype, "scaled_dot_product_attention")


def _split_merge(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
    x = data.draw(attention_inputs(config, dtype=dtype, device=device)).query
    width = config.num_heads * config.d_head
    inner = torch.nn.functional.pad(x, (0, max(0, width - config.d_model)))[..., :width]
    heads = split_heads(inner, config.num_heads)
    if storage_id(heads) != storage_id(inner):
        raise AssertionError("split_heads copied its input instead of returning a view")
    if not torch.equal(merge_heads(heads), inner):
        raise AssertionError("merge_heads(split_heads(x)) != x")
    return 0.0


def _decode_vs_full(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
    weights = data.draw(projection_weights(config, dtype=dtype, device=device))
    x = data.draw(attention_inputs(config, dtype=dtype, device=device)).query
    module = MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    full = module(x, is_causal=True)
    cache = module.new_cache(config.batch, config.seq)
    prefill = data.draw(st.integers(0, config.seq))
    pieces = [module(x[:, :prefill], is_causal=True, kv_cache=cache)] if prefill else []
    pieces += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, config.seq)]
    return _deviation(torch.cat(pieces, dim=1), full, dtype, "decoding through a KV cache")


PROPERTIES: list[tuple[str, Property, tuple[Kind, ...], bool]] = [
    # name, property, kinds, cross-attention configs
    ("module == per-head reference (MHA)", _module_vs_reference(False), ("mha",), False),
    ("module == per-head reference (GQA)", _module_vs_reference(False), ("gqa",), False),
    ("module == per-head reference (MQA)", _module_vs_reference(False), ("mqa",), False),
    ("causal module == reference", _module_vs_reference(True), ("mha", "gqa", "mqa"), False),
    ("masks, key padding == reference", _masks_vs_reference, ("mha", "gqa", "mqa"), True),
    ("SDPA == torch SDPA (enable_gqa)", _sdpa_vs_torch, ("mha", "gqa", "mqa"), True),
    ("split is a view, merge inverts it", _split_merge, ("mha", "gqa", "mqa"), False),
    ("KV-cache decoding == full causal", _decode_vs_full, ("mha", "gqa", "mqa"), False),
]


def user_properties(
    fn: AttentionFn,
    prepare: Callable[[AttentionConfig, AttentionWeights], AttentionWeights] | None = None,
    *,
    kv_heads: KVHeads = "grouped",
    atol: float | None = None,
) -> list[tuple[str, Property, tuple[Kind, ...], bool]]:
    """The properties `check --impl`/`--module` runs on the user's code: `check_attention`'s, per kind and causal.

    `kv_heads` and `atol` are `check_attention`'s: which KV head a query head reads, and the tolerance.
    """

    def against_reference(is_causal: bool) -> Property:
        def prop(config: AttentionConfig, data: Any, device: str, dtype: torch.dtype) -> float:
            weights = data.draw(projection_weights(config, dtype=dtype, device=device))
            if prepare is not None:
                weights = prepare(config, weights)
            x = data.draw(attention_inputs(config, dtype=dtype, device=device)).query
            tol = resolve(dtype, atol, None)
            return _compare(fn, config, x, weights, is_causal, dtype, tol=tol, kv_heads=kv_heads)

        return prop

    return [
        ("yours == per-head reference (MHA)", against_reference(False), ("mha",), False),
        ("yours == per-head reference (GQA)", against_reference(False), ("gqa",), False),
        ("yours == per-head reference (MQA)", against_reference(False), ("mqa",), False),
        ("causal: yours == reference", against_reference(True), ("mha", "gqa", "mqa"), False),
    ]


def module_properties(
    factory: Callable[..., Any], *, kv_heads: KVHeads = "grouped", atol: float | None = None
) -> list[tuple[str, Property, tuple[Kind, ...], bool]]:
    """`user_properties` for a module factory `factory(d_model, num_heads, num_kv_heads, d_head, bias)`."""
    fn, prepare = module_adapter(factory)
    return user_properties(fn, prepare, kv_heads=kv_heads, atol=atol)


def run_suite(
    *,
    device: str,
    dtype: torch.dtype,
    examples: int,
    on_example: Callable[[int], None] | None = None,
    properties: list[tuple[str, Property, tuple[Kind, ...], bool]] | None = None,
) -> list[Outcome]:
    """Run every property (default: the built-in suite) with `examples` examples; `on_example(index)` after each.

    A failure keeps its whole report (the first line says what differs; then the config, the bug
    class, the wrong heads); its `worst` is the failing example's deviation, the one the report names,
    and its `examples` count that example too.
    """
    outcomes = []
    for index, (name, prop, kinds, cross) in enumerate(PROPERTIES if properties is None else properties):
        outcome = Outcome(name, tolerance=tolerance(dtype))

        def seen(deviation: float, outcome: Outcome = outcome, index: int = index) -> None:
            outcome.examples += 1
            outcome.worst = max(outcome.worst, deviation)
            if on_example is not None:
                on_example(index)

        def check(config: AttentionConfig, data: Any, prop: Property = prop) -> float:
            return prop(config, data, device, dtype)

        try:
            run_property(check, kinds=kinds, max_examples=examples, on_example=seen, cross=cross)
        except AssertionError as error:
            outcome.failure = str(error)
            outcome.examples += 1
            deviation = error.deviation if isinstance(error, FailedCheckError) else None
            outcome.worst = float("nan") if deviation is None else deviation
        outcomes.append(outcome)
    return outcomes
