"""The pytest plugin: profiles and --shapesafe-device reach a user's suite."""

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]


def test_profiles_are_registered() -> None:
    """ci, dev and thorough exist without deadlines, with growing budgets."""
    budgets = [settings.get_profile(name).max_examples for name in ("ci", "dev", "thorough")]
    assert budgets == sorted(budgets) and budgets[0] >= 10
    assert all(settings.get_profile(name).deadline is None for name in ("ci", "dev", "thorough"))


def test_ci_has_a_fixed_budget_without_explaining_and_mutation_also_without_shrinking() -> None:
    """CI's profile: the same 50 examples every run, no deadline, no explain phase; the mutation runs' profile is
    that without shrinking (a mutant is killed by any failing example)."""
    from hypothesis import Phase

    ci, mutation = settings.get_profile("ci"), settings.get_profile("mutation")
    assert (ci.max_examples, ci.derandomize, ci.deadline) == (50, True, None)
    assert Phase.explain not in ci.phases and Phase.shrink in ci.phases
    assert set(mutation.phases) == set(ci.phases) - {Phase.shrink} and mutation.max_examples == 50


def test_device_option_reaches_the_fixture(pytester: pytest.Pytester) -> None:
    """A user's test gets --shapesafe-device through the shapesafe_device fixture, and the profile applies."""
    pytester.makepyfile(
        """
        from hypothesis import given, settings, strategies as st

        def test_device(shapesafe_device):
            assert shapesafe_device == "meta"

        def test_profile():
            assert settings.default.max_examples == settings.get_profile("thorough").max_examples
        """
    )
    result = pytester.runpytest_subprocess(
        "--shapesafe-device", "meta", "--hypothesis-profile", "thorough", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
