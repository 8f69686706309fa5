"""Shared fixtures: hypothesis profiles and the devices every test runs on."""

import os
import sys
from typing import Any

import pytest
import torch
from hypothesis import settings

# Profiles ci/dev/thorough come from shapesafe_mha's pytest plugin. ci is the default here, unless
# --hypothesis-profile or HYPOTHESIS_PROFILE chose another.
if settings.get_current_profile_name() == "default":
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

COMPUTE_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
    ),
]


@pytest.fixture(scope="session", params=COMPUTE_DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """A device that computes values: cpu, and cuda when present."""
    return request.param


@pytest.fixture(scope="session", params=[*COMPUTE_DEVICES, pytest.param("meta", id="meta")])
def any_device(request: pytest.FixtureRequest) -> str:
    """Every device, `meta` included, for properties of shapes, strides and storage."""
    return request.param


def _stages() -> list[Any]:
    """Every stage object of the package (public and the module's), whose verdicts live as long as the process."""
    from shapesafe_mha._core.contract import Stage

    found = {id(v): v for name, m in list(sys.modules.items()) if name.startswith("shapesafe_mha.")
             for v in vars(m).values() if isinstance(v, Stage)}  # fmt: skip
    return list(found.values())


@pytest.fixture(autouse=True)
def _fresh_stage_verdicts() -> None:
    """Each test sees our stages as a fresh process does: a call a test makes is checked, whatever earlier tests
    remembered (or, under mutmut, what its parent process remembered before forking the worker that runs it)."""
    for stage in _stages():
        stage.verdicts.forget()
