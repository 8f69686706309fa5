"""prove(): shapes proven for all sizes in a range, by torch's symbolic shapes; planted size bugs named."""

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from prove_modules import UserAttention
from torch import nn

import shapesafe_mha as ssm
from shapesafe_mha.dims import Tokens

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
    assert set(decoding.symbols) == {"batch", "cached + 1"}  # the cached positions and the one written
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


def test_a_failed_proof_prints_not_proven_its_columns_and_every_failure() -> None:
    """The title says NOT proven where a failure was found and proven (without NOT) where none; the table's columns
    are named; every failure line follows the table."""
    failed = ssm.prove(UserAttention(bug="truncate"))
    text = str(failed)
    assert "NOT proven for batch in [1, 64], seq in [1, 2048]" in " ".join(text.split())  # the title wraps
    assert re.search(r"\bstage\b.*\bnamed shape\b.*\bsymbolic shape\b", text), text
    assert failed.failures and all(failure in text for failure in failed.failures)
    assert "NOT proven" not in str(ssm.prove(UserAttention()))


class _Raises(nn.Module):
    """A module whose forward raises `error` at every size (not a size-specific bug export can place)."""

    d_model = 64

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_the_printout_is_120_columns_wide_whatever_the_terminal_and_prints_nothing_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """str() lays the proof out for 120 columns (a long failure folds there, a terminal of 80 or 300 columns
    notwithstanding), and only returns the text: nothing is written to stdout by building it."""
    proof = ssm.prove(_Raises(RuntimeError("w" * 300)))
    for columns in ("80", "300"):
        monkeypatch.setenv("COLUMNS", columns)
        text = str(proof)
        assert max(len(line) for line in text.splitlines()) == 120, columns
    assert capsys.readouterr().out == ""


def test_an_error_export_cannot_place_is_quoted_short_and_one_without_text_by_its_type() -> None:
    """The failure quotes the first 180 characters of the error's first line (a report line stays readable), or,
    where the error has no text, its type."""
    long = ssm.prove(_Raises(RuntimeError("w" * 300 + "\nthe second line")))
    quoted = [failure.split(": the module fails at some ")[1] for failure in long.failures]
    assert quoted and all(text.endswith(": " + "w" * 180) and "second" not in text for text in quoted), long.failures
    silent = ssm.prove(_Raises(RuntimeError()))
    assert silent.failures and all(failure.endswith(": RuntimeError") for failure in silent.failures), silent.failures


def test_a_failure_names_the_sizes_that_fail_and_writes_torchs_symbols_as_them() -> None:
    """A view with the sequence length written in fails with seq alone symbolic (torch's symbol for it written
    `seq`), with batch alone symbolic (`batch`), and at batch = seq = 1 (no symbol: both named)."""
    proof = ssm.prove(UserAttention(bug="view_seq"))
    named = [failure.split(": the module fails at some ")[0] for failure in proof.failures]
    assert named == ["seq", "batch", "batch or seq"], proof.failures
    assert all(
        f.startswith(f"{who}: the module fails at some {who}: ") for who, f in zip(named, proof.failures, strict=True)
    )
    assert "size 192*seq" in proof.failures[0] and "size 320*batch" in proof.failures[1], proof.failures
    assert not any(re.search(r"\bs\d+\b", failure) for failure in proof.failures), proof.failures


class _PositionTable(nn.Module):
    """A learned table of 16 positions added where the sequence belongs: the code works at seq 16 only."""

    d_model = 64

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(1, 16, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


def test_a_size_the_code_fixes_is_named_with_its_value() -> None:
    """Export specializes seq to the table's 16 positions (the example size, the range's low end): the failure says
    the code fixes seq to 16, in so many words."""
    assert ssm.prove(_PositionTable(), seq=(16, 64)).failures == [
        "seq: the code fixes seq to 16 (a view, slice or buffer of that size where seq belongs)"
    ]


def test_a_guard_is_written_without_the_ranges_own_lower_bound() -> None:
    """torch's guard `2 <= seq and seq <= 512` is the range's own bound and the branch's: only the branch is said."""
    proof = ssm.prove(UserAttention(bug="truncate"))
    assert proof.failures == [
        "seq: the shapes hold only where seq <= 512 (a branch, view or buffer that depends on seq)"
    ]


@ssm.shapecheck
def first_branch(x: Tokens) -> Tokens:
    if x.shape[1] > 30:  # each planted branch tightens the bound on seq: a guard of its own
        x = x * 2
    return x


@ssm.shapecheck
def called_branch(x: Tokens) -> Tokens:
    if x.shape[1] > 20:
        x = x * 3
    return x


@ssm.shapecheck
def branch_and_call(x: Tokens) -> Tokens:
    if x.shape[1] > 25:
        x = x * 4
    return called_branch(x)


class _Branches(nn.Module):
    """An undecorated forward with a branch of its own, then two decorated calls in turn, the second calling a third."""

    d_model = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 40:
            x = x + 1
        return branch_and_call(first_branch(x))


def test_each_size_specific_branch_is_placed_in_the_innermost_decorated_call_that_made_it() -> None:
    """Every decorated call that made a guard is named once, in the order the guards were made: a guard inside a
    nested call belongs to the nested one, not to its caller (whose name sorts first: the span decides, not the
    name); the undecorated forward's own guard to none."""
    proof = ssm.prove(_Branches())
    assert len(proof.failures) == 1, proof.failures
    assert proof.failures[0].endswith(" in first_branch(), branch_and_call(), called_branch()"), proof.failures


@pytest.mark.parametrize("kind", KINDS)
def test_a_decoding_step_that_returns_its_weights_is_proven(kind: str) -> None:
    """The weights of one query against `cached + 1` keys: unfolding them merges two axes of that length, which
    torch proves only for a plain symbol (a cache concatenated from `cached` and one more is refused by
    `min(cached + 1, 4*cached + 4) == cached + 1`, true for every size but not provable by torch)."""
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, KINDS[kind]), decode=True, need_weights=True)
    assert proof.ok, proof.failures
    assert ("weights", "batch num_heads seq kv_seq", "(batch, 8, 1, cached + 1)") in proof.stages


@pytest.mark.parametrize("kind", KINDS)
def test_attention_sinks_returning_their_weights_while_decoding_are_proven(kind: str) -> None:
    """The sinks' column makes the folded weights `cached + 2` wide, and their unfold raises a guard torch cannot
    decide (`min(cached + 2, 4*cached + 8) != cached + 1`); prove tries it at every size and finds it true."""
    module = ssm.MultiHeadAttention(64, 8, KINDS[kind], attention_sinks=True)
    proof = ssm.prove(module, decode=True, need_weights=True)
    assert proof.ok, proof.failures


def test_a_chunked_module_with_a_padding_mask_is_proven_with_its_4d_chunk_mask() -> None:
    """The chunk mask of a padded batch is `(batch, 1, seq, kv_seq)`: the stage is checked against the 4-D
    alternative of its union annotation, the one the tensor is, not the first (2-D) one."""
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2, chunk_size=8), **PADDING)
    assert proof.ok, proof.failures
    assert ("chunk_mask", "#batch #num_heads seq kv_seq", "(batch, 1, seq, seq)") in proof.stages


class _MergesAxesBesideALongerOne(nn.Module):
    """Scores over `seq + 1` keys (the input and its first position again), two head axes merged beside them."""

    d_model = 16

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(2, 4, 16))
        self.out = nn.Parameter(torch.randn(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([x, x[:, :1]], 1)
        weights = torch.einsum("hgd,bkd->bhgk", self.queries, keys).softmax(-1).flatten(1, 2)
        return weights[:, :, :-1].transpose(1, 2) @ self.out


def test_a_guard_torch_cannot_decide_is_tried_at_every_size_and_the_module_proven() -> None:
    """torch refuses `min(seq + 1, 4*seq + 4) == seq + 1` (true for every seq, beyond what it can prove); prove
    evaluates it at each size of the range, finds it true, and exports past it. A false guard is still refused."""
    proof = ssm.prove(_MergesAxesBesideALongerOne())
    assert proof.ok, proof.failures
    assert proof.stages[-1] == ("output", "batch seq d_model", "(batch, seq, 16)")


class _RefusesOneLength(nn.Module):
    d_model = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[1] != 100)
        return x * 2


def test_a_runtime_assert_left_in_the_program_is_decided_at_every_size() -> None:
    """Where torch defers a guard to a runtime assert, prove decides it for the whole range: false at seq 100."""
    from torch.export import Dim, export

    from shapesafe_mha._tools.prove import _deferred_failures

    seq = Dim("seq", min=2, max=2048)
    program = export(
        _RefusesOneLength(), (torch.randn(3, 5, 16),), dynamic_shapes={"x": {1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )  # fmt: skip
    symbol = str(next(iter(program.range_constraints)))
    assert _deferred_failures(program, {"seq": symbol}) == [
        "seq: the shapes hold only where Ne(seq, 100) (false at seq = 100: a branch, view or buffer that depends on "
        "seq)"
    ]
    assert ssm.prove(_RefusesOneLength()).failures == [
        "seq: the shapes hold only where seq != 100 (a branch, view or buffer that depends on seq)"
    ]


class _LongCacheBranch(ssm.MultiHeadAttention):
    """Doubles its output once the cache holds more than 100 positions: a branch on the cache's length."""

    def forward(self, x: torch.Tensor, *args: Any, kv_cache: Any = None, **kwargs: Any) -> torch.Tensor:
        out = super().forward(x, *args, kv_cache=kv_cache, **kwargs)
        return out * 2 if kv_cache is not None and kv_cache.keys().shape[2] > 100 else out


def test_a_branch_on_the_cache_length_is_reported_for_cached_in_its_own_terms() -> None:
    """The guard torch prints over its symbol for the cache's length, written as the title's `cached`."""
    proof = ssm.prove(_LongCacheBranch(64, 8, 2), decode=True)
    assert not proof.ok
    assert proof.failures == [
        "cached: the shapes hold only where (cached + 1) <= 100 (a branch, view or buffer that depends on cached)"
    ]


def test_decoding_passes_the_forward_keyword_arguments_on() -> None:
    """decode=True runs the step with the keyword arguments given: need_weights=True adds the weights stage, and a
    keyword LatentAttention's forward does not take is its failure."""
    module = ssm.MultiHeadAttention(64, 8, 2)
    proof = ssm.prove(module, decode=True, need_weights=True)
    assert proof.ok and "weights" in [name for name, _, _ in proof.stages], proof.failures
    mla = ssm.LatentAttention(64, 8, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
    refused = ssm.prove(mla, decode=True, need_weights=True)
    assert not refused.ok and all("unexpected keyword argument 'need_weights'" in f for f in refused.failures)


class _FailsOnlyWithBothSymbolic(nn.Module):
    """A module that raises only where batch and seq are both symbols (its message prints them)."""

    d_model = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x.shape[0], torch.SymInt) and isinstance(x.shape[1], torch.SymInt):
            raise RuntimeError(f"no kernel for {x.shape[0]} by {x.shape[1]}")
        return x


def test_a_failure_that_needs_both_sizes_symbolic_names_both() -> None:
    """Neither size fails alone (each symbolic with the other at its example size), so the failure found with both
    symbolic is the one reported, for batch or seq: no single dimension is blamed."""
    proof = ssm.prove(_FailsOnlyWithBothSymbolic())
    assert len(proof.failures) == 1, proof.failures
    assert proof.failures[0].startswith("batch or seq: the module fails at some batch or seq: no kernel for "), proof


def test_a_guard_over_batch_and_seq_is_tried_at_every_pair_of_their_ranges() -> None:
    """A guard torch could not prove that reads both sizes is accepted where it holds for every (batch, seq) in the
    ranges, and refused where one pair breaks it (batch == seq, here at batch = seq = 2)."""
    from shapesafe_mha._tools.prove import _only_guards_true_everywhere

    b, s = "L['x'].size()[0]", "L['x'].size()[1]"
    sources = {b: (2, 64), s: (2, 300)}

    def refusal(guard: str) -> Exception:
        return RuntimeError(
            'Constraints violated (batch, seq)! For more information, run with TORCH_LOGS="+dynamic".\n'
            f"  - Not all values of seq = {s} in the specified range 2 <= seq <= 300 satisfy the generated guard "
            f"{guard}.\n"
        )

    assert _only_guards_true_everywhere(refusal(f"min({b} + {s}, 4*{b} + 4*{s}) == ({b} + {s})"), sources)
    assert not _only_guards_true_everywhere(refusal(f"{b} != {s}"), sources)
    # Python's operators over the sizes, as torch prints guards: each is evaluated, not refused for its word
    for guard in (f"{b} < 2 or {s} >= 2", f"{b} >= 2 and not {s} < 2", f"max({b}, {s}) >= {s}"):
        assert _only_guards_true_everywhere(refusal(guard), sources), guard
    assert not _only_guards_true_everywhere(refusal(f"{b} >= 2 and {s} > 2"), sources)
    assert not _only_guards_true_everywhere(refusal(f"abs({b}) >= 2"), sources)  # a name not allowed: refused


@pytest.mark.parametrize(
    ("ranges", "named"),
    [({"batch": (3, 2)}, "batch=(3, 2)"), ({"seq": (-1, 4)}, "seq=(-1, 4)"), ({"batch": (1.0, 4)}, "batch=(1.0, 4)")],
)
def test_a_range_that_is_no_range_of_sizes_is_refused_naming_it(ranges: dict, named: str) -> None:  # type: ignore[type-arg]
    """An empty, negative or non-integer range is refused before anything runs, the message quoting the argument."""
    with pytest.raises(ssm.ConfigError, match=rf"^prove\(\): {re.escape(named)} is not a range of sizes"):
        ssm.prove(ssm.MultiHeadAttention(64, 8, 2), **ranges)


def test_a_module_without_d_model_needs_it_given() -> None:
    """The input width is the module's d_model, or d_model= where it has none; neither is refused by name."""
    with pytest.raises(ssm.ConfigError, match=r"^prove\(\): pass d_model="):
        ssm.prove(nn.Identity())
    assert ssm.prove(nn.Identity(), d_model=4, batch=(1, 2), seq=(1, 3)).ok


class _WrongOutput(nn.Module):
    """Returns its input reshaped one wrong way: the output's shape is the bug."""

    d_model = 16

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor, kv_cache: Any = None, is_causal: bool = False) -> torch.Tensor:
        wrong = {
            "2-D": lambda: x.sum(-1),
            "4-D": lambda: x[None],
            "narrow": lambda: x[..., :3],
            "first batch": lambda: x[:1],
            "first position": lambda: x[:, :1],
            "twice": lambda: torch.cat([x, x], 1),
        }
        return wrong[self.how]()


@pytest.mark.parametrize(
    ("how", "failure", "shape"),
    [
        ("2-D", "the output is 2-D, not (batch, seq, d_model)", "(batch, seq)"),
        ("4-D", "the output is 4-D, not (batch, seq, d_model)", "(1, batch, seq, 16)"),
        ("narrow", "d_model: the output has 3 features, not d_model=16", "(batch, seq, 3)"),
        ("first batch", "batch: the output has batch 1 whatever the input's batch", "(1, seq, 16)"),
        ("first position", "seq: the output has 1 positions, not seq", "(batch, 1, 16)"),
        ("twice", "seq: the output has 2*seq positions, not seq", "(batch, 2*seq, 16)"),
    ],
)
def test_an_output_not_batch_seq_d_model_is_the_failure_named_by_its_axis(how: str, failure: str, shape: str) -> None:
    """A module whose output is not `(batch, seq, d_model)` for every size is not proven: the failure says which axis
    is wrong and what it is instead, and the output row shows the symbolic shape."""
    proof = ssm.prove(_WrongOutput(how))
    assert (proof.ok, proof.failures) == (False, [failure])
    assert proof.stages == [("output", "batch seq d_model", shape)]


def test_a_decoding_step_must_return_one_position_of_d_model_features() -> None:
    """decode=True: a step returning two positions, or fewer features than d_model, is named for that."""
    assert ssm.prove(_WrongOutput("twice"), decode=True).failures == [
        "seq: one decoding step returns 2 positions, not 1"
    ]
    assert ssm.prove(_WrongOutput("narrow"), decode=True).failures == [
        "d_model: the output has 3 features, not d_model=16"
    ]


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_module_on_the_meta_device_is_proven_with_inputs_made_where_its_weights_are(decode: bool) -> None:
    """A layer too big to allocate can be proven on `meta`: the example inputs are made on the weights' device, so
    nothing runs on a device the module is not on."""
    module = ssm.MultiHeadAttention(64, 8, 2, device="meta")
    proof = ssm.prove(module, is_causal=True, decode=decode)
    assert proof.ok, proof.failures


class _RefusesSquareBatches(nn.Module):
    d_model = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] != x.shape[1])
        return x * 2


def test_a_runtime_assert_over_both_sizes_gives_a_counterexample_naming_each() -> None:
    """A deferred assert that reads batch and seq, false where they are equal: the failure gives the pair of sizes at
    which it fails, each by name."""
    from torch.export import Dim, export

    from shapesafe_mha._tools.prove import _deferred_failures

    dims = {"x": {0: Dim("batch", min=2, max=64), 1: Dim("seq", min=2, max=2048)}}
    program = export(
        _RefusesSquareBatches(), (torch.randn(3, 5, 16),), dynamic_shapes=dims,
        prefer_deferred_runtime_asserts_over_guards=True,
    )  # fmt: skip
    x = next(node for node in program.graph.nodes if node.op == "placeholder").meta["val"]
    (failure,) = _deferred_failures(program, {"batch": str(x.shape[0]), "seq": str(x.shape[1])})
    assert re.search(r"\(false at (seq = 2, batch = 2|batch = 2, seq = 2): a branch", failure), failure


def test_a_guard_is_tried_at_up_to_the_exhaustive_bound_of_combinations_and_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes are tried one by one where their combinations number at most the bound: at exactly the bound the guard
    is decided (true everywhere: accepted), one combination more and it is left undecided (refused)."""
    from shapesafe_mha._tools import prove as prove_module

    monkeypatch.setattr(prove_module, "_EXHAUSTIVE", 6)
    b, s = "L['x'].size()[0]", "L['x'].size()[1]"
    error = RuntimeError(
        "Constraints violated (batch, seq)!\n"
        f"  - Not all values of seq = {s} in the specified range satisfy the generated guard {b} + {s} >= 4.\n"
    )
    assert prove_module._only_guards_true_everywhere(error, {b: (2, 3), s: (2, 4)})  # 2 x 3 = 6 combinations
    assert not prove_module._only_guards_true_everywhere(error, {b: (2, 3), s: (2, 5)})  # 2 x 4 = 8


def test_a_condition_is_decided_for_every_size_with_a_counterexample_where_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_counterexample: None where the condition holds at every size of the ranges (symbolically, or size by size
    where sympy cannot decide it), the first sizes where it fails otherwise, and {} (undecided) for a symbol without a
    range or more combinations than the bound."""
    import sympy

    from shapesafe_mha._tools import prove as prove_module

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    ranges = {s0: (2, 3), s1: (2, 4)}
    assert prove_module._counterexample(sympy.Eq(sympy.Min(s0 + 1, 4 * s0 + 4), s0 + 1), {s0: (2, 2048)}) is None
    assert prove_module._counterexample(sympy.Ne(s0 * s1, 7), ranges) is None  # no product of these is 7
    assert prove_module._counterexample(sympy.Ne(s0 * s1, 6), ranges) == {"s0": 2, "s1": 3}
    assert prove_module._counterexample(sympy.Ne(s0, 5), {s1: (2, 4)}) == {}
    monkeypatch.setattr(prove_module, "_EXHAUSTIVE", 6)
    assert prove_module._counterexample(sympy.Ne(s0 * s1, 7), ranges) is None  # 6 combinations: tried
    assert prove_module._counterexample(sympy.Ne(s0 * s1, 7), {s0: (2, 3), s1: (2, 5)}) == {}  # 8: undecided


def _causal_decoding_only(base: type[nn.Module]) -> type[nn.Module]:
    """`base` refusing a decoding step that is not causal (as a causal language model may)."""

    class CausalDecodingOnly(base):  # type: ignore[valid-type,misc]
        def forward(self, *args: Any, is_causal: bool = False, kv_cache: Any = None, **kwargs: Any) -> Any:
            if kv_cache is not None and not is_causal:
                raise ValueError("a decoding step must be causal")
            return super().forward(*args, is_causal=is_causal, kv_cache=kv_cache, **kwargs)

    return CausalDecodingOnly


@pytest.mark.parametrize("kind", ["mha", "latent"])
def test_a_decoding_step_is_called_causal_unless_the_caller_says_otherwise(kind: str) -> None:
    """A decoding step of a causal model is causal: prove's step calls the module is_causal=True, or as given."""
    if kind == "latent":
        module = _causal_decoding_only(ssm.LatentAttention)(
            64, 8, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8
        )
    else:
        module = _causal_decoding_only(ssm.MultiHeadAttention)(64, 8, 2)
    assert ssm.prove(module, decode=True).ok
    refused = ssm.prove(module, decode=True, is_causal=False)
    assert refused.failures and all("a decoding step must be causal" in f for f in refused.failures), refused


def test_a_tensor_argument_with_an_axis_of_neither_size_keeps_that_axis_fixed() -> None:
    """A 4-D mask `(batch, 1, seq, seq)` given as a function of the sizes: its batch and seq axes are the symbols, its
    head axis of 1 stays 1, and the module is proven with it."""
    mask = {"attn_mask": lambda batch, seq: torch.ones(batch, 1, seq, seq, dtype=torch.bool).tril()}
    proof = ssm.prove(ssm.MultiHeadAttention(64, 8, 2), **mask)
    assert proof.ok, proof.failures


def test_a_latent_stage_is_checked_against_the_modules_own_q_lora_rank() -> None:
    """q_lora_rank is a size the module declares, which its stages must have: a module whose attribute says 12 where
    its query down-projection gives 16 is not proven, that stage named, not taken as the size's first sighting."""
    mla = ssm.LatentAttention(64, 8, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=8)
    mla.q_lora_rank = 12
    assert ssm.prove(mla).failures == [
        "q_lora_rank: q_a_proj has 16 at axis 2 where its annotation 'batch seq q_lora_rank' needs 12"
    ]


class _BufferOf64Positions(nn.Module):
    """Writes its input into a buffer of 64 positions and reads back as many as it got: right up to seq 64 only."""

    d_model = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = x.new_zeros(x.shape[0], 64, 16)
        held[:, : x.shape[1]] = x
        return held[:, : x.shape[1]]


def test_a_limit_is_said_as_torchs_suggested_range_not_as_one_of_its_guards() -> None:
    """torch guards this code with `(16*seq) != 1024` beside `seq <= 64`, and suggests `Dim('seq', max=64)`: the
    failure says where the shapes hold (seq <= 64), not "only where seq != 64", which the sizes past 64 belie."""
    assert ssm.prove(_BufferOf64Positions()).failures == [
        "seq: the shapes hold only where seq <= 64 (a branch, view or buffer that depends on seq)"
    ]
