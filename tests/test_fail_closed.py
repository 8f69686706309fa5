"""A verdict that compares numbers fails closed: NaN or inf on either side, anywhere, can only fail the check.

`NaN > tolerance` is False, so a comparison written the natural way passes NaN; each comparison that decides a
verdict (a conversion's probe, the toolkit's tolerance) is driven here with NaN and inf on each side, in one
element or all of them.
"""

import pytest
import torch

import shapesafe_mha as ssm
from shapesafe_mha._core import probe
from shapesafe_mha.testing._diagnose import Tolerance

BAD = {"NaN": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poisoned(t: torch.Tensor, value: float, everywhere: bool) -> torch.Tensor:
    t = t.clone()
    if everywhere:
        t.fill_(value)
    else:
        t.view(-1)[t.numel() // 2] = value
    return t


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("side", ["ours", "theirs", "both"])
@pytest.mark.parametrize("everywhere", [False, True], ids=["one element", "every element"])
def test_a_probe_with_a_non_finite_output_refuses_the_conversion(value: float, side: str, everywhere: bool) -> None:
    clean = {"forward": torch.randn(2, 5, 8, dtype=torch.float64)}
    ours = {k: _poisoned(v, value, everywhere) if side in ("ours", "both") else v for k, v in clean.items()}
    theirs = {k: _poisoned(v, value, everywhere) if side in ("theirs", "both") else v for k, v in clean.items()}
    with pytest.raises(ssm.ConfigError, match="NaN or inf"):
        probe.verify("from_x()", ours, theirs, source="the source")
    assert probe.verify("from_x()", clean, {k: v.clone() for k, v in clean.items()}, source="the source") == 0.0


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("side", ["got", "expected", "both"])
def test_the_toolkit_s_tolerance_never_holds_for_a_non_finite_value(value: float, side: str) -> None:
    expected = torch.randn(3, 4, dtype=torch.float64)
    got = expected.clone()
    if side in ("got", "both"):
        got = _poisoned(got, value, everywhere=False)
    if side in ("expected", "both"):
        expected = _poisoned(expected, value, everywhere=False)
    tol = Tolerance(1e-6, 1e-6)
    assert not tol.holds(got, expected)
    assert tol.holds(expected.nan_to_num(0.0, 0.0, 0.0), expected.nan_to_num(0.0, 0.0, 0.0))
