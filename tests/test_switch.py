"""The checks switch: really off, back on, per thread, by environment; remembered verdicts never hide a mistake."""

import contextlib
import os
import subprocess
import sys
import threading

import pytest
import torch
from jaxtyping import Float
from torch import Tensor

import shapesafe_mha as ssm


def test_unchecked_really_turns_checks_off_and_back_on() -> None:
    """Inside unchecked() a wrong width reaches torch (its own error); after the block ours is back."""
    module = ssm.MultiHeadAttention(32, 4)
    wrong = torch.randn(1, 3, 30)
    with ssm.unchecked():
        assert not ssm.checks_enabled()
        with pytest.raises(RuntimeError) as caught:
            module(wrong)
        assert not isinstance(caught.value, ssm.ShapesafeError)
        with pytest.raises(RuntimeError):
            ssm.split_heads(torch.randn(1, 3, 10), 4)  # unchecked stage: torch's unflatten error
    assert ssm.checks_enabled()
    with pytest.raises(ssm.ShapeError):
        module(wrong)


def test_unchecked_is_per_thread() -> None:
    """One thread inside unchecked() does not switch checks off for another thread running at the same time."""
    inside, done = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def quiet() -> None:
        with ssm.unchecked():
            seen["quiet"] = ssm.checks_enabled()
            inside.set()
            done.wait(5)

    def loud() -> None:
        inside.wait(5)
        seen["loud"] = ssm.checks_enabled()
        try:
            ssm.split_heads(torch.randn(1, 3, 10), 4)
        except ssm.ShapeError:
            seen["loud_raised"] = True
        done.set()

    threads = [threading.Thread(target=quiet), threading.Thread(target=loud)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"quiet": False, "loud": True, "loud_raised": True}
    assert ssm.checks_enabled()


def test_environment_variable_turns_checks_off_for_the_process() -> None:
    """SHAPESAFE_MHA_UNCHECKED=1 before import: checks are off everywhere in that process."""
    code = "import shapesafe_mha as ssm; print(ssm.checks_enabled())"
    env = os.environ | {"SHAPESAFE_MHA_UNCHECKED": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


def test_a_remembered_verdict_never_hides_a_wrong_call() -> None:
    """Alternating right and wrong calls: every wrong one raises, every right one passes."""
    module = ssm.MultiHeadAttention(32, 4, 2)
    right, wrong = torch.randn(2, 5, 32), torch.randn(2, 5, 31)
    for _ in range(3):
        module(right)
        with pytest.raises(ssm.ShapeError):
            module(wrong)
        ssm.split_heads(torch.randn(2, 5, 32), 4)
        with pytest.raises(ssm.ShapeError):
            ssm.split_heads(torch.randn(2, 5, 32), 3)
        with pytest.raises(ssm.ShapeError):
            module(right.double())
        with pytest.raises(ssm.ConfigError, match="num_heads must be a positive int, but got True"):
            ssm.split_heads(torch.randn(2, 5, 32), True)  # type: ignore[arg-type]  # a bool is not a head count


def _enabled_inside(where: str, quiet: bool) -> list[bool]:
    """What `checks_enabled()` says inside a decorated function's body, called `where`: its first call (checked),
    its later calls (remembered, covering the expectation inside), or a `shape_scope`; all of it under `unchecked()`
    if `quiet`."""
    seen: list[bool] = []

    @ssm.shapecheck
    def body(x: Float[Tensor, "batch d"]) -> Float[Tensor, "batch d"]:
        seen.append(ssm.checks_enabled())
        return ssm.expect(x, "batch d")

    x = torch.randn(2, 3)
    with ssm.unchecked() if quiet else contextlib.nullcontext():
        if where == "scope":
            with ssm.shape_scope(batch=2):
                body(x)
                body(x)
        else:
            for _ in range({"first": 1, "remembered": 3}[where]):
                body(x)
    return seen


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize("where", ["first", "remembered", "scope"])
def test_checks_enabled_is_false_exactly_inside_unchecked(where: str, quiet: bool) -> None:
    """`checks_enabled()` says whether checks run now: inside a decorated call whose verdict is remembered (which
    covers the stages and expectations it calls, but not a cache's append, a module or the Hugging Face backend, which
    ask `checks_enabled()`) as anywhere, it is False inside `unchecked()` and True everywhere else."""
    seen = _enabled_inside(where, quiet)
    assert seen and all(enabled is not quiet for enabled in seen), seen


@pytest.mark.parametrize("warm", [0, 1, 2])
def test_a_cache_append_inside_a_remembered_call_is_refused_as_alone(warm: int) -> None:
    """A KVCache held outside a decorated function (its key does not hold the cache) refuses inside it, however often
    the function was checked, the append it refuses alone: k of batch 1 into a cache of batch 2 (unchecked, torch
    would broadcast it into both sequences)."""
    caches = [ssm.KVCache(2, 2, 8, 4, dtype=torch.float32)]

    @ssm.shapecheck
    def step(k: Float[Tensor, "batch num_kv_heads new d_head"]) -> Float[Tensor, "batch num_kv_heads kv_seq d_head"]:
        return caches[0].append(ssm.expect(k, "batch num_kv_heads new d_head"), k)[0]

    k = torch.randn(1, 2, 1, 4)
    caches[0] = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32)
    for _ in range(warm):
        step(k)
    caches[0] = ssm.KVCache(2, 2, 8, 4, dtype=torch.float32)
    with pytest.raises(
        ssm.ShapeError, match=r"^KVCache.append\(\): k has batch=1 \(axis 0\), but the cache set batch=2"
    ):
        ssm.KVCache(2, 2, 8, 4, dtype=torch.float32).append(k, k)
    with pytest.raises(
        ssm.ShapeError, match=r"^KVCache.append\(\): k has batch=1 \(axis 0\), but the cache set batch=2"
    ):
        step(k)
    assert len(caches[0]) == 0
