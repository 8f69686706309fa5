"""Checks for the code users write: `@shapecheck`, `expect`, `shape_scope` and the public `dims`.

A catalogue of mistakes in users' own attention code, each a ShapeError whose first line names the
user's function, the argument (or the result, or the expectation), the dimension, the axis and both
sizes; sizes bound by int arguments, a module's attributes and scopes; nesting; the call forms a
decorator must keep (methods, keyword-only, defaults, *args, classmethods, staticmethods, hooks);
torch.compile without graph breaks or recompiles; and the switch that turns it all off.
"""

import functools
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

import shapesafe_mha as ssm
from shapesafe_mha.dims import DIMS, Heads, KVHeads, Probabilities, QueryInner, Tokens

ROOT = Path(__file__).resolve().parent.parent


def first_line(run: Callable[[], Any]) -> str:
    with pytest.raises(ssm.ShapeError) as caught:
        run()
    return str(caught.value).splitlines()[0]


# --- the users' functions the catalogue calls ------------------------------------------------------------


@ssm.shapecheck
def apply_temperature(q: Heads, log_temp: Float[Tensor, " num_heads"]) -> Heads:
    return q * log_temp.exp()[:, None, None]


@ssm.shapecheck
def merge_without_transpose(x: Heads) -> QueryInner:
    return x.flatten(2)  # the bug: should be x.transpose(1, 2).flatten(2)


@ssm.shapecheck
def attend_without_output_projection(x: Tokens, w_qkv: Float[Tensor, "three_inner d_model"], num_heads: int) -> Tokens:
    q, k, v = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in (x @ w_qkv.T).chunk(3, dim=-1))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2)  # the bug: o_proj forgotten (inner width 48, d_model 64)


@ssm.shapecheck
def causal_mask(q: Heads, k: KVHeads) -> Bool[Tensor, "seq kv_seq"]:
    return torch.ones(k.shape[2], q.shape[2], dtype=torch.bool).tril()  # the bug: built (kv_seq, seq)


@ssm.shapecheck
def to_heads(x: Float[Tensor, "batch seq num_heads d_head"], num_heads: int) -> Heads:
    return x.transpose(1, 2)


@ssm.shapecheck
def scores_of(q: Heads, k: KVHeads) -> Probabilities:
    scores = ssm.expect(q @ q.mT, "batch num_heads seq kv_seq", name="scores")  # the bug: q @ q, not q @ k
    return scores.softmax(-1)


@ssm.shapecheck
def pooled(x: Tokens) -> Float[Tensor, "batch d_model"]:
    return x.mean(-1)  # the bug: pools over d_model, not seq


@ssm.shapecheck
def cross_attend(text: Float[Tensor, "batch text d_model"], patches: Float[Tensor, "batch patches d_model"]) -> Float[
    Tensor, "batch text d_model"
]:
    weights = (patches @ text.mT).softmax(-1)  # the bug: patches attend to text, not text to patches
    return weights @ text


@ssm.shapecheck
def concat_heads(*heads: Float[Tensor, "batch seq d_head"]) -> Float[Tensor, "batch seq d_inner"]:
    return torch.cat(heads, dim=-1)


@ssm.shapecheck
def padding_scores(scores: Probabilities, *, padding: Bool[Tensor, "batch kv_seq"]) -> Probabilities:
    return scores.masked_fill(padding[:, None, None], 0.0)


class GroupedAttention(nn.Module):
    """A user's GQA layer: its sizes are attributes, so the checks hold its inputs to them."""

    def __init__(self, d_model: int = 64, num_heads: int = 8, num_kv_heads: int = 2) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.d_head = d_model // num_heads
        self.q_proj = nn.Linear(d_model, num_heads * self.d_head)
        self.kv_proj = nn.Linear(d_model, 2 * num_kv_heads * self.d_head)
        self.o_proj = nn.Linear(num_heads * self.d_head, d_model)

    @ssm.shapecheck
    def forward(self, x: Tokens) -> Tokens:
        q = ssm.split_heads(self.q_proj(x), self.num_heads)
        k, v = (ssm.split_heads(t, self.num_kv_heads) for t in self.kv_proj(x).chunk(2, dim=-1))
        k = ssm.expect(k, KVHeads, name="keys")
        out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(ssm.merge_heads(out))

    @ssm.shapecheck
    def attend(self, q: Heads, k: KVHeads) -> Probabilities:
        return (q.unflatten(1, (self.num_kv_heads, -1)) @ k[:, :, None].mT).flatten(1, 2).softmax(-1)


CATALOGUE: dict[str, tuple[Callable[[], Any], str]] = {
    "a per-head parameter with the wrong number of heads": (
        lambda: apply_temperature(torch.randn(2, 6, 5, 8), torch.randn(2)),
        r"apply_temperature\(\): log_temp has num_heads=2 \(axis 0\), but q set num_heads=6\.",
    ),
    "a forgotten transpose before the merge": (
        lambda: merge_without_transpose(torch.randn(2, 6, 5, 8)),
        r"merge_without_transpose\(\): the result has seq=6 \(axis 1\), but x set seq=5\.",
    ),
    "a forgotten output projection": (
        lambda: attend_without_output_projection(torch.randn(2, 5, 64), torch.randn(144, 64), 6),
        r"attend_without_output_projection\(\): the result has d_model=48 \(axis 2\), but x set d_model=64\.",
    ),
    "a mask built (kv_seq, seq)": (
        lambda: causal_mask(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8)),
        r"causal_mask\(\): the result has seq=7 \(axis 0\), but q set seq=5\.",
    ),
    "an int argument that disagrees with a tensor": (
        lambda: to_heads(torch.randn(2, 5, 6, 8), num_heads=4),
        r"to_heads\(\): x has num_heads=6 \(axis 2\), but the argument num_heads set num_heads=4\.",
    ),
    "a module attribute that disagrees with an input": (
        lambda: GroupedAttention()(torch.randn(2, 5, 60)),
        r"GroupedAttention\.forward\(\): x has d_model=60 \(axis 2\), but the module set d_model=64\.",
    ),
    "an expect that disagrees with an argument": (
        lambda: scores_of(torch.randn(1, 4, 5, 8), torch.randn(1, 4, 7, 8)),
        r"scores_of\(\): scores has kv_seq=5 \(axis 3\), but k set kv_seq=7\.",
    ),
    "a result of the wrong shape": (
        lambda: pooled(torch.randn(2, 5, 64)),
        r"pooled\(\): the result has d_model=5 \(axis 1\), but x set d_model=64\.",
    ),
    "cross-attention the wrong way round": (
        lambda: cross_attend(torch.randn(2, 5, 16), torch.randn(2, 9, 16)),
        r"cross_attend\(\): the result has text=9 \(axis 1\), but text set text=5\.",
    ),
    "one of *args with another head width": (
        lambda: concat_heads(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)),
        r"concat_heads\(\): heads\[2\] has d_head=4 \(axis 2\), but heads\[0\] set d_head=8\.",
    ),
    "a keyword-only padding mask one key short": (
        lambda: padding_scores(torch.rand(2, 4, 5, 7), padding=torch.zeros(2, 6, dtype=torch.bool)),
        r"padding_scores\(\): padding has kv_seq=6 \(axis 1\), but scores set kv_seq=7\.",
    ),
    "a float mask where a bool one is annotated": (
        lambda: padding_scores(torch.rand(2, 4, 5, 7), padding=torch.zeros(2, 7)),
        r"padding_scores\(\): padding has dtype float32, but it must be bool\.",
    ),
    "keys with the wrong number of KV heads for the module": (
        lambda: GroupedAttention().attend(torch.randn(1, 8, 5, 8), torch.randn(1, 4, 5, 8)),
        r"GroupedAttention\.attend\(\): k has num_kv_heads=4 \(axis 1\), but the module set num_kv_heads=2\.",
    ),
    "queries and keys of different batches": (
        lambda: scores_of(torch.randn(2, 4, 5, 8), torch.randn(3, 4, 5, 8)),
        r"scores_of\(\): k has batch=3 \(axis 0\), but q set batch=2\.",
    ),
}


@pytest.mark.parametrize("mistake", CATALOGUE)
def test_a_mistake_in_users_code_is_named_on_the_first_line(mistake: str) -> None:
    """Function, argument or result or expectation, dimension, axis, both sizes, and who set the other."""
    run, expected = CATALOGUE[mistake]
    assert len(CATALOGUE) >= 12
    line = first_line(run)
    assert re.fullmatch(expected, line), line


def test_the_same_calls_done_right_pass() -> None:
    assert apply_temperature(torch.randn(2, 6, 5, 8), torch.randn(6)).shape == (2, 6, 5, 8)
    assert to_heads(torch.randn(2, 5, 6, 8), num_heads=6).shape == (2, 6, 5, 8)
    assert GroupedAttention()(torch.randn(2, 5, 64)).shape == (2, 5, 64)
    assert concat_heads(torch.randn(2, 5, 8), torch.randn(2, 5, 8)).shape == (2, 5, 16)
    assert padding_scores(torch.rand(2, 4, 5, 7), padding=torch.zeros(2, 7, dtype=torch.bool)).shape == (2, 4, 5, 7)


def test_a_remembered_verdict_still_rejects_a_new_wrong_call() -> None:
    """Verdicts are per exact signature: right calls repeated run unchecked, a new wrong one is caught."""
    q = torch.randn(2, 6, 5, 8)
    for _ in range(3):
        apply_temperature(q, torch.randn(6))
    assert "log_temp has num_heads=3" in first_line(lambda: apply_temperature(q, torch.randn(3)))



@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(lambda: (np.ones((2, 6, 5, 8), dtype=np.float32), torch.randn(6)), id="a numpy array"),
        pytest.param(lambda: (torch.randn(2, 6, 5, 8), None), id="None"),
        pytest.param(lambda: (torch.randn(2, 6, 5, 8).long(), torch.randn(6)), id="an int tensor"),
        pytest.param(lambda: (torch.randn(2, 6, 5, 8), torch.randn(6, 1)), id="another rank"),
    ],
)
def test_a_remembered_verdict_admits_only_tensors_of_the_same_shapes_and_dtypes(wrong: Callable[[], Any]) -> None:
    """A function of tensors only is keyed on its tensors' shapes and dtypes: after a right call is remembered,
    a value of the same shape that is no tensor, a missing one, another dtype or rank is still checked."""
    q = torch.randn(2, 6, 5, 8)
    for _ in range(2):
        apply_temperature(q, torch.randn(6))
    with pytest.raises(ssm.ShapeError, match=r"^apply_temperature\(\): (q|log_temp) "):
        apply_temperature(*wrong())


@ssm.shapecheck
def with_pair(x: Float[Tensor, " d"], pair: tuple[Float[Tensor, " d"], int]) -> Float[Tensor, " d"]:
    return x * pair[1]


@ssm.shapecheck
def with_array(x: Float[Tensor, " d"], pair: tuple[Float[np.ndarray, " d"], int]) -> Float[Tensor, " d"]:
    return x


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ((torch.ones(4), 2), "pair[0] has d=4 (axis 0), but x set d=3."),
        ((torch.ones(3), "2"), "pair[1] must be int, but got str '2'."),
        ((torch.ones(3),), "pair must be a tuple of 2, but got a tuple of 1."),
    ],
)
def test_a_tuple_argument_is_explained_by_the_part_that_fails(pair: tuple[Any, ...], message: str) -> None:
    """A tuple annotation is explained part by part: the index, and the dimension against the call's."""
    with_pair(torch.ones(3), (torch.ones(3), 2))
    assert first_line(lambda: with_pair(torch.ones(3), pair)) == f"with_pair(): {message}"


def test_a_value_whose_signature_is_unknown_inside_a_tuple_is_checked_every_call() -> None:
    """A numpy array inside a tuple has no signature of ours: the call is never remembered, so a wrong one after
    right ones is still caught (a tuple's unknown part once hid inside its signature, and was remembered)."""
    for _ in range(2):
        with_array(torch.ones(3), (np.ones(3, dtype=np.float32), 1))
    with pytest.raises(ssm.ShapeError, match=r"^with_array\(\): pair does not satisfy"):
        with_array(torch.ones(3), (np.ones(4, dtype=np.float32), 1))


@ssm.shapecheck
def double_parameter(weight: Float[nn.Parameter, "d_out d_in"]) -> Float[Tensor, "d_out d_in"]:
    return weight * 2


def test_a_remembered_verdict_for_a_parameter_admits_no_plain_tensor() -> None:
    """An annotation over a Tensor subclass reads the value's type: a verdict for an `nn.Parameter` is no
    verdict for a plain tensor of the same shape."""
    for _ in range(2):
        double_parameter(nn.Parameter(torch.ones(3, 4)))
    assert "weight does not satisfy" in first_line(lambda: double_parameter(torch.ones(3, 4)))

# --- sizes bound before any tensor -----------------------------------------------------------------------


@ssm.shapecheck
def split(x: QueryInner, num_heads: int, d_head: int) -> Heads:
    return x.unflatten(-1, (num_heads, d_head)).transpose(1, 2)


class Merger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.d_head = 4, 8

    @ssm.shapecheck
    def forward(self, x: Heads) -> QueryInner:
        return x.transpose(1, 2).flatten(2)

    @ssm.shapecheck
    def project_in(self, x: QueryInner) -> QueryInner:
        return x


def test_arithmetic_aliases_work_as_arguments_where_their_names_are_bound() -> None:
    """`batch seq num_heads*d_head` as an argument: bound by int arguments, by the module, or by a scope;
    unbound, a ShapeError says which names to bind (jaxtyping alone: AnnotationError)."""
    assert split(torch.randn(2, 5, 48), 6, 8).shape == (2, 6, 5, 8)
    line = first_line(lambda: split(torch.randn(2, 5, 48), 4, 8))
    assert "x has num_heads*d_head=48 (axis 2), but the argument d_head and the argument num_heads (num_heads=4" in line
    assert Merger().project_in(torch.randn(2, 5, 32)).shape == (2, 5, 32)
    assert "but the module (num_heads=4, d_head=8) set num_heads*d_head=32" in first_line(
        lambda: Merger().project_in(torch.randn(2, 5, 48))
    )

    @ssm.shapecheck
    def identity(x: QueryInner) -> QueryInner:
        return x

    assert "nothing has bound d_head, num_heads yet" in first_line(lambda: identity(torch.randn(2, 5, 48)))
    with ssm.shape_scope(num_heads=6, d_head=8):
        assert identity(torch.randn(2, 5, 48)).shape == (2, 5, 48)


@ssm.shapecheck
def inner(x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
    return x


@ssm.shapecheck
def outer(x: Float[Tensor, "batch seq d_model"], memory: Float[Tensor, "batch kv_seq d_model"]) -> Float[
    Tensor, "batch seq d_model"
]:
    inner(memory)  # its own seq is the caller's kv_seq: fine outside a scope
    return inner(x)


def test_nested_calls_keep_their_own_dimensions_outside_a_scope_and_share_them_inside() -> None:
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    assert outer(x, memory).shape == (2, 5, 16)
    with ssm.shape_scope():
        line = first_line(lambda: outer(x, memory))
    assert line == "inner(): x has seq=9 (axis 1), but x (in outer()) set seq=5."


def test_our_stages_join_a_scope() -> None:
    """Pinned: inside a scope our public stages are checked against its dimensions (and every time)."""
    with ssm.shape_scope(num_heads=8):
        assert ssm.split_heads(torch.randn(2, 5, 64), 8).shape == (2, 8, 5, 8)
        line = first_line(lambda: ssm.split_heads(torch.randn(2, 5, 64), 4))
    assert line.startswith("split_heads(): ") and "num_heads=4" in line and "shape_scope" in line
    assert ssm.split_heads(torch.randn(2, 5, 64), 4).shape == (2, 4, 5, 16)  # outside: its own dimensions


def test_scope_sizes_must_be_sizes() -> None:
    with pytest.raises(ssm.ConfigError, match=r"shape_scope\(\): num_heads must be a non-negative int"):
        with ssm.shape_scope(num_heads=2.5):  # type: ignore[arg-type]
            pass


def test_expect_checks_alone_outside_any_call() -> None:
    assert ssm.expect(torch.zeros(2, 8, 5, 5), "batch num_heads seq seq").shape == (2, 8, 5, 5)
    line = first_line(lambda: ssm.expect(torch.zeros(2, 8, 5, 6), "batch num_heads seq seq", name="scores"))
    assert line == "expect(): scores has seq=6 (axis 3), but scores set seq=5."


# --- the call forms --------------------------------------------------------------------------------------


class Forms:
    num_heads = 4

    @classmethod
    @ssm.shapecheck
    def made(cls, x: Heads) -> Heads:
        return x

    @staticmethod
    @ssm.shapecheck
    def static(x: Heads, scale: float = 1.0) -> Heads:
        return x * scale

    @ssm.shapecheck
    @classmethod
    def made_outer(cls, x: Heads) -> Heads:
        return x


def test_classmethods_staticmethods_defaults_and_hooks_work() -> None:
    x = torch.randn(1, 4, 3, 8)
    assert Forms.made(x).shape == Forms.static(x).shape == Forms.made_outer(x).shape == x.shape
    torch.testing.assert_close(Forms.static(x, scale=2.0), 2 * x)  # a default overridden by keyword
    seen: list[tuple[int, ...]] = []

    @ssm.shapecheck
    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Tokens) -> None:
        seen.append(tuple(output.shape))

    layer = nn.Linear(16, 16)
    layer.register_forward_hook(hook)
    layer(torch.randn(2, 3, 16))
    assert seen == [(2, 3, 16)]
    with pytest.raises(ssm.ShapeError, match=r"hook\(\): output must be 3-D"):
        layer(torch.randn(2, 16))


def test_decorating_what_has_no_shape_to_check_is_a_config_error() -> None:
    def plain(x: int, y: Tensor) -> Tensor:
        return y

    with pytest.raises(ssm.ConfigError, match=r"shapecheck: .*plain has no shape annotation to check"):
        ssm.shapecheck(plain)


def test_decorating_an_async_or_generator_function_is_a_config_error() -> None:
    """Their call returns a coroutine or a generator before the body runs: there is no result to check, and
    checking one would blame the user for a coroutine that is no tensor."""

    async def attend_later(x: Tokens) -> Tokens:
        return x

    def attend_each(x: Tokens) -> Tokens:
        yield x

    with pytest.raises(ssm.ConfigError, match=r"^shapecheck: .*attend_later is an async function, whose call"):
        ssm.shapecheck(attend_later)
    with pytest.raises(ssm.ConfigError, match=r"^shapecheck: .*attend_each is a generator function, whose call"):
        ssm.shapecheck(attend_each)


@ssm.shapecheck
def forgets_to_unpack(x: Tokens) -> Tokens:
    return (x,)


def test_a_result_that_is_no_tensor_is_named_without_a_conversion_to_suggest() -> None:
    """A result of the wrong kind is the function's own doing: no `torch.as_tensor(the result)` to suggest."""
    line = first_line(lambda: forgets_to_unpack(torch.ones(1, 2, 8)))
    assert line == "forgets_to_unpack(): the result must be a torch.Tensor, but got tuple."


def test_the_switch_turns_the_checks_off() -> None:
    wrong = (torch.randn(2, 6, 5, 8), torch.randn(2))
    with ssm.unchecked():
        with pytest.raises(RuntimeError):  # torch's own broadcasting error: no check ran
            apply_temperature(*wrong)
        ssm.expect(torch.zeros(2, 3), "batch batch")
    code = (
        "import torch, shapesafe_mha as ssm\n"
        "print(ssm.expect(torch.zeros(2, 3), 'batch batch').shape)\n"
    )
    env = {"SHAPESAFE_MHA_UNCHECKED": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert "torch.Size([2, 3])" in out.stdout


def test_dims_lists_every_name_with_its_meaning() -> None:
    assert DIMS["num_kv_heads"].startswith("key/value heads") and DIMS["group"].startswith("query heads per KV head")
    assert all(isinstance(meaning, str) and meaning for meaning in DIMS.values())
    assert ssm.dims.Tokens is Tokens  # the namespace is reachable from the package as well


# --- torch.compile ---------------------------------------------------------------------------------------


def test_compile_fullgraph_without_graph_breaks_or_recompiles() -> None:
    """A decorated function and a module with a decorated forward: equal to eager, no graph break, and one
    compilation serves 5 calls of one shape."""
    torch._dynamo.reset()
    module = GroupedAttention().eval()
    x = torch.randn(2, 5, 64)
    for target, args in ((apply_temperature, (torch.randn(2, 6, 5, 8), torch.randn(6))), (module, (x,))):
        explained = torch._dynamo.explain(target)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(target, fullgraph=True, backend="eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled(*args), target(*args))
            counts_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for _ in range(5):
                compiled(*args)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == counts_before


def test_pyright_accepts_a_user_module_that_uses_the_decorator_expect_and_aliases() -> None:
    """The decorated functions keep their signatures for type checkers (standard mode, zero errors)."""
    example = ROOT / "examples" / "checked_attention.py"
    result = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable, str(example)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert '"errorCount": 0' in result.stdout, result.stdout[-2000:]
    runs = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "torch.Size([2, 10, 64])" in runs.stdout


# --- static proofs of users' annotations -----------------------------------------------------------------


@ssm.shapecheck
def grouped_attend(q: Heads, k: KVHeads, v: KVHeads, cut: int = 0) -> Heads:
    if cut and k.shape[2] > cut:  # a planted size-specific branch, in the helper
        k, v = k[:, :, :cut], v[:, :, :cut]
    scores = ssm.expect(q.unflatten(1, (k.shape[1], -1)) @ k[:, :, None].mT, "batch num_kv_heads group seq kv_seq",
                        name="scores")  # fmt: skip
    return (scores.softmax(-1) @ v[:, :, None]).flatten(1, 2)


class ProvenAttention(nn.Module):
    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads, self.d_head = 64, 8, 2, 8
        self.q_proj, self.kv_proj, self.o_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 64)
        self.bug = bug

    @ssm.shapecheck
    def forward(self, x: Tokens) -> Tokens:
        q = self.q_proj(x).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
        k, v = (t.unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2) for t in self.kv_proj(x).chunk(2, -1))
        if self.bug == "hard-coded length":
            q = q[:, :, :16]
        out = grouped_attend(q, k, v, cut=12 if self.bug == "helper branch" else 0)
        if self.bug == "wrong expectation":
            out = ssm.expect(out, "batch num_heads kv_seq d_head", name="out")
        return self.o_proj(out.transpose(1, 2).flatten(2))


def test_prove_checks_the_users_own_annotations_for_every_size() -> None:
    """A user module's decorated forward and helper, and the expectation inside, all proven symbolically."""
    proof = ssm.prove(ProvenAttention(), batch=(1, 8), seq=(1, 64))
    assert proof.ok, proof.failures
    named = {row[0]: row[1] for row in proof.stages}
    assert named["grouped_attend(): scores"] == "batch num_kv_heads group seq kv_seq"
    assert named["ProvenAttention.forward(): the result"] == "batch seq d_model"
    assert {"grouped_attend(): q", "grouped_attend(): k", "grouped_attend(): the result"} <= set(named)


@pytest.mark.parametrize(
    "bug, message",
    [
        ("hard-coded length", r"^seq: the shapes hold only where seq <= 15 .* in ProvenAttention\.forward\(\)$"),
        ("helper branch", r"^seq: the shapes hold only where seq <= 12 .* in grouped_attend\(\)$"),
    ],
)
def test_prove_names_the_users_function_and_dimension_of_a_size_specific_bug(bug: str, message: str) -> None:
    proof = ssm.prove(ProvenAttention(bug), batch=(1, 8), seq=(1, 64))
    assert not proof.ok
    assert any(re.match(message, failure) for failure in proof.failures), proof.failures


USER_MODULE_WITH_FUTURE_ANNOTATIONS = '''
from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn

import shapesafe_mha as ssm
from shapesafe_mha.dims import Heads


@ssm.shapecheck
def scale(q: Heads, t: Float[Tensor, " num_heads"]) -> Heads:
    return q * t[:, None, None]


def make_local() -> type:
    class Local(nn.Module):
        @ssm.shapecheck
        def forward(self, q: Heads) -> Local:
            return self

    return Local
'''


def test_string_annotations_are_read_from_the_module_and_a_local_name_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `from __future__ import annotations` every annotation is a string, read from the module's globals:
    they check as any other; one naming a class local to a function cannot be read, and says so at decoration."""
    (tmp_path / "future_user.py").write_text(USER_MODULE_WITH_FUTURE_ANNOTATIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import future_user  # pyright: ignore[reportMissingImports]

    assert future_user.scale(torch.ones(1, 4, 2, 3), torch.ones(4)).shape == (1, 4, 2, 3)
    line = first_line(lambda: future_user.scale(torch.ones(1, 4, 2, 3), torch.ones(3)))
    assert line == "scale(): t has num_heads=3 (axis 0), but q set num_heads=4."
    with pytest.raises(ssm.ConfigError, match=r"^shapecheck: make_local.<locals>.Local.forward's annotations cannot"):
        future_user.make_local()


@ssm.shapecheck
def first_of_many(x: Float[Tensor, " d"], parts: tuple[Float[Tensor, " d"], ...]) -> Float[Tensor, " d"]:
    return x


@ssm.shapecheck
def first_of_list(x: Float[Tensor, " d"], parts: list[Float[Tensor, " d"]]) -> Float[Tensor, " d"]:
    return x


@pytest.mark.parametrize("call", [first_of_many, first_of_list], ids=["tuple[X, ...]", "list[X]"])
def test_every_item_of_a_variadic_tuple_or_list_is_checked_every_time(call: Callable[..., Any]) -> None:
    """beartype checks one item of a `tuple[X, ...]` or `list[X]`, drawn at random: one wrong item of two passed
    about half the time, and a tuple's verdict, once remembered, admitted it for good. Every item is checked."""
    kind = tuple if call is first_of_many else list
    for _ in range(20):
        line = first_line(lambda: call(torch.ones(3), kind([torch.ones(3), torch.ones(4)])))
        assert line == f"{call.__name__}(): parts[1] has d=4 (axis 0), but x set d=3."


@ssm.shapecheck
def first_of_one(x: Float[Tensor, " d"], parts: tuple[Float[Tensor, " d"]]) -> Float[Tensor, " d"]:
    return x


def test_right_variadic_tuples_and_lists_pass_and_a_tuple_of_one_takes_one() -> None:
    """The other side of checking every item: right ones pass (of any length, again once remembered), and a
    `tuple[X]` is a tuple of exactly one."""
    for _ in range(2):
        for n in (0, 1, 3):
            assert first_of_many(torch.ones(3), tuple(torch.ones(3) for _ in range(n))).shape == (3,)
            assert first_of_list(torch.ones(3), [torch.ones(3) for _ in range(n)]).shape == (3,)
        assert first_of_one(torch.ones(3), (torch.ones(3),)).shape == (3,)
    line = first_line(lambda: first_of_one(torch.ones(3), (torch.ones(3), torch.ones(3))))
    assert line == "first_of_one(): parts must be a tuple of 1, but got a tuple of 2."


def _count_sessions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Note each session a decorated call opens (what a full check costs)."""
    from test_contract import _counting_sessions

    import shapesafe_mha._core.shapecheck as shapecheck

    return _counting_sessions(monkeypatch, shapecheck)


def test_a_decorated_call_is_checked_once_per_signature_tuples_of_ints_included() -> None:
    @ssm.shapecheck
    def pick(x: Float[Tensor, "batch seq"], where: tuple[int, int]) -> Float[Tensor, "batch seq"]:
        return x

    @ssm.shapecheck
    def scaled(x: Float[Tensor, "batch seq"]) -> Float[Tensor, "batch seq"]:
        return ssm.expect(x * 2, "batch seq")

    with pytest.MonkeyPatch.context() as monkeypatch:
        opened = _count_sessions(monkeypatch)
        for _ in range(2):
            pick(torch.zeros(2, 3), (0, 1))
            scaled(torch.zeros(2, 3))
        pick(torch.zeros(2, 3), (1, 1))
    assert [o.split("(")[0].rsplit(".", 1)[-1] for o in opened] == ["pick", "scaled", "pick"], opened


def test_an_expectation_reached_only_on_a_later_call_is_still_checked() -> None:
    """A first call that made no expectation vouches for nothing an `expect` says on a later call."""

    @ssm.shapecheck
    def rows(x: Float[Tensor, "batch seq"]) -> Float[Tensor, "batch seq"]:
        if bool(x.sum() > 0):
            ssm.expect(x, "batch 4")
        return x

    rows(torch.zeros(2, 3))  # no expectation on this path
    with pytest.raises(ssm.ShapeError, match=r"^expect\(\): expectation 1 has 4=3 \(axis 1\)"):
        rows(torch.ones(2, 3))


class _Sized(nn.Module):
    """A module whose d_model is held the ways a module holds a size: set on the instance, a class constant, a
    property, or forwarded by a `__getattr__` of its own (to a config)."""

    def __init__(self, how: str, d_model: int) -> None:
        super().__init__()
        self.how, self.config = how, {"d_model": d_model}
        if how == "instance":
            self.d_model = d_model

    @ssm.shapecheck
    def forward(self, x: Float[Tensor, "batch d_model"]) -> Float[Tensor, "batch d_model"]:
        return x


class _Constant(_Sized):
    d_model = 8


class _Property(_Sized):
    @property
    def size(self) -> int:  # (a property named like no dimension is never read)
        return 0

    @property
    def d_model(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.config["d_model"]


class _Forwarded(_Sized):
    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config", {})
        return config[name] if name in config else super().__getattr__(name)


@pytest.mark.parametrize(
    "module",
    [_Sized("instance", 8), _Constant("class", 8), _Property("property", 8), _Forwarded("forwarded", 8)],
    ids=lambda m: m.how,
)
def test_a_method_s_sizes_on_self_bind_however_the_module_holds_them(module: nn.Module) -> None:
    """`self.d_model` binds `d_model` whether the instance holds it, its class, a property or its own `__getattr__`
    (read without nn.Module's exception for the names it does not hold): a wrong width is refused, checked fresh
    and after a right call was remembered, and the size is in the key (another module's is checked again)."""
    with pytest.raises(ssm.ShapeError, match=r"x has d_model=6 \(axis 1\), but the module set d_model=8"):
        module(torch.zeros(2, 6))
    assert module(torch.zeros(2, 8)).shape == (2, 8)
    with pytest.raises(ssm.ShapeError, match=r"x has d_model=6 \(axis 1\), but the module set d_model=8"):
        module(torch.zeros(2, 6))
    if isinstance(module, _Constant):
        return
    wider = type(module)(module.how, 6)
    assert wider(torch.zeros(2, 6)).shape == (2, 6)
    with pytest.raises(ssm.ShapeError, match=r"but the module set d_model=6"):
        wider(torch.zeros(2, 8))


@ssm.shapecheck
def seven_heads(x: Float[Tensor, "batch seq d_model"], num_heads: int) -> Float[Tensor, "batch seq d_model"]:
    b, s, _ = x.shape
    heads = ssm.expect(x.view(b, s, 7, -1).transpose(1, 2), "batch num_heads seq d_head")
    return heads.transpose(1, 2).reshape(b, s, -1)


class _SevenHeads(nn.Module):
    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    @ssm.shapecheck
    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        b, s, _ = x.shape
        heads = ssm.expect(x.view(b, s, 7, -1).transpose(1, 2), "batch num_heads seq d_head")
        return heads.transpose(1, 2).reshape(b, s, -1)


def _verdict(call: Callable[[], Any]) -> str:
    try:
        call()
    except ssm.ShapeError as failure:
        return str(failure).splitlines()[0]
    return "passes"


@pytest.mark.parametrize("where", ["argument", "module"])
def test_expect_binds_int_arguments_and_self_sizes_as_an_annotation_would_warm_or_fresh(where: str) -> None:
    """A name an `expect` uses and no annotation does is bound by what would bind it in an annotation (an int
    argument so named, else an int attribute of `self`): a tensor of 7 heads is refused where num_heads is 4,
    the first call and every remembered one alike (warm equals fresh, whatever came before)."""
    x = torch.zeros(2, 10, 21)
    if where == "argument":
        contract = seven_heads.__shapecheck__  # pyright: ignore[reportFunctionMemberAccess]
        modules = {h: functools.partial(seven_heads, x, num_heads=h) for h in (7, 4)}
    else:
        contract = _SevenHeads.forward.__shapecheck__  # pyright: ignore[reportFunctionMemberAccess]
        modules = {h: functools.partial(_SevenHeads(h), x) for h in (7, 4)}
    expected = {
        7: "passes",
        4: f"{contract.owner}: expectation 1 has num_heads=7 (axis 1), but "
        + ("the argument num_heads" if where == "argument" else "the module")
        + " set num_heads=4.",
    }
    for heads in (4, 7, 7, 4, 7, 4, 4):
        assert _verdict(modules[heads]) == expected[heads], heads  # warm: after whatever came before
        contract.verdicts.forget()
        assert _verdict(modules[heads]) == expected[heads], heads  # fresh


# --- a remembered call covers what it checked inside --------------------------------------------------------


def _gqa_layer(heads: dict[str, int]) -> Callable[..., Tensor]:
    """A user's layer composed of our public stages; `heads` is read at each call (state its key does not hold)."""

    @ssm.shapecheck
    def layer(x: Tokens, w_q: Float[Tensor, "d_q d_model"], w_kv: Float[Tensor, "d_kv d_model"]) -> Tokens:
        q = ssm.split_heads(ssm.project(x, w_q), heads["q"])
        k = ssm.split_heads(ssm.project(x, w_kv), heads["kv"])
        return ssm.merge_heads(ssm.scaled_dot_product_attention(q, k, k, is_causal=True))

    return layer


def test_a_remembered_call_covers_the_public_stages_it_calls() -> None:
    """Once a decorated function's call is checked, a call with arguments of the same shapes computes no key for the
    stages it covers, only for a stage with a plan (SDPA: its remembered plan, found by its key, costs less than
    its function), and equals the same composition undecorated; outside it, each stage keys itself."""
    import shapesafe_mha._core.contract as contract

    heads = {"q": 8, "kv": 2}
    layer = _gqa_layer(heads)
    x, w_q, w_kv = torch.randn(2, 5, 64), torch.randn(64, 64), torch.randn(16, 64)
    first = layer(x, w_q, w_kv)
    keys: list[int] = []
    real = contract.signature_key
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(contract, "signature_key", lambda *a: keys.append(1) or real(*a))
        again = layer(x, w_q, w_kv)
        assert len(keys) == sum(1 for s in (ssm.split_heads, ssm.scaled_dot_product_attention) if s.plan is not None)
        keys.clear()
        plain = layer.__wrapped__(x, w_q, w_kv)  # type: ignore[attr-defined]
        assert len(keys) == 6  # the same stages, bare: each its own key
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(plain, first)


def _split_by(heads: dict[str, int]) -> Callable[[Tensor], Tensor]:
    @ssm.shapecheck
    def split(x: Tokens) -> Float[Tensor, "batch 8 seq d_head"]:
        return ssm.split_heads(x, heads["q"])

    return split


@pytest.mark.parametrize(
    ("make", "wrong", "starts"),
    [
        (_gqa_layer, {"q": 8, "kv": 3}, "split_heads(): x has width 16"),  # torch fails: checked again, explained
        # no failure, another result: checked in full from then on
        (_split_by, {"q": 4}, "_split_by.<locals>.split(): the result has 8=4"),
    ],
)
def test_a_covered_call_that_goes_wrong_is_refused_as_a_fresh_call_would_be(
    make: Callable[[dict[str, int]], Callable[..., Tensor]], wrong: dict[str, int], starts: str
) -> None:
    """What the key does not hold (here a global the body reads) can change a covered call. Either torch fails, and
    the call is checked again to explain it, or the result's shape changes, and the function is checked in full
    from then on: the message is a fresh function's either way, never a raw torch error or a wrong result."""
    x, w_q, w_kv = torch.randn(2, 5, 64), torch.randn(64, 64), torch.randn(16, 64)
    args = (x, w_q, w_kv) if make is _gqa_layer else (x,)
    heads = {"q": 8, "kv": 2}
    warm = make(heads)
    warm(*args)
    warm(*args)
    heads.update(wrong)
    warm_line = first_line(lambda: warm(*args))
    assert warm_line == first_line(lambda: make(dict(heads))(*args))
    assert warm_line.startswith(starts), warm_line
    assert first_line(lambda: warm(*args)) == warm_line  # and again


def test_a_decorated_method_inside_a_covered_call_keeps_its_own_verdict() -> None:
    """A method's body reads `self`, which its caller's key does not hold: called inside a covered call it is
    checked as it would be alone (its result compared with its checked call's)."""

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        @ssm.shapecheck
        def forward(self, x: Float[Tensor, "batch d"]) -> Float[Tensor, "batch d"]:
            return x @ self.weight

    mix = Mix()

    @ssm.shapecheck
    def total(x: Float[Tensor, "batch d"]) -> Float[Tensor, " batch"]:
        return mix(x).sum(-1)  # its result's shape is the same whatever the method returns

    x = torch.randn(3, 8)
    total(x)
    total(x)
    mix.weight = nn.Parameter(torch.randn(8, 5))
    line = first_line(lambda: total(x))
    assert line.endswith("Mix.forward(): the result has d=5 (axis 1), but x set d=8."), line


class _Bottleneck(nn.Module):
    """A method whose body reads `self` (its weights) and says what it expects of them: the hidden width is d."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w_in, self.w_out = nn.Parameter(torch.randn(d, hidden)), nn.Parameter(torch.randn(hidden, d))

    @ssm.shapecheck
    def forward(self, x: Float[Tensor, "batch d"]) -> Float[Tensor, "batch d"]:
        hidden = ssm.expect(x @ self.w_in, "batch d", name="hidden")
        return hidden @ self.w_out  # the result's shape is (batch, d) whatever the hidden width


def _outcome(run: Callable[[], Any]) -> str:
    try:
        run()
    except ssm.ShapeError as failure:
        return str(failure).splitlines()[0]
    return "passes"


@pytest.mark.parametrize("warm", [0, 1, 2])
@pytest.mark.parametrize("hidden", [8, 4, 16])
def test_a_method_called_inside_a_decorated_call_is_checked_as_it_is_alone(warm: int, hidden: int) -> None:
    """Whatever its caller's verdict (not yet checked, checked, remembered and covering what it calls), a decorated
    method called inside a decorated function is checked as the same call alone: its caller's key does not hold
    `self`, so the expectations inside the method are checked again, never covered by the caller's verdict."""
    block = _Bottleneck(8, 8)

    @ssm.shapecheck
    def total(x: Float[Tensor, "batch d"]) -> Float[Tensor, " batch"]:
        return ssm.expect(block(x), "batch d").sum(-1)

    x = torch.randn(3, 8)
    for _ in range(warm):
        total(x)
    block.w_in, block.w_out = _Bottleneck(8, hidden).w_in, _Bottleneck(8, hidden).w_out
    alone = _outcome(lambda: _Bottleneck(8, hidden).forward(x))
    assert (alone == "passes") == (hidden == 8), alone
    assert _outcome(lambda: total(x)) == alone
    assert _outcome(lambda: total(x)) == alone  # and again, its verdicts now remembered
