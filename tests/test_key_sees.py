"""A remembered verdict never covers a call its check would refuse.

For every property an annotation reads of an argument (its type, rank, sizes, dtype), passed by position or
by keyword, a warm callable (its verdict remembered from a good call) answers a call that changes only that
property exactly as a fresh one (never called) answers it: the same result, or the same error. Drawn over
users' decorated functions and the public stages, so a verdict key that misses one property on one route
(a keyword's dtype, a positional's type) breaks it.
"""

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from jaxtyping import Float
from torch import Tensor

import shapesafe_mha as ssm

CHANGES = ("float64", "int64", "bool", "one more axis", "one axis fewer", "another size", "a list", "a float")


def _changed(tensor: Tensor, change: str) -> Any:
    if change in ("float64", "int64", "bool"):
        return tensor.to(getattr(torch, change))
    if change == "one more axis":
        return tensor[..., None]
    if change == "one axis fewer":
        return tensor[0]
    if change == "another size":
        return torch.ones(*tensor.shape[:-1], tensor.shape[-1] + 1, dtype=tensor.dtype)
    if change == "a list":
        return tensor.tolist()
    return 1.5


def _outcome(run: Callable[[], Any]) -> tuple[str, Any]:
    try:
        out = run()
    except (ssm.ShapeError, ssm.ConfigError, TypeError, RuntimeError) as error:
        return type(error).__name__, str(error).splitlines()[0] if str(error) else ""
    return "ok", out.tolist() if isinstance(out, Tensor) else out


def _add(x: Float[Tensor, "a b"], y: Float[Tensor, "a b"]) -> Float[Tensor, "a b"]:
    return x + y


def _calls(keyword: bool) -> dict[str, Callable[[Callable[..., Any], list[Any]], Any]]:
    """Each callable under test, how it is called with its two tensors (the second by keyword, or not)."""
    if keyword:
        return {
            "decorated": lambda f, a: f(a[0], y=a[1]),
            "project": lambda f, a: f(a[0], weight=a[1]),
        }
    return {"decorated": lambda f, a: f(a[0], a[1]), "project": lambda f, a: f(a[0], a[1])}


def _fresh(name: str) -> Callable[..., Any]:
    """A callable with nothing remembered: a function decorated now; a public stage, its verdicts forgotten."""
    if name == "decorated":
        return ssm.shapecheck(_add)
    stage = ssm.project
    stage.verdicts.forget()  # pyright: ignore[reportAttributeAccessIssue]
    return stage


@given(
    name=st.sampled_from(["decorated", "project"]),
    keyword=st.booleans(),
    which=st.sampled_from([0, 1]),
    change=st.sampled_from(CHANGES),
)
def test_a_warm_callable_answers_a_call_changed_in_one_property_as_a_fresh_one(
    name: str, keyword: bool, which: int, change: str
) -> None:
    good = [torch.ones(2, 3), torch.ones(2, 3)] if name == "decorated" else [torch.ones(1, 4, 3), torch.ones(5, 3)]
    call = _calls(keyword)[name]
    changed = list(good)
    changed[which] = _changed(good[which], change)
    expected = _outcome(lambda: call(_fresh(name), changed))
    warm = _fresh(name)
    assert _outcome(lambda: call(warm, good))[0] == "ok"
    assert _outcome(lambda: call(warm, changed)) == expected, (name, keyword, which, change)
