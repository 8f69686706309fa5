"""Options at their edges: every numeric option of `AttentionConfig` has its range declared once (`RANGES`), and
at each bound, and one step past it on either side, a value is refused with a `ConfigError` that names the option,
or accepted and computed: the module built, its output finite and equal to a module rebuilt from its config.

A step is 1 for an int (its `step` for the even widths) and the next float for a number; an infinite bound is
tried itself (open: refused). Whether a value is inside is read here from the bound and its side, not asked of
the table's own check, so a comparison written wrong in the validation is a value on the wrong side.
"""

import math
from typing import Any

import pytest
import torch

import shapesafe_mha as ssm
from shapesafe_mha._modules.config import NON_NUMERIC, OPTIONS, RANGES, AttentionConfig, Range

BASE: dict[str, Any] = {"d_model": 16, "num_heads": 4, "num_kv_heads": 2}
# What an option needs around it to compute anything (a norm's options need the norm, a rotary width RoPE), and
# sizes whose other rules (a divisor, d_model's split) hold at every value tried, so only the range can refuse.
CONTEXT: dict[str, dict[str, Any]] = {
    "d_model": {"num_heads": 1, "num_kv_heads": None},
    "num_heads": {"num_kv_heads": None},
    "num_kv_heads": {"num_heads": 2},
    "rope_theta": {},
    "rope_dim": {"rope_theta": 10000.0},
    "qk_norm_offset": {"qk_norm": True},
    "norm_eps": {"qk_norm": True},
}


def _edges(edges: Range, config: AttentionConfig) -> list[tuple[Any, bool]]:
    """Each value tried, and whether it lies inside: each bound, one step below and above it."""
    tried: list[tuple[Any, bool]] = []
    for side in ("low", "high"):
        bound = edges.bound(getattr(edges, side), config)
        if bound is None:
            continue
        is_open = getattr(edges, f"{side}_open")
        if math.isinf(bound):
            tried.append((bound, not is_open))
            continue
        if edges.kind is int:
            bound = int(bound)
            below, above = bound - edges.step, bound + edges.step
        else:
            below, above = math.nextafter(bound, -math.inf), math.nextafter(bound, math.inf)
        inward = above if side == "low" else below
        outward = below if side == "low" else above
        tried += [(bound, not is_open), (inward, True), (outward, False)]
    return tried


def _cases() -> list[Any]:
    cases = []
    for name, edges in RANGES.items():
        options = {**BASE, **CONTEXT.get(name, {})}
        config = AttentionConfig(**options)
        strays: list[tuple[Any, bool]] = [(True, False), (None, edges.optional)]
        if edges.kind is float:
            strays.append((math.nan, False))
        for value, inside in _edges(edges, config) + strays:
            cases.append(pytest.param(name, options, value, inside, id=f"{name}={value!r}"))
    return cases


def test_every_option_has_a_range_or_is_declared_no_number() -> None:
    assert set(RANGES) | set(NON_NUMERIC) == set(OPTIONS)
    assert not set(RANGES) & set(NON_NUMERIC)


@pytest.mark.parametrize(("name", "options", "value", "inside"), _cases())
def test_a_value_at_or_past_an_edge_is_computed_or_refused_by_name(
    name: str, options: dict[str, Any], value: Any, inside: bool
) -> None:
    """Inside the range: accepted, and the module's output (eval and a training step) finite and the same as a
    fresh module's built from its config and state; outside: `ConfigError` naming the option and the value."""
    options = {**options, name: value}
    if not inside:
        label = RANGES[name].label or name
        with pytest.raises(ssm.ConfigError, match=rf"{label}(=| must be ).*{value!r}"):
            ssm.MultiHeadAttention(**options)
        return
    module = ssm.MultiHeadAttention(**options, dtype=torch.float64)
    assert value is None or getattr(module, name) == value  # (None: a size resolved, RoPE over the head)
    x = torch.randn(2, 5, module.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    fresh = ssm.MultiHeadAttention.from_config(module.config, dtype=torch.float64)
    fresh.load_state_dict(module.state_dict())
    for training in (False, True):
        module.train(training)
        torch.manual_seed(0)
        out = module(x, is_causal=True)
        assert out.isfinite().all(), f"{name}={value!r}: the output is not finite"
        if not training or module.dropout == 0.0:
            torch.testing.assert_close(out, fresh.train(training)(x, is_causal=True), atol=1e-12, rtol=1e-10)
