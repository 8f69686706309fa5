"""The checks switch: really off, back on, per thread, by environment; remembered verdicts never hide a mistake."""

import os
import subprocess
import sys
import threading

import pytest
import torch

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
