"""Every attention class of the installed transformers gets a right verdict from check_hf_attention.

A class passes, or is refused with a ConfigError naming it and the variant or layout the reference does not
compute; it never fails on correct upstream code (a false alarm) and never crashes. The sweep is
tools/hf_classes.py, which writes docs/hf-attention-classes.md; new classes land in it without edits. Its last
column joins the whole-model sweep (tools/hf_sweep.py, docs/hf-architectures.md, kept fresh by test_hf_models.py):
the two sweeps are one table.
"""

import pytest

transformers = pytest.importorskip("transformers")

from tools import hf_classes  # noqa: E402

# The 50 classes issue 27 ran the check on (transformers 5.24): Llama as the control, 49 not in our other tests.
LISTED = (
    "Llama Gemma Starcoder2 Mixtral Qwen2Moe SmolLM3 Ministral SeedOss Phimoe Arcee OPT Gemma2 VaultGemma Gemma3 "
    "Olmo2 Olmo3 Olmoe Qwen3 Qwen3Moe Apertus Dots1 Granite GraniteMoe GptOss Cohere Cohere2 StableLm GPTNeoX Phi "
    "GPTJ Bloom BertSelf Llama4Text Helium Glm Glm4 Ernie4_5 HunYuanDenseV1 Nemotron Persimmon CodeGen GPTBigCode "
    "BitNet JetMoe Falcon GPTNeo XGLM Cwm DiffLlama Exaone4"
).split()


@pytest.fixture(scope="module")
def rows() -> list[hf_classes.Row]:
    return hf_classes.sweep()


def test_no_class_fails_or_crashes_and_every_refusal_names_its_class_and_reason(rows: list[hf_classes.Row]) -> None:
    bad = [f"{r.attention}: {'/'.join(r.verdicts)}: {r.detail}" for r in rows if r.verdict in hf_classes.BAD]
    assert not bad, "\n".join(bad)
    assert len(rows) > 150  # the census reached transformers' classes, not a handful
    # a refusal headed by another name than check_hf_attention()'s and the class's counts as a crash
    assert all(r.detail for r in rows if "refused" in r.verdicts)


def test_the_issue_s_fifty_classes_are_all_in_the_table_and_most_pass(rows: list[hf_classes.Row]) -> None:
    by_name = {r.attention: r for r in rows}
    listed = [by_name[f"{name}Attention"] for name in LISTED]
    # a pass in every implementation that computes the class: eager passes, and sdpa passes or is refused
    # because transformers' sdpa does not compute it (Gemma 2's softcap, gpt-oss's sinks, Falcon's own attention)
    passed = [r.attention for r in listed
              if r.verdicts[0] == "pass" and (r.verdicts[1] == "pass" or "under sdpa" in r.detail)]  # fmt: skip
    # 11 passed before issue 27 (the other 39 were refused, false alarms or crashes)
    assert len(passed) >= 40, passed


def test_every_class_names_the_model_types_whose_whole_model_verdict_it_shows(rows: list[hf_classes.Row]) -> None:
    whole = hf_classes.whole_models()
    assert whole["llama"] == "equal" and len(whole) > 150
    assert all(r.model_types for r in rows)
    assert {"llama4", "llama4_text"} <= set(next(r for r in rows if r.attention == "Llama4TextAttention").model_types)


def test_the_page_is_the_sweep_s_table(rows: list[hf_classes.Row]) -> None:
    page = hf_classes.PAGE.read_text()
    assert hf_classes.without_times(page) == hf_classes.without_times(hf_classes.render(rows)), (
        "docs/hf-attention-classes.md is stale: python -m tools.hf_classes --write"
    )
