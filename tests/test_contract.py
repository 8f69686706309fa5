"""One contract: the module's check is its stages' checks, on every path; a failed call changes nothing;
remembered verdicts never let a wrong call through."""

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import shapesafe_mha as ssm

F64 = {"atol": 1e-10, "rtol": 1e-8}


def test_a_mask_with_the_wrong_heads_is_a_shape_error_and_the_cache_is_unchanged() -> None:
    """(batch, 3, seq, kv_seq) for 8 heads names attn_mask and num_heads; the cache keeps its length and
    contents, and the retry decodes exactly what one causal forward computes."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(64, 8, 2, dtype=torch.float64)
    cache = module.new_cache(batch=2, capacity=8)
    prompt, step = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 1, 64, dtype=torch.float64)
    module(prompt, is_causal=True, kv_cache=cache)
    keys, values = cache.keys().clone(), cache.values().clone()
    bad = torch.ones(2, 3, 1, 6, dtype=torch.bool)
    for _ in range(2):  # first sight, then again once other verdicts are remembered
        with pytest.raises(
            ssm.ShapeError, match=r"attn_mask has num_heads=3 \(axis 1\), but the module set num_heads=8"
        ):
            module(step, kv_cache=cache, attn_mask=bad, is_causal=True)
        assert len(cache) == 5
        assert torch.equal(cache.keys(), keys) and torch.equal(cache.values(), values)
    good = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    out = module(step, kv_cache=cache, attn_mask=good, is_causal=True)
    full = module(torch.cat([prompt, step], dim=1), is_causal=True)
    torch.testing.assert_close(out, full[:, -1:], **F64)


def test_a_failure_after_the_cache_write_is_undone() -> None:
    """Even a failure the checks cannot foresee (here: a projection that raises) leaves the cache as it was."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = module.new_cache(batch=1, capacity=8)
    module(torch.randn(1, 3, 16), is_causal=True, kv_cache=cache)

    def explode(*_: Any) -> None:
        raise RuntimeError("boom")

    handle = module.o_proj.register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.randn(1, 2, 16), is_causal=True, kv_cache=cache)
    handle.remove()
    assert len(cache) == 3


class _Truncate(TorchFunctionMode):
    """Make one torch function return fewer query positions: a bug inside a stage, not in the call."""

    def __init__(self, target: Callable[..., Any], axis: int) -> None:
        super().__init__()
        self.target, self.axis = target, axis

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is self.target:
            first = out[0] if isinstance(out, tuple) else out
            cut = first.narrow(self.axis, 0, 1)
            return (cut, *out[1:]) if isinstance(out, tuple) else cut
        return out


PATHS = {
    # name: (num_kv_heads, grad, forward keywords, faulty function, its query axis)
    "no-grad MHA, fused projection": (8, False, {"is_causal": True}, F.scaled_dot_product_attention, -2),
    "no-grad MHA, torch's native kernel": (8, False, {}, torch._native_multi_head_attention, 1),  # pyright: ignore[reportPrivateImportUsage]
    "GQA causal with grad": (2, True, {"is_causal": True}, F.scaled_dot_product_attention, -2),
    "need_weights": (2, True, {"need_weights": True}, torch.softmax, -2),
}


@pytest.mark.parametrize("path", PATHS)
def test_a_stage_returning_fewer_positions_is_caught_on_first_sight(path: str) -> None:
    """The fault is a ShapeError naming seq on every path when checked; with checks off it is not."""
    num_kv_heads, grad, kwargs, target, axis = PATHS[path]
    x = torch.randn(2, 5, 64)
    with torch.set_grad_enabled(grad):
        module = ssm.MultiHeadAttention(64, 8, num_kv_heads).eval()
        with _Truncate(target, axis), pytest.raises(ssm.ShapeError, match=r"returned a wrong value: .*seq") as caught:
            module(x, **kwargs)
        assert "seq=5" in str(caught.value).splitlines()[0] or "seq=" in str(caught.value).splitlines()[0]
        fresh = ssm.MultiHeadAttention(64, 8, num_kv_heads).eval()
        with ssm.unchecked(), _Truncate(target, axis):
            try:
                fresh(x, **kwargs)
            except ssm.ShapeError:  # pragma: no cover - the point of the test
                pytest.fail("with checks off, shapesafe_mha raised a ShapeError")
            except RuntimeError:
                pass  # torch's own error further on: the fault was not ours to report


def test_the_first_line_names_the_stage_the_dimension_and_both_sizes() -> None:
    module = ssm.MultiHeadAttention(64, 8, 8).eval()
    with torch.no_grad(), _Truncate(F.scaled_dot_product_attention, -2), pytest.raises(ssm.ShapeError) as caught:
        module(torch.randn(2, 5, 64), is_causal=True)
    first = str(caught.value).splitlines()[0]
    assert first == (
        "MultiHeadAttention.forward(): attention returned a wrong value: the result has seq=1 (axis 2), "
        "but query set seq=5."
    )


def test_a_remembered_verdict_keeps_bool_and_int_apart() -> None:
    """is_causal=True was accepted; is_causal=1 is another call (True == 1 must not share a verdict)."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    module(x, is_causal=True)
    with pytest.raises(ssm.ShapeError, match="is_causal must be bool, but got int 1"):
        module(x, is_causal=1)  # pyright: ignore[reportArgumentType]


def test_a_remembered_verdict_is_per_device_and_dtype() -> None:
    """A verdict for float32 on cpu says nothing about float64 or meta inputs."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    module(torch.randn(1, 3, 16))
    with pytest.raises(ssm.ShapeError, match="query has dtype float64"):
        module(torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(ssm.ShapeError, match="query is on meta"):
        module(torch.randn(1, 3, 16, device="meta"))


def test_moving_the_module_forgets_its_verdicts() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    module(x)
    module.double()
    with pytest.raises(ssm.ShapeError, match="query has dtype float32, but the module's parameters are float64"):
        module(x)


def test_decoding_with_a_growing_padding_mask_is_checked_once() -> None:
    """kv_seq grows by one a step: the relations between sizes stay the same, so one full check covers them."""
    module = ssm.MultiHeadAttention(32, 4, 2)
    cache = module.new_cache(batch=2, capacity=40)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, :2] = True
    checked = []
    original = type(module)._checked

    def counting(self: Any, *args: Any) -> Any:
        checked.append(len(cache))
        return original(self, *args)

    type(module)._checked = counting  # pyright: ignore[reportAttributeAccessIssue]
    try:
        module(torch.randn(2, 8, 32), is_causal=True, kv_cache=cache, key_padding_mask=padding[:, :8])
        for t in range(8, 30):
            module(torch.randn(2, 1, 32), is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : t + 1])
    finally:
        type(module)._checked = original  # pyright: ignore[reportAttributeAccessIssue]
    # The prefill, the first step, and the steps where kv_seq happens to equal one of the module's
    # sizes (16 = num_heads * d_head, 32 = d_model): those relations are new, so they are checked.
    assert checked == [0, 8, 15, 31 - 1] or len(checked) <= 5, checked


def test_a_padding_mask_one_short_is_a_shape_error_at_every_decoding_step() -> None:
    """Decoding with a growing key_padding_mask remembers verdicts; at every step a mask one position short of
    the cache plus the new key is still our ShapeError (never torch's), and the cache is left as it was."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(24, 6, 2)
    cache = module.new_cache(batch=2, capacity=20)
    padding = torch.zeros(2, 20, dtype=torch.bool)
    padding[1, :2] = True
    module(torch.randn(2, 4, 24), is_causal=True, kv_cache=cache, key_padding_mask=padding[:, :4])
    for t in range(4, 19):
        step = torch.randn(2, 1, 24)
        with pytest.raises(ssm.ShapeError, match=f"key_padding_mask has kv_seq={t} "):
            module(step, is_causal=True, kv_cache=cache, key_padding_mask=padding[:, :t])
        assert len(cache) == t
        module(step, is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : t + 1])


def test_a_float_padding_mask_after_a_bool_one_of_the_same_shape_is_refused() -> None:
    """A verdict for a bool key_padding_mask says nothing about a float one of the same shape: it is a ShapeError."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 3, 16)
    padding = torch.tensor([[False, False, False], [True, False, False]])
    module(x, key_padding_mask=padding)
    with pytest.raises(ssm.ShapeError, match="key_padding_mask has dtype float32, but it must be bool"):
        module(x, key_padding_mask=padding.float())
    with torch.no_grad():
        module(x, key_padding_mask=padding)
        with pytest.raises(ssm.ShapeError, match="key_padding_mask has dtype float32, but it must be bool"):
            module(x, key_padding_mask=padding.float())


# --- soundness: a wrong call among right ones is always rejected ------------------------------------------


@st.composite
def _sessions(draw: st.DrawFn) -> dict[str, Any]:
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d_head = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(["self", "cross", "cache"]))
    return {
        "num_heads": num_kv_heads * group,
        "num_kv_heads": num_kv_heads,
        "d_head": d_head,
        "d_model": draw(st.integers(1, 12)),
        "mode": mode,
        "mask": draw(st.sampled_from([None, "2d", "4d", "padding"])),
        "calls": draw(st.integers(2, 6)),
    }


def _right_call(draw: st.DrawFn, cfg: dict[str, Any], batch: int, cached: int) -> dict[str, Any]:
    """A call that must succeed: sizes drawn afresh (for a cache: one more step after `cached`)."""
    seq = 1 if cfg["mode"] == "cache" and cached else draw(st.integers(1, 5))
    kv = draw(st.integers(1, 5)) if cfg["mode"] == "cross" else seq
    kv_seq = cached + kv
    call: dict[str, Any] = {"query": torch.randn(batch, seq, cfg["d_model"])}
    if cfg["mode"] == "cross":
        call["key"] = torch.randn(batch, kv, cfg["d_model"])
        call["value"] = torch.randn(batch, kv, cfg["d_model"])
    if cfg["mask"] == "2d":
        call["attn_mask"] = torch.ones(seq, kv_seq, dtype=torch.bool)
    elif cfg["mask"] == "4d":
        heads = draw(st.sampled_from([1, cfg["num_heads"]]))
        call["attn_mask"] = torch.ones(draw(st.sampled_from([1, batch])), heads, seq, kv_seq, dtype=torch.bool)
    elif cfg["mask"] == "padding":
        call["key_padding_mask"] = torch.zeros(batch, kv_seq, dtype=torch.bool)
    return call


def _perturb(draw: st.DrawFn, call: dict[str, Any], cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The same call with one dimension changed so that it is wrong (never to a value it could legally take)."""
    batch, seq = call["query"].shape[:2]
    choices: list[tuple[str, int, set[int]]] = [("query", 2, {cfg["d_model"]})]
    if "key" in call:
        choices += [("key", 0, {batch}), ("key", 2, {cfg["d_model"]}), ("value", 1, {call["key"].shape[1]})]
    mask = call.get("attn_mask")
    if mask is not None:
        kv_seq = mask.shape[-1]
        choices += [("attn_mask", mask.ndim - 2, {seq}), ("attn_mask", mask.ndim - 1, {kv_seq})]
        if mask.ndim == 4:
            choices += [("attn_mask", 0, {1, batch}), ("attn_mask", 1, {1, cfg["num_heads"]})]
    if "key_padding_mask" in call:
        padding = call["key_padding_mask"]
        choices += [("key_padding_mask", 0, {batch}), ("key_padding_mask", 1, {padding.shape[1]})]
    name, axis, legal = draw(st.sampled_from(choices))
    size = draw(st.integers(1, 14).filter(lambda s: s not in legal))
    tensor = call[name]
    shape = list(tensor.shape)
    shape[axis] = size
    wrong = dict(call)
    wrong[name] = torch.ones(shape, dtype=tensor.dtype) if tensor.dtype == torch.bool else torch.randn(shape)
    if name == "key_padding_mask":
        wrong[name] = torch.zeros(shape, dtype=torch.bool)
    return wrong, f"{name} axis {axis}: {tensor.shape[axis]} -> {size}"


@given(cfg=_sessions(), data=st.data())
def test_one_wrong_call_among_right_ones_is_always_rejected(cfg: dict[str, Any], data: st.DataObject) -> None:
    """Random right calls (verdicts remembered, sizes varying) with one wrong call at a random place:
    the right ones pass, the wrong one is a ShapeError, and a cache is left as it was."""
    module = ssm.MultiHeadAttention(cfg["d_model"], cfg["num_heads"], cfg["num_kv_heads"], d_head=cfg["d_head"])
    batch = data.draw(st.integers(1, 3), label="batch")
    wrong_at = data.draw(st.integers(0, cfg["calls"] - 1), label="wrong_at")
    cache = module.new_cache(batch, 5 + 2 * cfg["calls"]) if cfg["mode"] == "cache" else None
    grad = data.draw(st.booleans(), label="grad")
    causal = data.draw(st.booleans(), label="is_causal")
    with torch.set_grad_enabled(grad):
        for index in range(cfg["calls"]):
            call = _right_call(data.draw, cfg, batch, len(cache) if cache is not None else 0)
            kwargs = {"is_causal": causal, "kv_cache": cache}
            if index == wrong_at:
                wrong, what = _perturb(data.draw, call, cfg)
                before = len(cache) if cache is not None else None
                with pytest.raises(ssm.ShapeError):
                    module(**wrong, **kwargs)
                assert before is None or len(cache) == before, what  # pyright: ignore[reportArgumentType]
            module(**call, **kwargs)


def test_lowest_versions_smoke_script_runs_here() -> None:
    """tools/smoke.py (what CI runs against the lowest declared versions) passes with the installed ones."""
    out = subprocess.run([sys.executable, "tools/smoke.py"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "smoke ok" in out.stdout


def test_env_switch_accepts_the_usual_spellings_and_rejects_others() -> None:
    from shapesafe_mha._core.contract import parse_switch

    for text in ("1", "true", "YES", "on", " On "):
        assert parse_switch(text) is True
    for text in ("", "0", "false", "No", "off"):
        assert parse_switch(text) is False
    with pytest.raises(ssm.ConfigError, match="SHAPESAFE_MHA_UNCHECKED='maybe' is not a switch"):
        parse_switch("maybe")


def test_a_relational_verdict_keeps_the_module_sizes_exact() -> None:
    """A verdict for d_model=64 must not cover d_model=60, though both are 'some other size' to batch and seq."""
    module = ssm.MultiHeadAttention(64, 8, 2)
    module(torch.randn(2, 5, 64))
    with pytest.raises(ssm.ShapeError, match=r"query has d_model=60"):
        module(torch.randn(2, 5, 60))


def test_a_relational_verdict_keeps_a_broadcast_one_apart() -> None:
    """A mask broadcast over batch (1) does not vouch for a mask with a third batch size."""
    module = ssm.MultiHeadAttention(64, 8, 2)
    x = torch.randn(2, 5, 64)
    module(x, attn_mask=torch.ones(1, 8, 5, 5, dtype=torch.bool))
    with pytest.raises(ssm.ShapeError, match=r"attn_mask has batch=3 \(axis 0\), but query set batch=2"):
        module(x, attn_mask=torch.ones(3, 8, 5, 5, dtype=torch.bool))


def test_a_bad_switch_says_both_ways_to_set_it() -> None:
    """Refusing SHAPESAFE_MHA_UNCHECKED=maybe names the spellings that turn checks off and those that keep them."""
    from shapesafe_mha._core.contract import parse_switch

    with pytest.raises(ssm.ConfigError) as caught:
        parse_switch("maybe")
    assert str(caught.value) == (
        "SHAPESAFE_MHA_UNCHECKED='maybe' is not a switch: use 1, true, yes or on to turn the checks off, "
        "or 0, false, no, off or nothing to keep them."
    )


# A stage made here, at runtime: the package's own stages are made at import, before any test runs.


def _refuse_float64(arguments: dict[str, Any]) -> None:
    from shapesafe_mha._core.messages import mismatch

    if arguments["x"].dtype == torch.float64:
        raise mismatch("x is float64, which widen refuses.", arg="x")


def _validate_even(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    from shapesafe_mha._core.messages import mismatch

    if dims["d_model"] % 2:
        raise mismatch(f"x has d_model={dims['d_model']}, which widen needs even.", arg="x")


def _explain_widen(arguments: dict[str, Any], failure: Any) -> str | None:
    return "Pad x to an even width." if "even" in failure.sentence else None


def _make_widen(**options: Any) -> Any:
    from jaxtyping import Float

    from shapesafe_mha._core.contract import stage

    def widen(x: Float[torch.Tensor, "batch seq d_model"], times: int) -> Float[torch.Tensor, "batch seq d_model"]:
        """x times `times`, its shape kept (a test's stage)."""
        return x[..., : x.shape[-1] // times].repeat(1, 1, times) if times > 1 else x

    return stage(**options)(widen)


def test_a_stage_made_at_runtime_runs_its_function_and_keeps_its_name_and_docstring() -> None:
    widen = _make_widen()
    x = torch.arange(8.0).reshape(1, 2, 4)
    assert torch.equal(widen(x, 1), x)
    assert widen.__name__ == "widen" and widen.__doc__ == "x times `times`, its shape kept (a test's stage)."
    named = _make_widen(name="stretch")
    with pytest.raises(ssm.ShapeError, match=r"^stretch\(\): "):
        named(torch.zeros(1, 2), 1)
    with pytest.raises(ssm.ShapeError, match=r"^widen\(\): "):
        widen(torch.zeros(1, 2), 1)


def test_a_stage_made_at_runtime_checks_its_result() -> None:
    """A result whose width is not its argument's is caught, and named as the stage's result."""
    widen = _make_widen()
    with pytest.raises(ssm.ShapeError, match=r"^widen\(\): widen returned a wrong value: the result has d_model=6"):
        widen(torch.zeros(1, 2, 7), 2)  # 7 // 2 * 2 = 6 features back


def test_a_stage_without_a_result_annotation_checks_only_its_arguments() -> None:
    from jaxtyping import Float

    from shapesafe_mha._core.contract import stage

    @stage()
    def first_row(x: Float[torch.Tensor, "batch seq d_model"]):  # no result annotation, on purpose
        return x[0]

    assert first_row(torch.ones(2, 3, 4)).shape == (3, 4)
    with pytest.raises(ssm.ShapeError, match=r"^first_row\(\): x must be 3-D"):
        first_row(torch.ones(3, 4))


def test_a_stage_made_at_runtime_runs_its_precheck_validate_and_explain() -> None:
    """The three hooks each refuse what they are for, and explain's fix follows the sentence."""
    widen = _make_widen(precheck=_refuse_float64, validate=_validate_even, explain=_explain_widen)
    assert widen(torch.ones(1, 2, 4), 2).shape == (1, 2, 4)
    with pytest.raises(ssm.ShapeError, match=r"^widen\(\): x is float64, which widen refuses\.\n"):
        widen(torch.ones(1, 2, 4, dtype=torch.float64), 2)
    first = r"^widen\(\): x has d_model=5, which widen needs even\. Pad x to an even width\.\n"
    with pytest.raises(ssm.ShapeError, match=first):
        widen(torch.ones(1, 2, 5), 1)


def test_a_stage_after_another_in_one_session_names_what_it_got_from_the_user_plainly() -> None:
    """In a session of several stages, a later stage's failure on an argument it names public reads as the user's
    argument; on any other argument it is prefixed with where it happened (`at <stage>,`)."""
    from shapesafe_mha._core.contract import Session

    plain = _make_widen(name="widen", public=("x",), precheck=_refuse_float64)
    inner = _make_widen(name="widen", precheck=_refuse_float64)
    for widen, prefix in ((plain, ""), (inner, "at widen, ")):
        with pytest.raises(ssm.ShapeError) as caught, Session("forward()") as session:
            session.call(_make_widen(name="first"), torch.ones(1, 2, 4), 1)
            session.call(widen, torch.ones(1, 2, 4, dtype=torch.float64), 1)
        assert str(caught.value).splitlines()[0] == f"forward(): {prefix}x is float64, which widen refuses."


def test_a_stage_reports_each_result_under_its_trace_name() -> None:
    from jaxtyping import Float

    from shapesafe_mha._core.contract import Session, stage

    Tokens = Float[torch.Tensor, "batch seq d_model"]

    @stage(trace=("left", "right"))
    def halves(x: Tokens) -> tuple[Tokens, Tokens]:
        return x, -x

    seen: list[tuple[str, str]] = []
    with Session("f()", observer=lambda name, dims, value: seen.append((name, dims))) as session:
        session.call(halves, torch.ones(1, 2, 3))
    assert seen == [("left", "batch seq d_model"), ("right", "batch seq d_model")]


def _counting_sessions(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[str]:
    """Replace `module.Session` by one that notes each session opened (what a full check costs)."""
    opened: list[str] = []
    original = module.Session

    class Counted(original):
        def __init__(self, owner: str, **kwargs: Any) -> None:
            opened.append(owner)
            super().__init__(owner, **kwargs)

    monkeypatch.setattr(module, "Session", Counted)
    return opened


def test_a_public_stage_is_checked_once_per_signature() -> None:
    """The second call with the same shapes, dtypes, ints, floats and bools is not checked again; another int is."""
    import shapesafe_mha._core.contract as contract

    with pytest.MonkeyPatch.context() as monkeypatch:
        opened = _counting_sessions(monkeypatch, contract)
        x = torch.randn(1, 3, 8)
        for _ in range(2):
            ssm.split_heads(x, 2)
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        for _ in range(2):
            ssm.scaled_dot_product_attention(q, k, k, is_causal=True, scale=0.5)
        ssm.split_heads(x, 4)
    assert opened == ["split_heads()", "scaled_dot_product_attention()", "split_heads()"]


def test_a_remembered_stage_verdict_is_per_keyword() -> None:
    """window=1 accepted does not vouch for is_causal=1: the same value under another name is another call."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    ssm.scaled_dot_product_attention(q, k, k, window=1)
    with pytest.raises(ssm.ShapeError, match="is_causal must be bool, but got int 1"):
        ssm.scaled_dot_product_attention(q, k, k, is_causal=1)  # pyright: ignore[reportArgumentType]


def _attention_each_way(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    return [
        ssm.scaled_dot_product_attention(q, k, k, is_causal=True, scale=0.25),
        ssm.attention_weights(q, k, is_causal=True, window=2),
    ]


def test_a_public_stage_passes_keywords_through_unchecked_and_in_a_shape_scope() -> None:
    """Under unchecked() and inside a shape_scope a public stage computes what it computes on its own, keyword
    arguments included."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    expected = _attention_each_way(q, k)
    with ssm.unchecked():
        unchecked = _attention_each_way(q, k)
    with ssm.shape_scope():
        scoped = _attention_each_way(q, k)
    for got in (unchecked, scoped):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_while_compiling_a_public_stage_calls_its_function_as_given_and_checks_nothing() -> None:
    """The branch dynamo takes (compiling() true, not measurable with mutants under torch.compile): the same
    values, keyword arguments included, and a wrong shape reaches torch unexplained."""
    import shapesafe_mha._core.contract as contract

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    expected = _attention_each_way(q, k)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(contract, "compiling", lambda: True)
        compiled = _attention_each_way(q, k)
        with pytest.raises(RuntimeError) as caught:
            ssm.split_heads(torch.randn(1, 3, 8), 3)
    assert not isinstance(caught.value, ssm.ShapeError)
    for a, b in zip(compiled, expected, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_dimension_a_stage_returned_first_is_said_to_come_from_that_stage() -> None:
    """In a session, a size bound by a stage's result (not by an argument) is named after that stage when a later
    stage disagrees with it."""
    from jaxtyping import Float

    from shapesafe_mha._core.contract import Session, stage

    @stage()
    def widen_twice(x: Float[torch.Tensor, "batch seq d_model"]) -> Float[torch.Tensor, "batch seq d_wide"]:
        return torch.cat([x, x], dim=-1)

    @stage()
    def narrow(y: Float[torch.Tensor, "batch seq d_wide"]) -> Float[torch.Tensor, "batch seq d_wide"]:
        return y

    with pytest.raises(ssm.ShapeError) as caught, Session("forward()") as session:
        session.call(widen_twice, torch.ones(1, 2, 4))
        session.call(narrow, torch.ones(1, 2, 5))
    first = str(caught.value).splitlines()[0]
    assert first == "forward(): at narrow, y has d_wide=5 (axis 2), but widen_twice set d_wide=8."


def test_a_result_without_a_named_shape_is_reported_with_no_dimensions() -> None:
    """The trace still sees the tensor a stage returns when its annotation names no dimensions (here: none)."""
    from jaxtyping import Float

    from shapesafe_mha._core.contract import Session, stage

    @stage(trace=("rows",))
    def first_row(x: Float[torch.Tensor, "batch seq d_model"]):  # no result annotation, on purpose
        return x[0]

    seen: list[tuple[str, str, tuple[int, ...]]] = []
    with Session("f()", observer=lambda name, dims, value: seen.append((name, dims, tuple(value.shape)))) as session:
        session.call(first_row, torch.ones(2, 3, 4))
    assert seen == [("rows", "", (3, 4))]


def test_a_public_stage_called_with_a_wrong_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"^split_heads\(\): missing a required argument: 'num_heads'$"):
        ssm.split_heads(torch.randn(1, 3, 8), heads=2)  # pyright: ignore[reportCallIssue]


def test_a_size_a_later_stage_binds_is_said_to_come_from_the_users_argument_or_from_that_stage() -> None:
    """After the first stage of a session, an argument a stage lists as public binds its sizes under its own name (the
    user passed it); any other binds them under the stage's name (the stage was given it by an earlier one)."""
    from jaxtyping import Float

    from shapesafe_mha._core.contract import Session, stage

    Extra = Float[torch.Tensor, "batch seq d_extra"]

    def take(x: Float[torch.Tensor, "batch seq d_model"], y: Extra) -> Extra:
        return y

    def check(z: Extra) -> Extra:
        return z

    @stage()
    def begin(x: Float[torch.Tensor, "batch seq d_model"]) -> Float[torch.Tensor, "batch seq d_model"]:
        return x

    for options, source in (({"public": ("y",)}, "y"), ({}, "take")):
        taking, checking = stage(name="take", **options)(take), stage()(check)
        with pytest.raises(ssm.ShapeError) as caught, Session("forward()") as session:
            session.call(begin, torch.ones(1, 2, 4))
            session.call(taking, torch.ones(1, 2, 4), torch.ones(1, 2, 3))
            session.call(checking, torch.ones(1, 2, 5))
        line = str(caught.value).splitlines()[0]
        assert line == f"forward(): at check, z has d_extra=5 (axis 2), but {source} set d_extra=3.", options


def _stages_with_raw() -> list[Any]:
    """Every stage of the package whose remembered call skips its body for a `raw` function."""
    from shapesafe_mha._compute import rotary, stages
    from shapesafe_mha._core.contract import Stage
    from shapesafe_mha._modules import latent

    found = {id(v): v for m in (stages, latent, rotary) for v in vars(m).values() if isinstance(v, Stage)}
    return [s for s in found.values() if s.raw is not s.fn]


def test_a_stage_s_raw_is_the_one_call_its_body_makes_with_its_arguments_in_order() -> None:
    """A remembered forward (and a remembered public stage called positionally) calls a stage's `raw` instead of
    its body: that is the same computation only where the body is nothing but `return raw(a, b, ...)`, its own
    parameters in order, none with a default. Each such stage is read here, its source parsed."""
    import ast
    import inspect
    import textwrap

    checked = _stages_with_raw()
    assert len(checked) >= 15
    for stage_ in checked:
        tree = ast.parse(textwrap.dedent(inspect.getsource(stage_.fn)))
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        body = [b for b in function.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        assert len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
        parameters = function.args
        assert not (parameters.defaults or parameters.kwonlyargs or parameters.vararg or parameters.kwarg)
        call = body[0].value
        assert [ast.unparse(a) for a in call.args] == [a.arg for a in parameters.args] and not call.keywords
        assert eval(ast.unparse(call.func), stage_.fn.__globals__) is stage_.raw, stage_.name


def test_the_forwards_call_every_stage_with_a_raw_positionally() -> None:
    """`raw` may name its parameters otherwise than the stage: the modules' forwards, which call the raw
    functions through `s`, pass those stages' arguments by position only, all of them."""
    import ast
    import inspect

    from shapesafe_mha._compute import scorer
    from shapesafe_mha._modules import latent, plan

    stages_by_key = {
        key: stage_
        for stages in (plan.STAGES, latent._STAGES)  # what the modules' raw namespaces are made of
        for key, stage_ in stages.items()
        if stage_.raw is not stage_.fn
    }
    assert stages_by_key
    calls = 0
    for module in (plan, scorer, latent):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in stages_by_key:
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "s":
                    stage_ = stages_by_key[node.func.attr]
                    assert not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
                    assert len(node.args) == len(stage_.signature.parameters), node.func.attr
                    calls += 1
    assert calls >= 10
