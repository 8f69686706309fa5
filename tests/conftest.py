"""Shared fixtures: hypothesis profiles and the devices every test runs on."""

import functools
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


@functools.cache
def _remembering() -> list[Any]:
    """Every verdict memo a test may leave behind: our stages' (public and the module's) and those of the
    `shapecheck`ed functions and methods of our package, the tests, the examples and the benchmarks. Listed
    once, at the first test: collection has imported every test module by then."""
    from shapesafe_mha._core.contract import Stage

    found: dict[int, Any] = {}
    roots = ("shapesafe_mha", "test", "examples", "benchmarks")
    for name, module in list(sys.modules.items()):
        if not name.startswith(roots) or module is None:
            continue
        for value in list(vars(module).values()):
            for member in [value, *(vars(value).values() if isinstance(value, type) else ())]:
                if isinstance(member, Stage):
                    found[id(member)] = member.verdicts
                contract = getattr(member, "__shapecheck__", None)
                if contract is not None and hasattr(contract, "verdicts"):
                    found[id(contract)] = contract.verdicts
    return list(found.values())


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> None:
    """Each test sees our stages and the decorated functions as a fresh process does: a call a test makes is
    checked, whatever earlier tests remembered (or, under mutmut, what its parent process remembered before
    forking the worker that runs it)."""
    for verdicts in _remembering():
        verdicts.forget()


@pytest.fixture
def patch_kernel(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`patch(name, replacement)`: replace `shapesafe_mha._compute.kernels.<name>` where the stages call it and
    where a remembered forward calls it directly (a stage's `raw`, bound when the modules were imported)."""
    from shapesafe_mha._compute import kernels, stages
    from shapesafe_mha._modules import latent, multihead

    def patch(name: str, replacement: Any) -> None:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, replacement)
        for module in (multihead, latent, stages):
            for namespace in vars(module).values():
                if type(namespace).__name__ == "SimpleNamespace":
                    for key, value in vars(namespace).items():
                        if value is original:
                            monkeypatch.setattr(namespace, key, replacement)

    return patch
