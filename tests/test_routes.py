"""Mode and route sweeps: the module computes one function whatever route a call takes.

A call's route is the execution path `choose_path` picks (separate projections, the fused Q/K/V projection,
torch's native MHA kernel) and the scorer `MultiHeadAttention._run` runs (each head by SDPA, torch's own GQA
kernel, the folded groups by SDPA, the scores computed here for weights, one decoding query folded), in train
(dropout 0) or eval, with autograd, without, or in inference mode. Each call is run on every route open to it,
each path forced by `choose_path` picking a slower one (a fast path only ever falls back: separate is always
correct) and each scorer by `kernels.native_gqa` answering yes or no (both correct: it decides speed and copies);
every output equals every other, the per-head reference, and a fresh module built from the same config and state.
The routes taken over the run are recorded, and each must have been taken.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute import fastpath
from shapesafe_mha._compute import kernels as _kernels
from shapesafe_mha._modules import multihead
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import attention_configs, attention_inputs, key_padding_masks

F64: dict[str, Any] = {"atol": 1e-10, "rtol": 1e-8}
PATHS = (fastpath.NATIVE, fastpath.FUSED, fastpath.SEPARATE)  # each falls back to the next
GRAD_MODES = {
    "grad": lambda: torch.enable_grad(),
    "no_grad": lambda: torch.no_grad(),
    "inference_mode": lambda: torch.inference_mode(),
}
# The scorer stages of `_run` and the path stages, by the stage each calls: every one must run in the sweep.
SCORERS = {"attend_heads", "attend_native", "attend_folded", "folded_weights", "fold_one_query"}
PATH_STAGES = {"native_attention", "project_qkv", "project_query"}


class _UnavailableError(Exception):
    """The forced path is not one `choose_path` could fall back to for this call."""


class _Recording:
    """The stages `_run` is given, each one it calls recorded by name."""

    def __init__(self, stages: Any, taken: set[str]) -> None:
        self._stages, self._taken = stages, taken

    def __getattr__(self, name: str) -> Any:
        self._taken.add(name)
        return getattr(self._stages, name)


@contextlib.contextmanager
def _route(path: str | None, native_gqa: bool | None, taken: set[str]) -> Iterator[None]:
    """Calls of `MultiHeadAttention` within take `path` (None: the chooser's) and the scorer `native_gqa` says."""
    chooser, ask, run = multihead.choose_path, _kernels.native_gqa, ssm.MultiHeadAttention._run

    def choosing(*args: Any, **kwargs: Any) -> tuple[str, Any]:
        chosen, fused = chooser(*args, **kwargs)
        if path is None or path == chosen:
            return chosen, fused
        if PATHS.index(path) < PATHS.index(chosen):  # a faster path than the chooser's: not open to this call
            raise _UnavailableError(path)
        return path, fused if path != fastpath.SEPARATE else None

    def recording(self: Any, s: Any, *rest: Any) -> Any:
        return run(self, _Recording(s, taken), *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multihead, "choose_path", choosing)
        patch.setattr(ssm.MultiHeadAttention, "_run", recording)
        if native_gqa is not None:
            patch.setattr(_kernels, "native_gqa", lambda *args: native_gqa)
        yield
    assert _kernels.native_gqa is ask


def _calls(module: Any, x: torch.Tensor, how: dict[str, Any], need_weights: bool) -> torch.Tensor:
    """The module over `x` as `how` says: one call, or a prefill then steps of `step` tokens through a cache."""
    padding, causal = how["padding"], how["causal"]
    if how["step"] is None:
        out = module(x, is_causal=causal, key_padding_mask=padding, need_weights=need_weights)
        return out[0] if need_weights else out
    cache = module.new_cache(x.shape[0], x.shape[1])
    outs = []
    for start, end in _steps(how, x.shape[1]):
        mask = None if padding is None else padding[:, :end]
        out = module(
            x[:, start:end], is_causal=causal, kv_cache=cache, key_padding_mask=mask, need_weights=need_weights
        )
        outs.append(out[0] if need_weights else out)
    return torch.cat(outs, dim=1)


def _steps(how: dict[str, Any], seq: int) -> list[tuple[int, int]]:
    """(start, end) of each call: the prefill (if any), then `step` tokens at a time."""
    ends = [how["prefill"], *range(how["prefill"] + how["step"], seq, how["step"]), seq]
    return [(start, end) for start, end in zip([0, *ends], ends, strict=False) if end > start]


def _reference(module: ssm.MultiHeadAttention, x: torch.Tensor, how: dict[str, Any]) -> torch.Tensor:
    """Each call's queries against every key up to its last (lower-right causal): the per-head reference."""
    padding = how["padding"]
    calls = [(0, x.shape[1])] if how["step"] is None else _steps(how, x.shape[1])
    return torch.cat([
        per_head_attention(
            x[:, start:end], x[:, :end], x[:, :end], module.weights(), num_heads=module.num_heads,
            num_kv_heads=module.num_kv_heads, is_causal=how["causal"],
            key_padding_mask=None if padding is None else padding[:, :end],
        )
        for start, end in calls
    ], dim=1)  # fmt: skip


def _fresh(module: Any) -> Any:
    fresh = ssm.MultiHeadAttention.from_config(module.config, dtype=torch.float64)
    fresh.load_state_dict(module.state_dict())
    return fresh.train(module.training)


@st.composite
def _calls_drawn(draw: Any) -> tuple[Any, dict[str, Any]]:
    """A config (MHA/GQA/MQA, heads that tile d_model or not, biases or not) and how it is called; a third of
    the draws fit torch's native MHA kernel (MHA with biases, heads that tile d_model, a plain call, or a
    call as plain through a cache)."""
    native = draw(st.integers(0, 2), label="native fit") == 0
    kinds = ("mha",) if native else ("mha", "gqa", "mqa")
    config = draw(attention_configs(kinds, cross=False, max_seq=10, max_heads=6, bias=True if native else None))
    if native or draw(st.booleans(), label="heads tile d_model"):
        config = type(config)(**(config.as_dict() | {"d_model": config.num_heads * config.d_head}))
    # two thirds through a cache (a plain call through one is no fit for the native kernel: the chooser says)
    decode = draw(st.sampled_from([False, True, True]), label="decode")
    padded = not native and draw(st.sampled_from([False, False, True]), label="padded")
    how = {
        "causal": not native and draw(st.sampled_from([False, True, True]), label="causal"),
        "padding": draw(key_padding_masks(config)) if padded else None,
        "step": draw(st.integers(1, 3), label="step") if decode else None,
        "prefill": draw(st.integers(0, config.seq - 1), label="prefill") if decode else 0,
        "x": draw(attention_inputs(config)).query,
    }
    return config, how


def _gradients(module: ssm.MultiHeadAttention, out: torch.Tensor, cotangent: torch.Tensor) -> dict[str, Any]:
    """Each parameter's gradient of `(out * cotangent).sum()` (None where it has none)."""
    names = [name for name, _ in module.named_parameters()]
    found = torch.autograd.grad((out * cotangent).sum(), list(module.parameters()), allow_unused=True)
    return dict(zip(names, found, strict=True))


def test_every_route_of_every_mode_computes_the_same_function() -> None:
    """One module, warm, through every mode in turn (eval and train with dropout 0; autograd, no_grad, inference
    mode): per call, every open route (path x scorer x weights asked or not) equals each other, the reference and
    a fresh module's output; with autograd, the parameters' gradients are the reference's. Over the sweep, every
    path and scorer ran."""
    taken: set[str] = set()

    @settings(max_examples=max(10, settings().max_examples // 3), database=None)  # each example: six modes
    @given(drawn=_calls_drawn())
    def sweep(drawn: tuple[Any, dict[str, Any]]) -> None:
        config, how = drawn
        x = how["x"]
        module = config.module()
        expected = _reference(module, x, how)
        cotangent = torch.randn_like(expected)
        for training in (False, True):
            module.train(training)
            for grad, mode in GRAD_MODES.items():
                fresh = _fresh(module)
                outputs: dict[str, torch.Tensor] = {}
                with mode():
                    with _route(None, None, taken):
                        outputs["a fresh module, the chooser's route"] = _calls(fresh, x, how, need_weights=False)
                    for path in PATHS:
                        for native_gqa in (True, False):
                            for need_weights in (False, True):
                                route = f"{path}, native_gqa={native_gqa}, need_weights={need_weights}"
                                with contextlib.suppress(_UnavailableError), _route(path, native_gqa, taken):
                                    outputs[route] = _calls(module, x, how, need_weights)
                assert any(r.startswith(fastpath.SEPARATE) for r in outputs), "separate projections are always open"
                first = next(iter(outputs.values()))
                for route, out in outputs.items():
                    where = f"training={training}, {grad}, {route}"
                    torch.testing.assert_close(out, first, **F64, msg=lambda m, w=where: f"{w} vs a fresh module: {m}")
                    torch.testing.assert_close(
                        out, expected, **F64, msg=lambda m, w=where: f"{w} vs the reference: {m}"
                    )
                if grad == "grad":  # the chooser's route trains what the reference trains
                    with _route(None, None, taken):
                        ours = _gradients(module, _calls(module, x, how, need_weights=False), cotangent)
                    theirs = _gradients(module, _reference(module, x, how), cotangent)
                    for name, gradient in theirs.items():
                        assert (ours[name] is None) is (gradient is None), f"training={training}: {name}'s gradient"
                        if gradient is not None:
                            torch.testing.assert_close(ours[name], gradient, **F64, msg=lambda m, n=name: f"{n}: {m}")

    sweep()
    assert SCORERS | PATH_STAGES <= taken, f"never taken: {(SCORERS | PATH_STAGES) - taken}"


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_a_compiled_module_computes_what_the_eager_one_and_the_reference_do(num_kv_heads: int) -> None:
    """torch.compile, in train (dropout 0) and eval, with and without autograd, causal and key-padded: the
    reference's values (the compiled graph takes the separate path and folds GQA, `native_gqa` says no there)."""
    generator = torch.Generator().manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, num_kv_heads, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=generator)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, :2] = True
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    expected = per_head_attention(
        x, x, x, module.weights(), num_heads=4, num_kv_heads=num_kv_heads, is_causal=True, key_padding_mask=padding
    )
    for training in (False, True):
        module.train(training)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                got = compiled(x, is_causal=True, key_padding_mask=padding)
            torch.testing.assert_close(got, expected, **F64)
            torch.testing.assert_close(got, module(x, is_causal=True, key_padding_mask=padding), **F64)
