"""The generated mutation run's table: modules read from mutmut's names, the score as docs/contributors.md says."""

import json
import tomllib
from pathlib import Path

from tools.mkdocs_hooks import wilson
from tools.mutmut_scores import EQUIVALENT, RECORD, module_of, sample, scores

ROOT = Path(__file__).resolve().parent.parent


def test_a_mutant_belongs_to_the_module_its_name_begins_with() -> None:
    assert module_of("shapesafe_mha._compute.kernels.x_split_heads__mutmut_3") == "shapesafe_mha._compute.kernels"
    assert module_of("shapesafe_mha._compute.cache.xǁKVCacheǁappend__mutmut_12") == "shapesafe_mha._compute.cache"


def test_the_score_counts_untested_mutants_against_and_equivalent_ones_not_at_all() -> None:
    base = "shapesafe_mha._compute.rotary.x_f__mutmut_"
    equivalent = next(iter(EQUIVALENT))
    statuses = {f"{base}1": "killed", f"{base}2": "timeout", f"{base}3": "survived", f"{base}4": "no tests",
                f"{base}5": "not checked", equivalent: "survived"}  # fmt: skip
    rows = scores(statuses)
    rotary = rows["shapesafe_mha._compute.rotary"]
    assert (rotary["killed"], rotary["timeout"], rotary["survived"], rotary["no tests"]) == (1, 1, 1, 1)
    assert rotary["equivalent"] == 1 and rotary["score"] == 0.5


def test_the_record_covers_only_configured_modules() -> None:
    configured = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]
    modules = {path.removesuffix(".py").replace("/", ".") for path in configured}
    record = json.loads(RECORD.read_text())
    assert set(record["modules"]) <= modules and record["modules"]
    assert all(0.0 <= row["score"] <= 1.0 for row in record["modules"].values())


def test_a_sample_is_seeded_and_a_smaller_one_is_its_prefix() -> None:
    names = [f"shapesafe_mha._interop.hf.x_from_hf__mutmut_{n}" for n in range(1, 200)]
    drawn = sample(names, 50, seed=28)
    assert drawn == sample(list(reversed(names)), 50, seed=28)  # the order given does not matter, the seed does
    assert sample(names, 20, seed=28) == drawn[:20]  # a run stopped early is a uniform sample too
    assert len(set(drawn)) == 50 and set(drawn) <= set(names)
    assert drawn != sample(names, 50, seed=29) and drawn != sorted(drawn)


def test_a_sampled_score_comes_with_wilsons_interval() -> None:
    low, high = wilson(95, 100)  # the textbook case: 95 of 100, 95% Wilson interval 88.8% to 97.8%
    assert round(low, 4) == 0.8882 and round(high, 4) == 0.9785
    assert wilson(10, 10)[1] <= 1.0 and wilson(0, 10)[0] == 0.0  # bounded at the ends, unlike the normal one


def test_every_recorded_row_says_how_many_mutants_it_counts_of_how_many() -> None:
    record = json.loads(RECORD.read_text())
    for row in record["modules"].values():
        ran = row["killed"] + row["timeout"] + row["survived"] + row["no tests"] + row["equivalent"]
        assert row["how"] in ("all", "sample", "partial") and 0 < ran and row["generated"] > 0
        assert (row["how"] == "all") == (ran == row["generated"])  # `all` only where none is left to run
