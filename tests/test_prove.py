"""prove(): shapes proven for all sizes in a range, by torch's symbolic shapes; planted size bugs named."""

import re
from pathlib import Path

import pytest
import torch
from prove_modules import UserAttention
from torch import nn

import shapesafe_mha as ssm

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"mha": 8, "gqa": 2, "mqa": 1}
PADDING = {"key_padding_mask": lambda batch, seq: torch.zeros(batch, seq, dtype=torch.bool)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "mode",
    ["full", "causal", "need_weights", "key_padding_mask", "decode"],
)
def test_our_module_is_proven_in_every_mode(kind: str, mode: str) -> None:
    kwargs = {"causal": {"is_causal": True}, "need_weights": {"need_weights": True}, "key_padding_mask": PADDING}
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, KINDS[kind]), decode=mode == "decode", **kwargs.get(mode, {}))
    assert proof.ok, proof.failures
    stages = {name: (named, shape) for name, named, shape in proof.stages}
    if mode != "decode":
        named, shape = stages["split_q"]
        assert named == "batch num_heads seq d_head"
        assert shape == "(batch, 8, seq, 8)"  # torch's symbols, named for the dimensions they stand for
    else:
        assert stages["cache_k"][1] == f"(batch, {KINDS[kind]}, cached + 1, 8)"


def test_each_symbol_is_named_and_the_title_says_what_was_proven() -> None:
    """The legend maps each name to torch's symbol (the one its guards print); decoding says seq is 1."""
    module = ssm.MultiHeadAttention(64, 8, 2)
    proof = ssm.prove(module, is_causal=True)
    assert set(proof.symbols) == {"batch", "seq"} and all(re.fullmatch(r"s\d+", s) for s in proof.symbols.values())
    text = str(proof)
    assert "proven for batch in [1, 64], seq in [1, 2048]" in text
    assert f"batch is torch's {proof.symbols['batch']}, seq is torch's {proof.symbols['seq']}" in text
    decoding = ssm.prove(module, decode=True)
    assert set(decoding.symbols) == {"batch", "cached"}
    assert "proven for batch in [1, 64], cached in [1, 2048], seq = 1 (one decoding step)" in str(decoding)


@pytest.mark.parametrize("sizes", [{"batch": (2, 2)}, {"seq": (7, 7)}, {"batch": (1, 2), "seq": (0, 1)}])
def test_a_range_of_one_size_is_proven_at_that_size(sizes: dict) -> None:  # type: ignore[type-arg]
    """torch cannot make a symbol of one value (nor of 0 and 1): those sizes are proven concretely."""
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2), is_causal=True, **sizes)
    assert proof.ok, proof.failures
    assert proof.stages and not set(proof.symbols) & set(sizes)


def test_rope_is_proven_too() -> None:
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2, rope_theta=10000.0), is_causal=True)
    assert proof.ok, proof.failures
    assert "rotary_q" in [name for name, _, _ in proof.stages]


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize(
    "options",
    [{"rope_theta": 10000.0}, {"rope_theta": 10000.0, "qk_norm": True, "window": 16, "logit_softcap": 30.0},
     {"alibi": True}],
    ids=["rope", "every-variant", "alibi"],
)  # fmt: skip
def test_rope_and_the_variants_are_proven_for_prefill_and_decoding(options: dict, decode: bool) -> None:  # type: ignore[type-arg]
    """The sliding window's mask is built for every size under export, so no guard on seq > window;
    decoding's positions start at the cache's symbolic length; ALiBi's biases are built for every seq and kv_seq."""
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2, **options), is_causal=True, decode=decode)
    assert proof.ok, proof.failures
    if options.get("alibi"):
        named = {name: named for name, named, _ in proof.stages}
        assert named["alibi"] == "num_kv_heads group*seq kv_seq"


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_latent_attention_is_proven_with_its_latent_cache(decode: bool) -> None:
    mla = ssm.LatentAttention(64, 8, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
    proof = ssm.prove(mla, is_causal=True, decode=decode)
    assert proof.ok, proof.failures
    stages = {name: (named, shape) for name, named, shape in proof.stages}
    named, shape = stages["cache_latent" if decode else "latent"]
    assert named == ("batch kv_seq kv_lora_rank" if decode else "batch seq kv_lora_rank")
    assert shape == ("(batch, cached + 1, 16)" if decode else "(batch, seq, 16)")


def test_a_correct_user_module_is_proven() -> None:
    proof = ssm.prove(UserAttention())
    assert proof.ok, proof.failures
    assert proof.stages[-1][0] == "output"


@pytest.mark.parametrize(
    ("bug", "dimension"),
    [("view_seq", "seq"), ("view_batch", "batch"), ("truncate", "seq"), ("buffer_mask", "seq")],
)
def test_each_size_specific_bug_fails_naming_its_dimension(bug: str, dimension: str) -> None:
    proof = ssm.prove(UserAttention(bug=bug))
    assert not proof.ok
    first_lines = [failure.splitlines()[0] for failure in proof.failures]
    assert any(line.startswith(f"{dimension}: ") for line in first_lines), first_lines
    assert all(len(line) <= 240 for line in first_lines)


class _DropFirstPosition(nn.Module):
    """A projection that loses the first position: every later stage sees one position fewer than the query."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[:, 1:]


def test_a_stage_whose_plain_dimension_contradicts_an_earlier_one_is_named() -> None:
    """seq is bound by the query (1 here), and q_proj returns 0 positions under the same name: the named-shape
    check reports that stage with both sizes, though export itself raises nothing at this size."""
    module = ssm.MultiHeadAttention(64, 8)
    module.q_proj = _DropFirstPosition(module.q_proj)
    proof = ssm.prove(module, seq=(1, 1))
    assert not proof.ok
    assert "seq: q_proj has 0 at axis 1 where its annotation 'batch seq num_heads*d_head' needs 1" in proof.failures


def test_the_truncation_branch_is_located_at_its_threshold() -> None:
    proof = ssm.prove(UserAttention(bug="truncate"))
    assert any("seq <= 512" in failure for failure in proof.failures), proof.failures
    assert ssm.prove(UserAttention(bug="truncate"), seq=(1, 512)).ok  # below the branch: proven


def test_the_proof_prints_as_a_table() -> None:
    text = str(ssm.prove(ssm.MultiHeadAttention(64, 8, 2), is_causal=True))
    assert "proven for batch in [1, 64], seq in [1, 2048]" in text and "split_q" in text


def test_the_cli_proves_and_exits_by_the_outcome() -> None:
    """In this process (tests/test_cli_check.py runs the console script from a user's folder)."""
    from typer.testing import CliRunner

    from shapesafe_mha._tools.cli import app

    ok = CliRunner().invoke(app, ["prove", "--d-model", "64", "--causal"])
    assert ok.exit_code == 0 and "proven for" in ok.stdout, ok.output
    bad = CliRunner().invoke(app, ["prove", "--module", "prove_modules:view_seq"])
    assert bad.exit_code == 1 and "seq: " in bad.stdout, bad.output
