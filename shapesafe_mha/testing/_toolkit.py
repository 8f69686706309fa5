"""`check_attention` and `check_module`: property-test a user's attention against the reference."""

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from torch import Tensor, nn

from .._compute.reference import KVHeads, MaskMod, RopeStyle, ScoreMod
from .._core.errors import ConfigError
from .._core.weights import AttentionWeights
from ._diagnose import FLOAT32_INSIDE, Scenario, Tolerance, describe_matches, locate_heads, name_bug
from ._strategies import (
    ALL_KINDS,
    AttentionConfig,
    Kind,
    attention_configs,
    attention_inputs,
    attention_masks,
    key_padding_masks,
    projection_weights,
)

AttentionFn = Callable[..., Tensor]
# A FlexAttention mod, or a function of the drawn config that returns one (ALiBi's slopes depend on num_heads).
Mod = Callable[..., Any]


def _positional(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments `fn` takes; None when it takes any number (`*args`) or cannot be read."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in parameters)


def check_mod(name: str, mod: Any, arity: int) -> None:
    """Raise `ConfigError` unless `mod` is None, a FlexAttention mod taking `arity` arguments, or a function of
    the config (one argument) that returns one."""
    if mod is None:
        return
    signature = "(score, b, h, q_idx, kv_idx)" if arity == 5 else "(b, h, q_idx, kv_idx)"
    taken = _positional(mod) if callable(mod) else -1
    if taken not in (None, 1, arity):
        what = f"takes {taken} positional arguments" if callable(mod) else f"is a {type(mod).__name__}"
        raise ConfigError(
            f"{name} must be FlexAttention's {name}{signature}, or a function of the drawn AttentionConfig that "
            f"returns one (for mods that depend on the sizes); but it {what}."
        )


def mod_for(mod: Mod | None, arity: int, config: AttentionConfig) -> Any:
    """The mod for this config: `mod` itself, or what a function of the config returns."""
    if mod is None or _positional(mod) != 1:
        return mod
    made = mod(config)
    check_mod("score_mod" if arity == 5 else "mask_mod", made, arity)
    return made


def _mods_note(score_mod: Mod | None, mask_mod: Mod | None) -> str:
    """The property line of a check with mods (empty without: reports stay as they were)."""
    named = [
        f"{label}={getattr(mod, '__qualname__', None) or type(mod).__name__}{what}"
        for label, mod, what in (
            ("score_mod", score_mod, " on each query head's scaled scores"),
            ("mask_mod", mask_mod, " (True = may attend, combined with the other masks)"),
        )
        if mod is not None
    ]
    return "\n  property: the reference applies " + " and ".join(named) if named else ""


TOLERANCES = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 6e-2,
}


def tolerance(dtype: torch.dtype) -> float:
    """The absolute deviation (on outputs of order 1) accepted for `dtype`."""
    return TOLERANCES.get(dtype, 1e-4)


def resolve(dtype: torch.dtype, atol: float | None, rtol: float | None) -> Tolerance:
    """The tolerance of a check: `atol`/`rtol` where given, else the dtype's absolute tolerance."""
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None and not (isinstance(value, int | float) and value >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return Tolerance(tolerance(dtype) if atol is None else float(atol), 0.0 if rtol is None else float(rtol))


def _describe(config: AttentionConfig, is_causal: bool, dtype: torch.dtype) -> str:
    bias = config.bias if config.bias_on == "qkvo" or not config.bias else f"{config.bias_on!r}"
    cross = f", kv_seq={config.kv_seq}" if config.kv_seq != config.seq else ""
    return (
        f"seq={config.seq}, batch={config.batch}, d_model={config.d_model}, num_heads={config.num_heads}, "
        f"num_kv_heads={config.num_kv_heads}, d_head={config.d_head}, bias={bias}, is_causal={is_causal}{cross} "
        f"({config.kind}, group={config.group}, {str(dtype).removeprefix('torch.')})"
    )


class FailedCheckError(AssertionError):
    """A failed property check (`check_attention`, `check_module`, `check_hf_attention`): an `AssertionError`.

    Its report starts with the property that failed, the smallest failing config and, where a classic mistake
    matches the wrong output, the bug class; then where the output is furthest off and which heads are wrong.
    `deviation`: how far the failing example's output was off (None: no deviation, such as an exception).
    """

    def __init__(self, report: str, deviation: float | None = None) -> None:
        super().__init__(report)
        self.deviation = deviation


FailedCheckError.__module__ = "shapesafe_mha.testing"


class _ValueMismatchError(FailedCheckError):
    """A wrong value; the bug class and the wrong heads are found once, on the example hypothesis reports."""

    def __init__(self, report: str, deviation: float, diagnose: Callable[[], tuple[str, str]], worst: str) -> None:
        super().__init__(report + worst, deviation)
        self.head, self.worst, self.diagnose = report, worst, diagnose

    def report(self) -> str:
        """In full: the property, the smallest config, the bug class, where it is furthest off, the wrong heads."""
        bug, heads = self.diagnose()
        return self.head + bug + self.worst + heads


def _where_worst(excess: Tensor) -> str:
    if excess.ndim != 3:
        return ""
    _, seq, width = excess.shape
    flat = int(excess.argmax().item())
    b, position, feature = flat // (seq * width), (flat // width) % seq, flat % width
    return f"\n  largest deviation at batch {b}, query position {position}, output feature {feature}"


def judge(
    got: Any,
    scenario: Scenario,
    tol: Tolerance,
    dtype: torch.dtype,
    where: str,
    *,
    run: Callable[[AttentionWeights], Tensor] | None = None,
    rows: Tensor | None = None,
    lenient_float64: bool = False,
    what: str = "the implementation",
) -> float:
    """Compare `got` with the scenario's reference; return the largest deviation or raise AssertionError.

    `rows` selects the outputs that count (padded queries do not); `run(weights)` re-runs the code
    with other weights, to find the wrong heads. In float64, a deviation of float32 rounding is
    reported as such (`lenient_float64`: accepted), not as a wrong formula.
    """
    expected = scenario.expected()
    if rows is not None:
        expected = expected[rows]
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        raise AssertionError(
            f"{what} returned shape {shape}, expected {tuple(expected.shape)}\n  smallest failing config: {where}"
        )
    got = got.double()
    if not got.numel():
        return 0.0
    deviation = (got - expected).abs()
    worst = deviation.max().item()
    excess = tol.excess(got, expected)
    if excess.max().item() <= 0:
        return worst
    float32_inside = dtype == torch.float64 and worst <= FLOAT32_INSIDE  # NaN is not
    if float32_inside and lenient_float64:
        return worst
    report = f"{what} differs from the per-head reference by {worst:.3g} ({tol})"
    # A deviation that small is float32 rounding unless a wrong formula gives `got` itself (ALiBi's slopes
    # per KV head in MQA's smallest example are off by 6.8e-6): matching a variant within tol is no rounding.
    matches = name_bug(got, scenario, tol, rows) if float32_inside else None
    if float32_inside and not matches:
        raise FailedCheckError(
            f"{report}: float32 rounding, not a wrong formula: it computes in float32 inside (softmax?); "
            f"pass atol={FLOAT32_INSIDE:g} to accept that, or check in float32\n  smallest failing config: {where}",
            worst,
        )

    def diagnose() -> tuple[str, str]:
        bug = describe_matches(matches if matches is not None else name_bug(got, scenario, tol, rows))
        heads = locate_heads(run, scenario, tol, rows) if run is not None else ""
        return (f"\n  {bug}" if bug else "", f"\n  {heads}" if heads else "")

    raise _ValueMismatchError(f"{report}\n  smallest failing config: {where}", worst, diagnose, _where_worst(excess))


def _compare(
    fn: AttentionFn,
    config: AttentionConfig,
    x: Tensor,
    weights: AttentionWeights,
    is_causal: bool,
    dtype: torch.dtype,
    *,
    tol: Tolerance | None = None,
    kv_heads: KVHeads = "grouped",
    rope_style: RopeStyle = "half",
    extra: dict[str, Any] | None = None,
    memory: Tensor | None = None,
    note: str = "",
) -> float:
    """Run `fn` and the reference; return the largest deviation or raise a readable AssertionError.

    `extra` are the keyword arguments a property adds to the call (`attn_mask`, `key_padding_mask`,
    `memory`, `rope_theta`, `positions`, `score_mod`, `mask_mod`); the reference gets the same.
    `note` follows the config in a report (the property checked).
    """
    where = _describe(config, is_causal, dtype) + note
    extra = extra or {}

    def run(w: AttentionWeights) -> Any:
        return fn(x, w, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=is_causal, **extra)

    try:
        got = run(weights)
    except UnsatisfiedAssumption:
        raise  # hypothesis.assume() in the user's function: skip this example, it is no failure
    except Exception as error:
        raise AssertionError(
            f"the implementation raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}\n"
            f"  smallest failing config: {where}"
        ) from error
    wide = x.double()
    source = wide if memory is None else memory.double()
    scenario = Scenario.of(
        wide,
        source,
        source,
        _to(weights, torch.float64),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        is_causal=is_causal,
        attn_mask=extra.get("attn_mask"),
        key_padding_mask=extra.get("key_padding_mask"),
        rope_theta=extra.get("rope_theta"),
        positions=extra.get("positions"),
        rope_style=rope_style,
        kv_heads=kv_heads,
        score_mod=extra.get("score_mod"),
        mask_mod=extra.get("mask_mod"),
    )
    return judge(got, scenario, resolve(dtype, None, None) if tol is None else tol, dtype, where, run=run)


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
    configs: st.SearchStrategy[AttentionConfig] | None = None,
) -> None:
    """Run `check(config, data)` on hypothesis-drawn configs; it returns a deviation or raises AssertionError.

    `base` (default: the active hypothesis profile) gives the budget unless `max_examples` is set.
    `configs` replaces the default strategy of configs. The AssertionError raised is the report
    alone: no hypothesis notes (drawn tensors, the falsifying call), the cause still chained.
    """
    __tracebackhide__ = True  # pytest shows the user's call, not our frames
    base = settings() if base is None else base
    if configs is None:
        configs = attention_configs(kinds, cross=cross, thresholds=thresholds)

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
    @given(config=configs, data=st.data())
    def prop(config: AttentionConfig, data: Any) -> None:
        deviation = check(config, data)
        if on_example is not None:
            on_example(deviation)

    try:
        prop()
    except _ValueMismatchError as mismatch:  # the final, smallest example: now name the bug and the heads
        raise FailedCheckError(mismatch.report(), mismatch.deviation) from None
    except AssertionError as failure:
        # without hypothesis' notes, which dump tensors
        clean = FailedCheckError(str(failure), failure.deviation if isinstance(failure, FailedCheckError) else None)
        raise clean from failure.__cause__
    except Exception as error:  # not a failed check: the error as raised, without hypothesis' notes
        if hasattr(error, "__notes__"):
            del error.__notes__
        raise


def _configs(
    configs: st.SearchStrategy[AttentionConfig] | None,
    kinds: Sequence[Kind],
    thresholds: Sequence[int],
    constraints: dict[str, Any],
) -> st.SearchStrategy[AttentionConfig]:
    if configs is not None:
        if any(value is not None for value in constraints.values()):
            raise ValueError("pass either configs= or constraints (bias, max_heads, ...), not both")
        return configs
    given_ = {name: value for name, value in constraints.items() if value is not None}
    return attention_configs(kinds, thresholds=thresholds, **given_)


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
    configs: st.SearchStrategy[AttentionConfig] | None = None,
    bias: bool | str | None = None,
    max_heads: int | None = None,
    even_d_head: bool | None = None,
    d_model_is_inner: bool | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    kv_heads: KVHeads = "grouped",
    masks: bool = False,
    cross: bool = False,
    rope: bool = False,
    rope_style: RopeStyle = "half",
    score_mod: ScoreMod | Mod | None = None,
    mask_mod: MaskMod | Mod | None = None,
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

    The draws: `configs=` (a strategy of `AttentionConfig`, e.g. `attention_configs(...)` with your
    own bounds), or constraints passed on to `attention_configs`: `bias` (True, False, or the
    projections that have one: `"qkv"`), `max_heads`, `even_d_head`, `d_model_is_inner`
    (`d_model == num_heads * d_head`).

    More properties, each passing more keyword arguments to `fn`: `masks=True` draws a bool or float
    `attn_mask` (True = may attend, float added) and a `key_padding_mask` (True = padding);
    `cross=True` draws `memory (batch, kv_seq, d_model)`, the keys' and values' source, with
    `kv_seq != seq`; `rope=True` passes `rope_theta` and `positions (batch, seq)`, and the reference
    rotates queries and keys itself (`rope_style="half"`: rotate_half, as Llama; `"interleaved"`:
    pairs `(2i, 2i+1)`, as GPT-J). `kv_heads="interleaved"` says that query head `i` reads KV head
    `i % num_kv_heads` (x-transformers) instead of `i // group` (transformers, torch).

    Variants, with FlexAttention's signatures (`torch.nn.attention.flex_attention`):
    `score_mod(score, b, h, q_idx, kv_idx)` modifies each head's scaled scores (a per-head
    temperature, ALiBi, a softcap), `h` being the *query* head; `mask_mod(b, h, q_idx, kv_idx)` says
    where a query may attend (True), combined with the other masks (a document mask, a window). The
    reference applies them, and `fn` receives them as keyword arguments `score_mod=`/`mask_mod=`
    (pass them on to `flex_attention`, or ignore them where your code computes the variant itself).
    A mod that depends on the sizes may be given as a function of the drawn `AttentionConfig` that
    returns the mod (`lambda config: alibi(config.num_heads)`). A report then names the property
    ("property: the reference applies score_mod=..."), and the bug class where a classic mistake
    matches (the mod given the KV head instead of the query head, its heads reversed, its sign
    flipped, its indices swapped, not applied; a mask_mod negated or not applied).

    Tolerance: `|got - expected| <= atol + rtol * |expected|`, by default `atol=tolerance(dtype)`,
    `rtol=0`. A float64 deviation of float32 rounding (under 1e-5) is reported as that ("computes
    in float32 inside (softmax?)"), not as a bug.

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
            failing config, the largest deviation, its batch and query position, the bug class
            where a variant of the reference matches (KV heads tiled, causal mask shifted, ...),
            and which heads are wrong.
    """
    __tracebackhide__ = True  # a failure shows the user's call and the report, not our frames (pytest)
    try:
        _check(
            fn, None, kinds=kinds, is_causal=is_causal, max_examples=max_examples, device=device, dtype=dtype,
            thresholds=thresholds, settings=settings, configs=configs, bias=bias, max_heads=max_heads,
            even_d_head=even_d_head, d_model_is_inner=d_model_is_inner, atol=atol, rtol=rtol, kv_heads=kv_heads,
            masks=masks, cross=cross, rope=rope, rope_style=rope_style, score_mod=score_mod, mask_mod=mask_mod,
        )  # fmt: skip
    except FailedCheckError as failure:  # raised here, without the frames of ours below (the cause kept)
        raise failure.with_traceback(None) from failure.__cause__


def _check(
    fn: AttentionFn,
    prepare: Callable[[AttentionConfig, AttentionWeights], AttentionWeights] | None,
    *,
    kinds: Sequence[Kind],
    is_causal: bool,
    max_examples: int | None,
    device: torch.device | str | None,
    dtype: torch.dtype,
    thresholds: Sequence[int],
    settings: settings | None,
    configs: st.SearchStrategy[AttentionConfig] | None,
    bias: bool | str | None,
    max_heads: int | None,
    even_d_head: bool | None,
    d_model_is_inner: bool | None,
    atol: float | None,
    rtol: float | None,
    kv_heads: KVHeads,
    masks: bool = False,
    cross: bool = False,
    rope: bool = False,
    rope_style: RopeStyle = "half",
    score_mod: Mod | None = None,
    mask_mod: Mod | None = None,
) -> None:
    """`check_attention`, with `prepare(config, weights)` turning the drawn weights into those the code holds."""
    __tracebackhide__ = True
    if device is not None and torch.device(device).type == "meta":
        raise ConfigError(
            f"device={str(device)!r}: these checks compare values with the reference, and meta tensors hold none; "
            "check on cpu or cuda (shapesafe_mha.prove checks shapes, which meta can)."
        )
    tol = resolve(dtype, atol, rtol)
    check_mod("score_mod", score_mod, 5)
    check_mod("mask_mod", mask_mod, 4)
    note = _mods_note(score_mod, mask_mod)
    strategy = _configs(
        configs,
        kinds,
        thresholds,
        {
            "bias": bias,
            "max_heads": max_heads,
            "even_d_head": even_d_head or (True if rope else None),
            "d_model_is_inner": d_model_is_inner,
            "cross": cross if configs is None else None,
            "rope": rope or None,
        },
    )

    def check(config: AttentionConfig, data: Any) -> float:
        weights = data.draw(projection_weights(config, dtype=dtype, device=device), label="weights")
        if prepare is not None:
            try:
                weights = prepare(config, weights)
            except Exception as error:
                first = str(error).splitlines()[0] if str(error) else ""
                raise AssertionError(
                    f"building the module or loading the drawn weights raised {type(error).__name__}: {first}\n"
                    f"  smallest failing config: {_describe(config, is_causal, dtype)}"
                ) from error
        inputs = data.draw(attention_inputs(config, dtype=dtype, device=device), label="inputs")
        extra: dict[str, Any] = {}
        memory = None
        if cross:
            memory = extra["memory"] = inputs.key
        if masks:
            mask = data.draw(attention_masks(config, device=device), label="attn_mask")
            if mask is not None and data.draw(st.booleans(), label="float mask"):
                mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, -1e4)
            extra["attn_mask"] = mask
            extra["key_padding_mask"] = data.draw(key_padding_masks(config, device=device), label="padding")
        if rope:
            extra["rope_theta"] = config.rope_theta or 10000.0
            start = data.draw(st.integers(0, 64), label="first position")
            extra["positions"] = torch.arange(start, start + config.seq, device=device).expand(config.batch, -1)
        if score_mod is not None:
            extra["score_mod"] = mod_for(score_mod, 5, config)
        if mask_mod is not None:
            extra["mask_mod"] = mod_for(mask_mod, 4, config)
        return _compare(
            fn, config, inputs.query, weights, is_causal, dtype,
            tol=tol, kv_heads=kv_heads, rope_style=rope_style, extra=extra, memory=memory, note=note,
        )  # fmt: skip

    run_property(check, kinds=kinds, max_examples=max_examples, base=settings, configs=strategy)


def _default_forward(module: nn.Module, x: Tensor, is_causal: bool) -> Any:
    return module(x, is_causal=True) if is_causal else module(x)


def module_adapter(
    factory: Callable[..., nn.Module],
    forward: Callable[[nn.Module, Tensor, bool], Any] = _default_forward,
    load: Callable[[nn.Module, AttentionWeights], AttentionWeights | None] | None = None,
) -> tuple[AttentionFn, Callable[[AttentionConfig, AttentionWeights], AttentionWeights]]:
    """`(fn, prepare)`: a module factory as a `check_attention` function, and the weights it holds once loaded."""
    from .._interop.adapters import load_weights

    loader = load_weights if load is None else load

    def build(d_model: int, num_heads: int, num_kv_heads: int, d_head: int, has_bias: bool, like: Tensor) -> nn.Module:
        module = factory(d_model, num_heads, num_kv_heads, d_head, has_bias)
        return module.to(device=like.device, dtype=like.dtype)

    def prepare(config: AttentionConfig, weights: AttentionWeights) -> AttentionWeights:
        """The weights the module holds once loaded (a projection without a bias drops the drawn one)."""
        module = build(config.d_model, config.num_heads, config.num_kv_heads, config.d_head, config.bias, weights.w_q)
        loaded = loader(module, weights)
        return weights if loaded is None else loaded

    def fn(
        x: Tensor, weights: AttentionWeights, *, num_heads: int, num_kv_heads: int, is_causal: bool, **mods: Any
    ) -> Tensor:
        """The module computes its variant itself: the mods (`score_mod`, `mask_mod`) are the reference's."""
        d_model, d_head = weights.w_q.shape[1], weights.w_q.shape[0] // num_heads
        has_bias = any(b is not None for b in (weights.b_q, weights.b_k, weights.b_v, weights.b_o))
        module = build(d_model, num_heads, num_kv_heads, d_head, has_bias, x)
        loader(module, weights)
        out = forward(module, x, is_causal)
        return out[0] if isinstance(out, tuple) else out

    return fn, prepare


def decoding(
    step: Callable[[nn.Module, Tensor, Any], tuple[Tensor, Any]],
) -> Callable[[nn.Module, Tensor, bool], Tensor]:
    """A `forward` that decodes: `step(module, chunk, cache) -> (out, cache)` on a prefill, then token by token.

    The prefill is the first half of the sequence (at least one token); `cache` is None at first.
    """

    def forward(module: nn.Module, x: Tensor, is_causal: bool) -> Tensor:
        prefill = max(1, x.shape[1] // 2)
        out, cache = step(module, x[:, :prefill], None)
        pieces = [out[0] if isinstance(out, tuple) else out]
        for i in range(prefill, x.shape[1]):
            out, cache = step(module, x[:, i : i + 1], cache)
            pieces.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(pieces, dim=1)

    return forward


def check_module(
    factory: Callable[..., nn.Module],
    *,
    forward: Callable[[nn.Module, Tensor, bool], Any] = _default_forward,
    decode_step: Callable[[nn.Module, Tensor, Any], tuple[Tensor, Any]] | None = None,
    load: Callable[[nn.Module, AttentionWeights], AttentionWeights | None] | None = None,
    kinds: Sequence[Kind] = ALL_KINDS,
    is_causal: bool = False,
    max_examples: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
    thresholds: Sequence[int] = (),
    settings: settings | None = None,
    configs: st.SearchStrategy[AttentionConfig] | None = None,
    bias: bool | str | None = None,
    max_heads: int | None = None,
    even_d_head: bool | None = None,
    d_model_is_inner: bool | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    kv_heads: KVHeads = "grouped",
    score_mod: ScoreMod | Mod | None = None,
    mask_mod: MaskMod | Mod | None = None,
) -> None:
    """`check_attention` for an `nn.Module`: build it, load the drawn weights, call it.

    `factory(d_model, num_heads, num_kv_heads, d_head, bias)` builds the module; the drawn weights
    are loaded by `load(module, weights)` (default: `shapesafe_mha.testing.load_weights`, which
    finds q/k/v/o `nn.Linear`s under the usual names, a fused qkv `nn.Linear` or GPT-2's `Conv1D`,
    any subset of biases); `forward(module, x, is_causal)` calls it (default `module(x)`, or
    `module(x, is_causal=True)`); a tuple result's first item is the output. The budget and the
    draws are as in `check_attention` (the active hypothesis profile's, unless `max_examples`).

    `decode_step(module, chunk, cache) -> (out, cache)` checks decoding instead: a prefill of half
    the sequence, then one token at a time (`cache` is None at first, then what the last step
    returned), concatenated, must equal one causal forward of the reference.

    `score_mod` and `mask_mod` (FlexAttention's signatures, or functions of the config that return
    one, as in `check_attention`) say what variant the module computes: the reference applies them
    (`h` is the query head), and the module is called as always (it computes the variant itself).

    Example:
        >>> import shapesafe_mha as ssm
        >>> from shapesafe_mha.testing import check_module
        >>> def build(d_model, num_heads, num_kv_heads, d_head, bias):
        ...     return ssm.MultiHeadAttention(d_model, num_heads, num_kv_heads, d_head=d_head, bias=bias)
        >>> check_module(build, max_examples=10)
    """
    if decode_step is not None:
        forward, is_causal = decoding(decode_step), True
    __tracebackhide__ = True  # a failure shows the user's call and the report, not our frames (pytest)
    fn, prepare = module_adapter(factory, forward, load)
    try:
        _check(
            fn, prepare, kinds=kinds, is_causal=is_causal, max_examples=max_examples, device=device, dtype=dtype,
            thresholds=thresholds, settings=settings, configs=configs, bias=bias, max_heads=max_heads,
            even_d_head=even_d_head, d_model_is_inner=d_model_is_inner, atol=atol, rtol=rtol, kv_heads=kv_heads,
            score_mod=score_mod, mask_mod=mask_mod,
        )  # fmt: skip
    except FailedCheckError as failure:  # raised here, without the frames of ours below (the cause kept)
        raise failure.with_traceback(None) from failure.__cause__
