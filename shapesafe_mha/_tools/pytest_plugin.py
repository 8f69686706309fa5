"""pytest plugin (entry point `pytest11`): hypothesis profiles and a `--shapesafe-device` option.

Profiles `ci` (50 examples, derandomized, no explain phase), `dev` (100) and `thorough` (1000), all without
deadlines (first calls of torch kernels are slow), and `mutation`: `ci` without shrinking, for a mutation run,
where a failing example only has to fail (shrinking one cost up to 80 s a mutant). Select one with hypothesis'
`--hypothesis-profile NAME`.
`--shapesafe-device cuda` makes the `shapesafe_device` fixture return that device, so a suite's
properties run on a GPU unchanged.
"""

import importlib.util

import pytest

PROFILES = {"ci": 50, "dev": 100, "thorough": 1000, "mutation": 50}

# The plugin loads wherever shapesafe_mha is installed; hypothesis is optional.
if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import HealthCheck, Phase, settings

    _FIXED = ("ci", "mutation")  # a fixed budget: the same examples on every run
    _PHASES = {
        "ci": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        "mutation": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
    }
    for _name, _examples in PROFILES.items():
        settings.register_profile(
            _name,
            max_examples=_examples,
            deadline=None,
            derandomize=_name in _FIXED,
            suppress_health_check=[HealthCheck.too_slow],
            phases=_PHASES.get(_name, list(Phase)),
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shapesafe-device",
        default="cpu",
        help="device for shapesafe_mha property tests (the shapesafe_device fixture): cpu, cuda, cuda:1, meta",
    )


@pytest.fixture(scope="session")
def shapesafe_device(request: pytest.FixtureRequest) -> str:
    """The device chosen with --shapesafe-device (default cpu); skips if it is CUDA and CUDA is absent."""
    device = str(request.config.getoption("--shapesafe-device"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--shapesafe-device asks for CUDA, which is not available")
    return device
