"""Rotary position embeddings (RoPE): the frequency tables, and the rotation as a typed stage.

Query and key features are rotated in pairs `(i, i + d_head/2)` by the angle `position * inv_freq[i]`,
so the score between two positions depends only on their distance; interleaved RoPE (Cohere, GLM) pairs
`(2i, 2i+1)` instead, and partial rotary (Phi, StableLM, GLM) rotates only each head's first `d_rope`
features, passing the rest unrotated. Tables are computed as
transformers computes them (frequencies and angles in float32, then cast), so a layer loaded with
`MultiHeadAttention.from_hf` computes what the Hugging Face layer computes.

Two scalings choose their frequencies by the length of each call, `max(positions) + 1`, as transformers'
`dynamic_rope_update` does: "dynamic" (NTK) raises theta once a call reaches past `max_position_embeddings`,
"longrope" (Phi-3) turns from its short factors to its long ones past `original_max_position_embeddings`. The
keys a cache holds keep the rotation of the call that wrote them, so decoding past that length is not a one-shot
forward over the same positions (whose keys all turn by the longest call's frequencies): it is what a
transformers model decoding through its `DynamicCache` computes.
"""

import copy
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._core.contract import compiling, stage
from .._core.dims import Heads, PartialRotaryTable, Positions, RotaryTable, SameSeqKVHeads
from .._core.errors import ConfigError
from .._core.messages import mismatch
from . import kernels as K

SUPPORTED_SCALING = ("default", "llama3", "yarn", "dynamic", "longrope")
# Scalings whose frequencies depend on the length of each call (transformers' `dynamic_rope_update`).
BY_LENGTH = ("dynamic", "longrope")


def check_rotary_width(d_head: int, owner: str, name: str = "d_head") -> None:
    """Raise `ConfigError` unless `d_head` (or the rotary part `name`) is an even int: RoPE rotates feature pairs."""
    try:
        width = operator.index(d_head)  # an int, or a numpy or one-element torch integer
    except (TypeError, RuntimeError, ValueError):
        width = None
    if width is None or isinstance(d_head, bool):
        raise ConfigError(f"{owner}: {name} must be an int (the features a head rotates), but got {d_head!r}.")
    if width % 2:
        raise ConfigError(
            f"{owner}: {name}={d_head} is odd, but rotary embeddings rotate pairs of features; "
            f"use an even {name} (for example {f'{d_head - 1} or ' if d_head > 1 else ''}{d_head + 1})."
        )


def _kind(scaling: Mapping[str, Any] | None) -> str:
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(
            f"RotaryEmbedding(): rope_scaling must be a dict of transformers' rope_parameters, such as "
            f"{{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 4096}}, but got {scaling!r}."
        )
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _number(scaling: Mapping[str, Any], field: str, *, required: bool = True, positive: bool = True) -> Any:
    """`scaling[field]`, a finite number (positive unless told), or None where it may be left out."""
    value = scaling.get(field)
    if value is None and not required:
        return None
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        kind = "a positive finite number" if positive else "a finite number"
        raise ConfigError(
            f"RotaryEmbedding(): rope_parameters[{field!r}] must be {kind} for rope_type={_kind(scaling)!r}, "
            f"but got {value!r}."
        )
    return value


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: Mapping[str, Any] | None = None) -> float:
    """The factor the cos/sin tables are multiplied by: 1 but for YaRN, whose `attention_factor` is given or is
    `0.1 * log(factor) + 1` (with DeepSeek's `mscale`/`mscale_all_dim`, the ratio of two such terms), and for
    LongRoPE, whose `attention_factor` is given or is `sqrt(1 + log(factor) / log(original_max_position_embeddings))`
    (1 where `factor <= 1`), for short and long factors alike.

    Example:
        >>> import shapesafe_mha as ssm
        >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        >>> round(ssm.RotaryEmbedding(8, 10000.0, yarn).attention_factor, 4)
        1.1386

    Raises:
        ConfigError: a YaRN or LongRoPE field is missing or not a number (named).
    """
    if scaling is not None and _kind(scaling) == "longrope":
        return _longrope_factor(scaling)
    if scaling is None or _kind(scaling) != "yarn":
        return 1.0
    given = _number(scaling, "attention_factor", required=False)
    if given is not None:
        return given
    factor = _number(scaling, "factor")
    mscale = _number(scaling, "mscale", required=False, positive=False)
    mscale_all_dim = _number(scaling, "mscale_all_dim", required=False, positive=False)
    if mscale and mscale_all_dim:  # as transformers tests them: 0 and None alike mean "not given"
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn(d_head: int, theta: float, scaling: Mapping[str, Any]) -> Tensor:
    """YaRN: frequencies of few rotations over the original context are slowed by `factor`, those of many kept,
    the ones between ramped linearly (the ramp's ends rounded outwards unless `truncate=False`)."""
    factor = _number(scaling, "factor")
    context = _number(scaling, "original_max_position_embeddings")
    # `or`, as transformers reads them: a 0 is the default too.
    beta_fast = _number(scaling, "beta_fast", required=False) or 32
    beta_slow = _number(scaling, "beta_slow", required=False) or 1
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(
            f"RotaryEmbedding(): rope_parameters['truncate'] must be True or False for rope_type='yarn', "
            f"but got {truncate!r}."
        )

    def dimension(rotations: float) -> float:  # the pair index that turns `rotations` times over the context
        return (d_head * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_head - 1)
    if low == high:
        high += 0.001  # transformers' guard against a ramp of width 0
    ramp = torch.clamp((torch.arange(d_head // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    # As transformers computes it: from the powers of theta, not from inv_freq (the last bit differs).
    powers = theta ** (torch.arange(0, d_head, 2).to(dtype=torch.float) / d_head)
    return (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept


def _longrope_factor(scaling: Mapping[str, Any]) -> float:
    """LongRoPE's attention factor, as transformers' `_compute_longrope_parameters` sets it."""
    given = _number(scaling, "attention_factor", required=False)
    if given is not None:
        return given
    context = _context(scaling)
    factor = _number(scaling, "factor", required=False)
    if factor is None:
        raise ConfigError(
            "RotaryEmbedding(): rope_parameters['factor'] (or 'attention_factor') must be given for "
            "rope_type='longrope'; transformers takes it as max_position_embeddings / original_max_position_embeddings."
        )
    if factor > 1.0 and context == 1:
        raise ConfigError(
            "RotaryEmbedding(): rope_parameters['original_max_position_embeddings']=1 leaves LongRoPE's attention "
            "factor undefined (it divides by log(1) = 0); give rope_parameters['attention_factor']."
        )
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))


def _context(scaling: Mapping[str, Any]) -> int:
    """The length past which a scaling by length turns: dynamic's `max_position_embeddings`, longrope's original."""
    field = "max_position_embeddings" if _kind(scaling) == "dynamic" else "original_max_position_embeddings"
    value = _number(scaling, field)
    if not isinstance(value, int):
        raise ConfigError(
            f"RotaryEmbedding(): rope_parameters[{field!r}] must be a positive int for rope_type={_kind(scaling)!r}, "
            f"but got {value!r}."
        )
    return value


def _extension_factors(scaling: Mapping[str, Any], field: str, d_head: int) -> Tensor:
    """LongRoPE's `short_factor` or `long_factor`: one positive number for each of the `d_head / 2` pairs."""
    value = scaling.get(field)
    numbers = isinstance(value, list | tuple) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value
    )
    if not numbers or not isinstance(value, list | tuple) or len(value) != d_head // 2:
        raise ConfigError(
            f"RotaryEmbedding(): rope_parameters[{field!r}] must be a list of d_head/2={d_head // 2} positive numbers "
            f"(one for each pair of the rotated features) for rope_type='longrope', but got {value!r}."
        )
    return torch.tensor(value, dtype=torch.float32)


def _longrope(d_head: int, theta: float, scaling: Mapping[str, Any], field: str) -> Tensor:
    """LongRoPE: each pair's frequency divided by its factor, `1 / (factor[i] * theta ** (2i / d_head))`."""
    factors = _extension_factors(scaling, field, d_head)
    return 1.0 / (factors * theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head))


def _dynamic(d_head: int, theta: float, scaling: Mapping[str, Any], length: Tensor | int) -> Tensor:
    """Dynamic NTK: theta raised to `theta * (factor * length / context - (factor - 1)) ** (d / (d - 2))` for a call
    `length` long (at least `context`), as transformers computes it: at its init (`length <= context`) in Python
    floats, past it, from the tensor of the call's length, in float32 tensors (which round otherwise)."""
    factor, context = _number(scaling, "factor"), _context(scaling)
    if d_head < 4:
        raise ConfigError(
            f"RotaryEmbedding(): rope_type='dynamic' needs d_head >= 4 rotated features (its exponent is "
            f"d / (d - 2)), but got d_head={d_head}."
        )
    if not isinstance(length, Tensor) and length > context:
        length = torch.tensor(length)
    if isinstance(length, Tensor):
        length = torch.maximum(length, torch.tensor(context, dtype=length.dtype, device=length.device))
    else:
        length = context
    base = theta * ((factor * length / context) - (factor - 1)) ** (d_head / (d_head - 2))
    device = length.device if isinstance(length, Tensor) else None
    return 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.int64, device=device).float() / d_head))


def long_frequencies(
    d_head: int,
    theta: float,
    scaling: Mapping[str, Any],
    length: Tensor | int,
    *,
    short: Tensor | None = None,
    long: Tensor | None = None,
) -> Tensor:
    """The frequencies of a call `length` long (`max(positions) + 1`) under a scaling by length: for "dynamic"
    those of NTK scaling at `length` once past `max_position_embeddings`, for "longrope" the long factors' once
    past `original_max_position_embeddings`; below, the frequencies `inverse_frequencies` gives.

    Example:
        >>> from shapesafe_mha import long_frequencies
        >>> dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}
        >>> long_frequencies(8, 10000.0, dynamic, 16), long_frequencies(8, 10000.0, dynamic, 32)[1:]
        (tensor([1.0000, 0.1000, 0.0100, 0.0010]), tensor([0.0693, 0.0048, 0.0003]))

    Arguments:
        d_head, theta, scaling: as `inverse_frequencies` takes them (`d_head` the rotated width).
        length: the call's `max(positions) + 1`, an int or a 0-d tensor (then chosen on its device, no sync).
        short, long: the frequencies below and past the turn where already computed (a module's buffers).

    Returns:
        `(d_head / 2,)` float32 frequencies, one set for the whole call.

    Raises:
        ConfigError: `scaling` is not a scaling by length, or a field is missing or wrong (named).
    """
    kind = _kind(scaling)
    if kind not in BY_LENGTH:
        raise ConfigError(f"long_frequencies(): rope_type={kind!r} does not depend on the length (only {BY_LENGTH}).")
    short = inverse_frequencies(d_head, theta, scaling) if short is None else short
    if kind == "dynamic":
        long = _dynamic(d_head, theta, scaling, length)
    elif long is None:
        long = _longrope(d_head, theta, scaling, "long_factor")
    if not isinstance(length, Tensor):
        return long if length > _context(scaling) else short
    # One set for the whole call, chosen on the device (no sync), as transformers' torch.where chooses.
    return torch.where(length > _context(scaling), long.to(length.device), short.to(length.device))


def inverse_frequencies(d_head: int, theta: float, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """`1 / theta ** (2i / d_head)` for each pair `i`, in float32; llama3- or YaRN-style scaling if asked for;
    for the scalings by length ("dynamic", "longrope"), the frequencies of calls no longer than their context
    (dynamic's unscaled, longrope's short factors'; `long_frequencies` gives those of a longer call).

    Example:
        >>> from shapesafe_mha import inverse_frequencies
        >>> inverse_frequencies(8, theta=10000.0)
        tensor([1.0000, 0.1000, 0.0100, 0.0010])

    Raises:
        ConfigError: `d_head` is odd, `theta` is not positive, `scaling` asks for a RoPE type other than
            "default", "llama3", "yarn", "dynamic" and "longrope", or one of its fields is missing or not a
            number (named).
    """
    check_rotary_width(d_head, "RotaryEmbedding()")
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"RotaryEmbedding(): rope_theta must be a positive finite number, but got {theta!r}.")
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).to(dtype=torch.float) / d_head))
    kind = _kind(scaling)
    if kind == "default":
        return inv_freq
    if kind not in SUPPORTED_SCALING or scaling is None:
        raise ConfigError(
            f"RotaryEmbedding(): rope_type={kind!r} is not supported (only {', '.join(SUPPORTED_SCALING)}); "
            "its positions would differ from the model's."
        )
    if kind == "yarn":
        return _yarn(d_head, theta, scaling)
    if kind == "dynamic":  # transformers' init: the length is max_position_embeddings, theta as given
        return _dynamic(d_head, theta, scaling, _context(scaling))
    if kind == "longrope":
        _extension_factors(scaling, "long_factor", d_head)  # checked now, not at the first long call
        return _longrope(d_head, theta, scaling, "short_factor")
    factor, low, high = (_number(scaling, f) for f in ("factor", "low_freq_factor", "high_freq_factor"))
    context = _number(scaling, "original_max_position_embeddings")
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the ones between interpolated.
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(between, smoothed, scaled)


_ROUNDING = (torch.float16, torch.bfloat16)  # dtypes that cannot hold the frequencies (float32 is computed)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of rotary position embeddings for given positions.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> rope = ssm.RotaryEmbedding(d_head=8, theta=10000.0)
        >>> cos, sin = rope(torch.arange(5)[None], dtype=torch.float32)
        >>> cos.shape
        torch.Size([1, 5, 8])

    Arguments:
        d_head: the width of the rotated features (even): a head's, or its rotary part's (partial rotary).
        theta: the base of the frequencies (`rope_theta`).
        scaling: transformers' `rope_parameters`/`rope_scaling` dict; "default", "llama3", "yarn", "dynamic"
            and "longrope" types (YaRN's and LongRoPE's tables are multiplied by their `attention_factor`, as
            transformers' rotary classes do). "dynamic" takes `factor` and `max_position_embeddings` (which
            transformers reads from the config), "longrope" `short_factor`, `long_factor` (`d_head / 2` each),
            `original_max_position_embeddings` and `factor` or `attention_factor`; both choose each call's
            frequencies by its length, `max(positions) + 1` (see `long_frequencies`).
        interleaved: tables for adjacent pairs, each angle twice in a row (`apply_rotary(..., interleaved=True)`),
            instead of `cat(angles, angles)` for halves.

    Raises:
        ConfigError: a scaling it does not take; an argument set to another value on a built module (its
            frequencies, and the layout the module holding it pairs features by, were built from them: build
            another).
    """

    def __init__(
        self, d_head: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.d_head, self.theta, self.interleaved = d_head, theta, bool(interleaved)
        _kind(scaling)  # a mapping, or refused by name before it is read
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("inv_freq", inverse_frequencies(d_head, theta, scaling), persistent=False)
        self.by_length = _kind(scaling) in BY_LENGTH
        self.context = _context(scaling) if scaling is not None and self.by_length else None
        longrope = scaling is not None and _kind(scaling) == "longrope"
        long = _longrope(d_head, theta, scaling, "long_factor") if scaling is not None and longrope else None
        self.register_buffer("long_inv_freq", long, persistent=False)  # None but for LongRoPE
        self.attention_factor = attention_factor(scaling)
        self.__dict__["_written"] = self._marks()  # (see `_check_written`)
        # Not in the state_dict: computed again after every load, so a module made on the meta device, then
        # `to_empty()` and loaded (how large models are built), has frequencies and not uninitialized memory.
        self.register_load_state_dict_post_hook(_frequencies_again)

    _scaling: dict[str, Any] | None  # (set by `scaling`'s setter)

    @property
    def scaling(self) -> dict[str, Any] | None:
        """The scaling it was built with, a copy: editing it in place edits nothing (the frequencies were built from
        it, and the module's config reads it)."""
        return copy.deepcopy(self._scaling)

    @scaling.setter
    def scaling(self, value: Mapping[str, Any] | None) -> None:
        self.__dict__["_scaling"] = dict(value) if value else None

    def __setattr__(self, name: str, value: Any) -> None:
        # The frequencies (and YaRN's factor, LongRoPE's tables, the length rule) and the tables' layout are built
        # from these: set on a built module to another value they would be half applied, so they are refused.
        if name in _SOURCES and "inv_freq" in self.__dict__.get("_buffers", {}) and value != getattr(self, name):
            given = {"d_head": self.d_head, "theta": self.theta, "scaling": self.scaling} | {name: value}
            given |= {"interleaved": True} if self.interleaved else {}
            shown = ", ".join(f"{key}={item!r}" for key, item in given.items())
            raise ConfigError(
                f"RotaryEmbedding: {name} cannot be set on a built module: its frequencies were built from it. "
                f"Build one that has it: RotaryEmbedding({shown})."
            )
        if name in _DERIVED_VALUES and "attention_factor" in self.__dict__ and value != getattr(self, name):
            raise self._derived(name)
        self._keep_frequencies(name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _DERIVED and "attention_factor" in self.__dict__:  # (`register_parametrization` deletes first)
            raise self._derived(name)
        super().__delattr__(name)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        self._keep_frequencies(name, tensor)  # (nn.Module's route around __setattr__)
        super().register_buffer(name, tensor, persistent)

    def _keep_frequencies(self, name: str, value: Any) -> None:
        """Refuse other frequencies set on a built module: they are derived from `d_head`, `theta` and `scaling`
        (computed again after a load, and from those in bfloat16), so edited ones would be half applied."""
        current = self.__dict__["_buffers"].get(name) if "attention_factor" in self.__dict__ else None
        if name not in _DERIVED or current is None or value is current:
            return
        same = isinstance(value, Tensor) and value.shape == current.shape
        if same and not (value.is_meta or current.is_meta):  # (compared in the new dtype: a cast is the same values)
            same = torch.equal(current.to(device=value.device, dtype=value.dtype), value)
        if not same:
            raise self._derived(name)

    def _derived(self, name: str) -> ConfigError:
        return ConfigError(
            f"RotaryEmbedding: {name} cannot be set on a built module: it is derived from d_head, theta and "
            "scaling, and computed from them again (after a load, in bfloat16). Build the frequencies you want "
            f"from those: another theta, or a scaling ({', '.join(SUPPORTED_SCALING)}), e.g. RotaryEmbedding("
            f"{self.d_head}, theta={self.theta!r}, scaling={{'rope_type': 'yarn', 'factor': 4.0, "
            "'original_max_position_embeddings': 4096})."
        )

    def reset_parameters(self) -> None:
        """Compute the frequencies again, in place (after `to_empty()` they are uninitialized memory; a buffer given
        another shape by `.data =` is replaced)."""
        with torch.no_grad():
            for name, built in self._built().items():
                buffer = self._buffers[name]
                if buffer is not None and buffer.shape == built.shape:
                    buffer.copy_(built)
                elif buffer is not None:
                    self._buffers[name] = built.to(device=buffer.device, dtype=buffer.dtype)
        self.__dict__["_written"] = self._marks()

    def _built(self) -> dict[str, Tensor]:
        """The frequency buffers as `d_head`, `theta` and `scaling` make them (float32, on the CPU)."""
        built = {"inv_freq": inverse_frequencies(self.d_head, self.theta, self._scaling)}
        if self._scaling is not None and self._buffers.get("long_inv_freq") is not None:
            built["long_inv_freq"] = _longrope(self.d_head, self.theta, self._scaling, "long_factor")
        return built

    def _marks(self) -> tuple[Any, ...] | None:
        """Where each frequency buffer lies and how often it was written, `(data_ptr, _version)` a buffer; None where
        that cannot be read (a fake tensor under export has no data pointer, an inference tensor no version)."""
        buffers = self._buffers
        inv_freq, long = buffers["inv_freq"], buffers["long_inv_freq"]
        try:
            return (
                None if inv_freq is None else (inv_freq.data_ptr(), inv_freq._version),
                None if long is None else (long.data_ptr(), long._version),
            )
        except RuntimeError:
            return None

    def _check_written(self) -> None:
        """Refuse frequencies written in place since they were last seen (`inv_freq.mul_(...)`, `.data = ...`,
        `copy_`): they are derived from `d_head`, `theta` and `scaling`, which the module's config still holds, so
        they would be half applied. Another tensor of the same values (a cast, a move, a load) is accepted and
        remembered; the comparison runs only when a buffer moved or was written, and not under `torch.compile` (nor
        for buffers made under `torch.inference_mode`: they count no versions)."""
        marks = self._marks()
        if marks is None or marks == self.__dict__["_written"]:
            return
        for name, built in self._built().items():
            buffer = self._buffers[name]
            if buffer is None or buffer.is_meta or buffer.shape != built.shape:  # (another shape: the tables' shape
                continue  # check names it, a ShapeError, as for a fresh module; meta: no values to compare)
            built = built.to(device=buffer.device)
            if torch.equal(built.to(buffer.dtype), buffer):
                continue
            if any(torch.equal(built.to(rounded).to(buffer.dtype), buffer) for rounded in _ROUNDING):
                with torch.no_grad():  # a round trip through bfloat16 or float16 (`.bfloat16().float()`): made again
                    buffer.copy_(built)
                continue
            raise ConfigError(
                f"RotaryEmbedding: {name} was written in place (its values are no longer those of d_head="
                f"{self.d_head}, theta={self.theta!r} and scaling={self._scaling!r}, which the module holding it "
                "describes in its config): its rotation would be half applied. Call reset_parameters() to compute "
                "them again, or build the frequencies you want from another theta or scaling."
            )
        self.__dict__["_written"] = self._marks()

    def extra_repr(self) -> str:
        return (
            f"d_head={self.d_head}, theta={self.theta}"
            + (f", scaling={self.scaling}" if self.scaling else "")
            + (", interleaved=True" if self.interleaved else "")
        )

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin, `(batch, seq, d_head)` in `dtype`, for integer `positions` `(batch, seq)`."""
        if not compiling():
            self._check_written()
        inv_freq: Tensor = self.inv_freq  # pyright: ignore[reportAssignmentType]
        long: Tensor | None = self.long_inv_freq  # pyright: ignore[reportAssignmentType]
        if inv_freq.dtype in _ROUNDING:  # `module.to(torch.bfloat16)` rounds buffers: angles off by radians at 4k
            inv_freq, long = inverse_frequencies(self.d_head, self.theta, self._scaling), None
        if self.by_length and self._scaling is not None and positions.numel():  # the call's length picks them
            length = positions.max() + 1
            inv_freq = long_frequencies(self.d_head, self.theta, self._scaling, length, short=inv_freq, long=long)
        angles = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
        if self.interleaved:  # each pair's angle twice in a row, for features (2i, 2i+1)
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN, LongRoPE: in float32, before the cast, as transformers multiplies
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


# What a RotaryEmbedding's frequencies and tables are built from (`interleaved`: the tables' layout, which the module
# that holds it pairs its features by: set alone, the two would disagree).
_SOURCES = ("d_head", "theta", "scaling", "interleaved")
_DERIVED = ("inv_freq", "long_inv_freq")  # the buffers built from them
_DERIVED_VALUES = ("by_length", "context", "attention_factor")  # and what else a call reads of them


def _frequencies_again(module: nn.Module, incompatible_keys: Any) -> None:
    if isinstance(module, RotaryEmbedding):
        module.reset_parameters()


def _validate_rotary(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    if dims["d_head"] % 2:
        raise mismatch(
            f"q has d_head={dims['d_head']} (axis 3), which is odd; rotary embeddings rotate pairs of features."
        )
    for name in ("cos", "sin"):
        table = arguments[name]
        if table.dtype != arguments["q"].dtype:
            raise mismatch(f"{name} has dtype {table.dtype}, but q has {arguments['q'].dtype}.", arg=name)


@stage(validate=_validate_rotary, trace=("rotary_q", "rotary_k"))
def apply_rotary(
    q: Heads, k: SameSeqKVHeads, cos: RotaryTable, sin: RotaryTable, interleaved: bool = False
) -> tuple[Heads, SameSeqKVHeads]:
    """Rotate queries and keys by their positions: `x * cos + rotate_half(x) * sin` (transformers' layout).

    `rotate_half` pairs feature `i` with feature `i + d_head/2`, as Llama, Mistral and Qwen do;
    `interleaved=True` pairs `2i` with `2i+1` (`(x0, x1) -> (-x1, x0)`, Cohere, GLM, ERNIE), with tables
    from `RotaryEmbedding(..., interleaved=True)`. Keys must be at the queries' positions (self-attention,
    before caching).

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> cos, sin = ssm.RotaryEmbedding(8)(torch.arange(5)[None], dtype=torch.float32)
        >>> q, k = ssm.apply_rotary(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), cos, sin)
        >>> q.shape, k.shape
        (torch.Size([1, 4, 5, 8]), torch.Size([1, 2, 5, 8]))

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        k: `(batch, num_kv_heads, seq, d_head)`.
        cos, sin: `(seq, d_head)` or `(#batch, seq, d_head)`, from `RotaryEmbedding`.
        interleaved: adjacent pairs instead of halves.

    Returns:
        The rotated `(q, k)`, same shapes.

    Raises:
        ShapeError: the shapes disagree, or `d_head` is odd.
    """
    return K.rotate(q, cos, sin, interleaved), K.rotate(k, cos, sin, interleaved)


def _validate_partial_rotary(arguments: dict[str, Any], dims: dict[str, int]) -> None:
    width, d_head = dims["d_rope"], dims["d_head"]
    if width % 2 or width > d_head:
        raise mismatch(
            f"cos has d_rope={width} features (axis -1), but the rotary part of a head must be an even number of "
            f"features at most d_head={d_head}; rotary embeddings rotate pairs of features.",
            arg="cos",
            dim="d_rope",
        )
    for name in ("cos", "sin"):
        table = arguments[name]
        if table.dtype != arguments["q"].dtype:
            raise mismatch(f"{name} has dtype {table.dtype}, but q has {arguments['q'].dtype}.", arg=name)


@stage(validate=_validate_partial_rotary, trace=("rotary_q", "rotary_k"))
def apply_partial_rotary(
    q: Heads, k: SameSeqKVHeads, cos: PartialRotaryTable, sin: PartialRotaryTable, interleaved: bool = False
) -> tuple[Heads, SameSeqKVHeads]:
    """Rotate the first `d_rope` features of each query and key head (partial rotary); the rest pass unrotated.

    `concat(rotate(x[..., :d_rope]), x[..., d_rope:])`, as Phi, StableLM, Nemotron and GLM compute it: the
    frequencies are spaced over the rotated part (`RotaryEmbedding(d_rope, ...)`), pairs within it are halves
    or, `interleaved`, adjacent features.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> cos, sin = ssm.RotaryEmbedding(4)(torch.arange(5)[None], dtype=torch.float32)
        >>> q, k = ssm.apply_partial_rotary(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), cos, sin)
        >>> q.shape, k.shape
        (torch.Size([1, 4, 5, 8]), torch.Size([1, 2, 5, 8]))

    Arguments:
        q: `(batch, num_heads, seq, d_head)`.
        k: `(batch, num_kv_heads, seq, d_head)`.
        cos, sin: `(seq, d_rope)` or `(#batch, seq, d_rope)`, from `RotaryEmbedding(d_rope, ...)`.
        interleaved: adjacent pairs instead of halves, within the rotated part.

    Returns:
        The rotated `(q, k)`, same shapes.

    Raises:
        ShapeError: the shapes disagree, or `d_rope` is odd or more than `d_head`.
    """
    return K.rotate_part(q, cos, sin, interleaved), K.rotate_part(k, cos, sin, interleaved)


@stage(name="rotary", trace=("", ""), public=("positions",))
def rotary_tables(rotary: nn.Module, positions: Positions, q: Heads) -> tuple[RotaryTable, RotaryTable]:
    """cos and sin for the positions of this call's queries, in q's dtype."""
    return rotary(positions, q.dtype)


@stage(name="rotary", trace=("rotary_cos", "rotary_sin"), public=("positions",))
def partial_rotary_tables(
    rotary: nn.Module, positions: Positions, q: Heads
) -> tuple[PartialRotaryTable, PartialRotaryTable]:
    """cos and sin of the rotated part (`d_rope` wide) for the positions of this call's queries, in q's dtype."""
    return rotary(positions, q.dtype)


def default_positions(query: Tensor, cached: int) -> Tensor:
    """Positions `cached, ..., cached + seq - 1` for every sequence: prefill and decoding agree."""
    batch, seq = query.shape[0], query.shape[1]
    return torch.arange(cached, cached + seq, device=query.device).expand(batch, seq)


