"""Conversions verify themselves: a converted layer and its source, compared on one small probe.

A conversion that decides what a layer computes by reading config fields is wrong the day a library
moves a field. So every conversion (`from_hf`, `to_hf`, `to_torch`, `from_weights`, `LatentAttention.from_hf`,
`HeadParallelAttention.from_module`) runs its result and its source on the same input: a prefill of
`PROMPT` positions (a causal forward) and one decoding step after it. A result that differs is refused
with a `ConfigError` naming the largest difference, where it was seen, and what is known to cause it.
`verify=False` skips the probe.

The probe costs far less than a load: float32 and float64 layers run as they are (in eval mode, their
mode restored after), half-precision ones as float32 copies; two calls a side, whose cost is reading
the weights once each.
"""

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .errors import ConfigError

BATCH, PROMPT = 2, 5
# Of the source's largest output. float64: transformers computes softmax and norms in float32 inside (~1e-7);
# float32: two orders of summation over d_model (~1e-6). A layer that computes something else differs by ~0.1.
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3}

_TINY = 1e-30  # the scale of an all-zero output: any difference from it is refused
Outputs = dict[str, Tensor]  # what was run ("a causal forward", "a decoding step") -> its output
FORWARD, DECODING = "a causal forward", "a decoding step"


def probeable(module: nn.Module) -> bool:
    """Whether the probe can compare values: no parameter on `meta` (which holds no values)."""
    return all(p.device.type != "meta" for p in module.parameters())


def device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def dtype_of(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer is probed in: its own for float32 and float64, float32 for half precision."""
    return dtype if dtype in TOLERANCE else torch.float32


@contextlib.contextmanager
def probing(module: nn.Module) -> Iterator[Any]:
    """`module` ready for the probe: itself in eval mode (its mode restored after), or an eval float32 copy
    where its dtype is half precision."""
    if probe_dtype(dtype_of(module)) != dtype_of(module):
        yield copy.deepcopy(module).to(torch.float32).eval()
        return
    training = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, mode in training:
            m.training = mode
        forget = getattr(module, "_forget", None)
        if callable(forget):
            forget()  # the probe's verdicts and fused weight: an inference cache a training user would carry


def probe_tokens(d_model: int, device: torch.device, dtype: torch.dtype, batch: int = BATCH) -> Tensor:
    """`(batch, PROMPT + 1, d_model)` inputs, the same for every probe."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, PROMPT + 1, d_model, generator=generator, dtype=torch.float64).to(device, dtype)


def shifted(what: str, shift: int) -> str:
    """The name of a probe's output whose rotary positions start at `shift` (0: the plain probe's name)."""
    if not shift:
        return what
    return f"{what} at positions {shift}..{shift + PROMPT - 1}" if what == FORWARD else f"{what} at {shift + PROMPT}"


def our_outputs(
    module: Any, x: Tensor, *, decode: bool = True, unrotated: bool = False, cache: Any = None, shift: int = 0
) -> Outputs:
    """A causal prefill of the prompt through `cache` (default `module.new_cache(batch, PROMPT + 1)`) and one
    decoding step after it; without `decode`, the causal forward alone. `unrotated` puts every position at 0,
    so rotary embeddings rotate nothing (to tell RoPE from the rest); `shift` starts the rotary positions there
    (a RoPE scaled by length, past the length it turns at)."""
    prompt, step = x[:, :PROMPT], x[:, PROMPT:]

    def at(start: int, chunk: Tensor) -> dict[str, Tensor]:
        if not shift:
            return {}
        positions = torch.arange(start, start + chunk.shape[1], device=x.device)
        return {"positions": positions.expand(chunk.shape[0], -1)}

    with torch.no_grad():
        if not decode:
            options = {"positions": torch.zeros(prompt.shape[:2], dtype=torch.long, device=x.device)}
            return {FORWARD: module(prompt, is_causal=True, **(options if unrotated else {}))}
        held = module.new_cache(x.shape[0], PROMPT + 1) if cache is None else cache
        outputs = {shifted(FORWARD, shift): module(prompt, is_causal=True, kv_cache=held, **at(shift, prompt))}
        outputs[shifted(DECODING, shift)] = module(step, is_causal=True, kv_cache=held, **at(shift + PROMPT, step))
    return outputs


def verify(
    owner: str,
    ours: Outputs,
    theirs: Outputs,
    *,
    source: str,
    suspects: Iterable[str] = (),
) -> float:
    """Raise `ConfigError` unless every output in `theirs` equals the one in `ours`; return the largest difference.

    `source` names what `theirs` came from; `suspects` are the known causes to name (config fields,
    structure) when they differ.
    """
    worst, where, scale, tolerance, dtype = 0.0, "", 1.0, 0.0, ""
    for what, expected in theirs.items():
        tolerance = max(tolerance, TOLERANCE.get(expected.dtype, 1e-3))
        dtype = str(expected.dtype).removeprefix("torch.")
        got = ours[what]
        if got.shape != expected.shape:
            raise ConfigError(
                f"{owner}: the converted layer returns {tuple(got.shape)} where {source} returns "
                f"{tuple(expected.shape)} ({what} on a probe); it would compute something else, so it is refused."
            )
        if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(expected).all())):
            worst, where, scale = math.inf, f"{what} (NaN or inf on a side)", 1.0  # never equal: fails closed
            break
        size = max(float(expected.abs().max()), _TINY)  # relative: a model's outputs may be 0.01 wide
        difference = float((got - expected).abs().max())
        if difference / size > worst / scale:
            worst, where, scale = difference, what, size
    if worst > tolerance * scale:
        causes = list(dict.fromkeys(suspects))
        because = f" Known to differ here: {'; '.join(causes)}." if causes else ""
        raise ConfigError(
            f"{owner}: the converted layer differs from {source} by {worst:.3g} in {where} "
            f"(probe: batch {BATCH}, {PROMPT} positions, {dtype}; tolerance "
            f"{tolerance * scale:.1g}); it would "
            f"compute something else, so it is refused.{because}"
        )
    return worst
