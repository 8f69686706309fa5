"""`check_attention` and `check_module`: property-test a user's attention against the reference."""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from torch import Tensor, nn

from ._reference import per_head_attention
from ._strategies import ALL_KINDS, AttentionConfig, Kind, attention_configs, attention_inputs, attention_weights
from ._weights import AttentionWeights

AttentionFn = Callable[..., Tensor]

TOLERANCES = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 6e-2,
}


def tolerance(dtype: torch.dtype) -> float:
    """The absolute deviation (on outputs of order 1) accepted for `dtype`."""
    return TOLERANCES.get(dtype, 1e-4)


def _isolate_head(weights: AttentionWeights, head: int, d_head: int) -> AttentionWeights:
    """The same weights with W_O reading only `head` (and no output bias): the output is that head's part."""
    keep = torch.zeros_like(weights.w_o)
    columns = slice(head * d_head, (head + 1) * d_head)
    keep[:, columns] = weights.w_o[:, columns]
    no_bias = None if weights.b_o is None else torch.zeros_like(weights.b_o)
    return AttentionWeights(weights.w_q, weights.w_k, weights.w_v, keep, weights.b_q, weights.b_k, weights.b_v, no_bias)


def _call(fn: AttentionFn, x: Tensor, weights: AttentionWeights, config: AttentionConfig, is_causal: bool) -> Any:
    return fn(x, weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=is_causal)


def _describe(config: AttentionConfig, is_causal: bool, dtype: torch.dtype) -> str:
    return (
        f"seq={config.seq}, batch={config.batch}, d_model={config.d_model}, num_heads={config.num_heads}, "
        f"num_kv_heads={config.num_kv_heads}, d_head={config.d_head}, bias={config.bias}, is_causal={is_causal} "
        f"({config.kind}, group={config.group}, {str(dtype).removeprefix('torch.')})"
    )


def _locate(
    fn: AttentionFn, x: Tensor, weights: AttentionWeights, config: AttentionConfig, is_causal: bool, tol: float
) -> str:
    """Which heads are wrong, found by running `fn` with W_O restricted to one head at a time."""
    wrong = []
    for head in range(config.num_heads):
        isolated = _isolate_head(weights, head, config.d_head)
        try:
            got = _call(fn, x, isolated, config, is_causal)
            wide = x.double()
            expected = per_head_attention(
                wide,
                wide,
                wide,
                _to(isolated, torch.float64),
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                is_causal=is_causal,
            )
            if got.shape != expected.shape or (got.double() - expected.double()).abs().max().item() > tol:
                wrong.append(head)
        except Exception:
            wrong.append(head)
    if not wrong:
        return "no single head is wrong on its own: the error is in how heads are combined (merge or W_O)"
    if len(wrong) == config.num_heads:
        return f"every head ({config.num_heads}) is wrong"
    return f"wrong heads: {wrong} of {config.num_heads}"


class _ValueMismatchError(AssertionError):
    """A wrong value; which heads are wrong is found once, on the example hypothesis finally reports."""

    def __init__(self, report: str, locate: Callable[[], str]) -> None:
        super().__init__(report)
        self.locate = locate


def _compare(
    fn: AttentionFn,
    config: AttentionConfig,
    x: Tensor,
    weights: AttentionWeights,
    is_causal: bool,
    dtype: torch.dtype,
) -> float:
    """Run `fn` and the reference; return the largest deviation or raise a readable AssertionError."""
    where = _describe(config, is_causal, dtype)
    try:
        got = _call(fn, x, weights, config, is_causal)
    except UnsatisfiedAssumption:
        raise  # hypothesis.assume() in the user's function: skip this example, it is no failure
    except Exception as error:
        raise AssertionError(
            f"the implementation raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}\n"
            f"  smallest failing config: {where}"
        ) from error
    expected = per_head_attention(
        x.double(),
        x.double(),
        x.double(),
        _to(weights, torch.float64),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        is_causal=is_causal,
    )
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        raise AssertionError(
            f"the implementation returned shape {shape}, expected {tuple(expected.shape)} (batch, seq, d_model)\n"
            f"  smallest failing config: {where}"
        )
    deviation = (got.double() - expected).abs()
    worst = deviation.max().item() if deviation.numel() else 0.0
    tol = tolerance(dtype)
    if not worst <= tol:  # also catches NaN
        flat = int(torch.nan_to_num(deviation, nan=float("inf")).argmax().item())
        b, position, feature = (
            flat // (config.seq * config.d_model),
            (flat // config.d_model) % config.seq,
            flat % config.d_model,
        )
        raise _ValueMismatchError(
            f"the implementation differs from the per-head reference by {worst:.3g} (tolerance {tol:g})\n"
            f"  smallest failing config: {where}\n"
            f"  largest deviation at batch {b}, query position {position}, output feature {feature}",
            lambda: _locate(fn, x, weights, config, is_causal, tol),
        )
    return worst


def _to(weights: AttentionWeights, dtype: torch.dtype) -> AttentionWeights:
    def cast(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    return AttentionWeights(
        *(cast(getattr(weights, name)) for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"))  # type: ignore[arg-type]
    )


def run_property(
    check: Callable[[AttentionConfig, Any], float],
    *,
    kinds: Sequence[Kind],
    max_examples: int | None,
    on_example: Callable[[float], None] | None = None,
    cross: bool = False,
    thresholds: Sequence[int] = (),
    base: settings | None = None,
) -> None:
    """Run `check(config, data)` on hypothesis-drawn configs; it returns a deviation or raises AssertionError.

    `base` (default: the active hypothesis profile) gives the budget unless `max_examples` is set.
    """
    base = settings() if base is None else base

    @settings(
        base,
        max_examples=base.max_examples if max_examples is None else max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        # No explain phase: it re-runs the failing example hundreds of times to list lines of our
        # own code, which say nothing about the user's bug (a report took 67 s longer with it).
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(config=attention_configs(kinds, cross=cross, thresholds=thresholds), data=st.data())
    def prop(config: AttentionConfig, data: Any) -> None:
        deviation = check(config, data)
        if on_example is not None:
            on_example(deviation)

    try:
        prop()
    except _ValueMismatchError as mismatch:  # the final, smallest example: now say which heads are wrong
        raise AssertionError(f"{mismatch}\n  {mismatch.locate()}") from None


def check_attention(
    fn: AttentionFn,
    *,
    kinds: Sequence[Kind] = ALL_KINDS,
    is_causal: bool = False,
    max_examples: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    thresholds: Sequence[int] = (),
    settings: settings | None = None,
) -> None:
    """Property-test an attention implementation against `reference.per_head_attention`.

    `fn(x, weights, *, num_heads, num_kv_heads, is_causal)` takes `x (batch, seq, d_model)` and an
    `AttentionWeights` (nn.Linear layout; biases may be None) and returns `(batch, seq, d_model)`.
    hypothesis draws configs (MHA/GQA/MQA, as `kinds` says) and inputs, and shrinks a failure to the
    smallest config. Call it from a plain test, not from inside another `@given`.

    The budget is `max_examples`, else that of `settings` (a `hypothesis.settings`), else the
    active hypothesis profile's (100 by default; `--hypothesis-profile ci` under pytest). No explain
    phase, whatever the profile. `hypothesis.assume(...)` in `fn` skips an example.

    Sequence lengths reach 512 and land on purpose on both sides of every power of two; name the
    sizes where your implementation switches paths (`thresholds=(128, 4096)`) and the draws cover
    each side of them too. A failure shrinks to the smallest failing length, which the report
    names first ("seq=9" for keys truncated to 8).

    Example:
        >>> import shapesafe_mha as ssm
        >>> from shapesafe_mha.testing import check_attention
        >>> def mine(x, w, *, num_heads, num_kv_heads, is_causal):
        ...     q = ssm.split_heads(ssm.project(x, w.w_q, w.b_q), num_heads)
        ...     k = ssm.split_heads(ssm.project(x, w.w_k, w.b_k), num_kv_heads)
        ...     v = ssm.split_heads(ssm.project(x, w.w_v, w.b_v), num_kv_heads)
        ...     out = ssm.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        ...     return ssm.project(ssm.merge_heads(out), w.w_o, w.b_o)
        >>> check_attention(mine, max_examples=20)

    Raises:
        AssertionError: on a mismatch (or an exception from `fn`, chained), with the smallest
            failing config, the largest deviation, its batch and query position, and which heads
            are wrong.
    """

    def check(config: AttentionConfig, data: Any) -> float:
        weights = data.draw(attention_weights(config, dtype=dtype, device=device), label="weights")
        x = data.draw(attention_inputs(config, dtype=dtype, device=device), label="inputs").query
        return _compare(fn, config, x, weights, is_causal, dtype)

    run_property(check, kinds=kinds, max_examples=max_examples, thresholds=thresholds, base=settings)


def _load(module: nn.Module, weights: AttentionWeights) -> None:
    with torch.no_grad():
        for name in ("q", "k", "v", "o"):
            proj = getattr(module, f"{name}_proj")
            proj.weight.copy_(getattr(weights, f"w_{name}"))
            bias = getattr(weights, f"b_{name}")
            if bias is not None:
                proj.bias.copy_(bias)


def _default_forward(module: nn.Module, x: Tensor, is_causal: bool) -> Any:
    return module(x, is_causal=True) if is_causal else module(x)


def check_module(
    factory: Callable[[int, int, int, int, bool], nn.Module],
    *,
    forward: Callable[[nn.Module, Tensor, bool], Any] = _default_forward,
    kinds: Sequence[Kind] = ALL_KINDS,
    is_causal: bool = False,
    max_examples: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    thresholds: Sequence[int] = (),
    settings: settings | None = None,
) -> None:
    """`check_attention` for an `nn.Module` with `q_proj, k_proj, v_proj, o_proj` (nn.Linear) submodules.

    `factory(d_model, num_heads, num_kv_heads, d_head, bias)` builds the module; the drawn weights
    are copied into its projections; `forward(module, x, is_causal)` calls it (default
    `module(x)`, or `module(x, is_causal=True)`); a tuple result's first item is the output.

    Example:
        >>> import shapesafe_mha as ssm
        >>> from shapesafe_mha.testing import check_module
        >>> def build(d_model, num_heads, num_kv_heads, d_head, bias):
        ...     return ssm.MultiHeadAttention(d_model, num_heads, num_kv_heads, d_head=d_head, bias=bias)
        >>> check_module(build, max_examples=10)
    """

    def fn(x: Tensor, weights: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool) -> Tensor:
        d_model, d_head = weights.w_q.shape[1], weights.w_q.shape[0] // num_heads
        module = factory(d_model, num_heads, num_kv_heads, d_head, weights.bias).to(device=x.device, dtype=x.dtype)
        _load(module, weights)
        out = forward(module, x, is_causal)
        return out[0] if isinstance(out, tuple) else out

    check_attention(
        fn,
        kinds=kinds,
        is_causal=is_causal,
        max_examples=max_examples,
        device=device,
        dtype=dtype,
        thresholds=thresholds,
        settings=settings,
    )
