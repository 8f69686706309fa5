"""The contract of `MultiHeadAttention.forward`: what is checked before the stages (dtype, device, cache, RoPE),
what explains a failure, the key a verdict is remembered under, and the forward run checked."""

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import kernels as K
from .._compute.cache import KVCache
from .._compute.fastpath import FusedQKV, module_state
from .._compute.stages import autocast_dtype, autocast_on, check_cache, explain_mask
from .._core.contract import CallKey, Session, Stage, witness
from .._core.dims import KVTokens, ModuleSizes, RotarySizes
from .._core.errors import ConfigError
from .._core.messages import ExplainedError, dtype_name, mismatch, not_dense
from .plan import STAGES


@contextlib.contextmanager
def quiet_jit_tracer() -> Iterator[None]:
    """Checks read sizes in Python; under `torch.jit.trace` that is not part of the graph, so say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # pyright: ignore[reportPrivateImportUsage]
        yield


def _module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of the module's first floating-point parameter (None if it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype, param.device
    return None


def _precheck_forward(arguments: dict[str, Any]) -> None:
    """Inputs in the module's dtype and on its device; a cache of the right kind."""
    module = arguments["self"]
    for name in ("query", "key", "value", "attn_mask", "key_padding_mask", "positions"):
        failure = not_dense(name, arguments[name])
        if failure is not None:  # first: a nested tensor's sizes are symbolic, a sparse one has no views
            raise failure
    if arguments["positions"] is not None and module.rotary is None:
        raise ConfigError(
            "positions were given, but this module has no rotary embeddings (rope_theta=None): "
            "nothing would use them. Build it with rope_theta=..., or drop positions."
        )
    key, query = arguments["key"], arguments["query"]
    if module.rotary is not None and isinstance(key, Tensor) and isinstance(query, Tensor) and key is not query:
        if key.dim() == query.dim() == 3 and key.shape[1] != query.shape[1]:
            raise mismatch(
                f"key has kv_seq={key.shape[1]} positions for the query's seq={query.shape[1]}, but this module "
                f"rotates queries and keys by the same positions (rope_theta={module.rotary.theta}): cross-attention "
                "with rotary embeddings is not supported. Build the module with rope_theta=None for cross-attention.",
                arg="key",
                dim="kv_seq",
            )
    found = _module_dtype_device(module)
    cache = arguments["kv_cache"]
    check_cache(cache, KVCache)
    if cache is not None and not _window_fits(cache.window, module.window):
        raise mismatch(
            f"kv_cache keeps a window of {cache.window} positions, but the module attends over "
            + ("every position" if module.window is None else f"a window of {module.window}")
            + "; it would have dropped keys the module needs. Make it with module.new_cache(batch, capacity).",
            arg="kv_cache",
            dim="window",
        )
    if found is None:
        return
    dtype, device = found
    for name in ("query", "key", "value"):
        tensor = arguments[name]
        if not isinstance(tensor, Tensor):
            continue
        if tensor.dtype != dtype:
            raise mismatch(
                f"{name} has dtype {dtype_name(tensor.dtype)}, but the module's parameters are {dtype_name(dtype)}; "
                + (
                    f"cast the input ({name}.to({dtype})) or the module (module.to({tensor.dtype}))."
                    if tensor.is_floating_point()
                    else f"inputs must be floating point: {name}.to({dtype})."
                ),
                arg=name,
            )
        if tensor.device != device:
            raise mismatch(
                f"{name} is on {tensor.device}, but the module's parameters are on {device}; "
                f"move one of them ({name}.to('{device}') or module.to('{tensor.device}')).",
                arg=name,
            )


def _kind(tensor: Tensor) -> tuple[Any, ...]:
    return type(tensor), tensor.dtype, tensor.device


def _window_fits(kept: int | None, needed: int | None) -> bool:
    """Whether a cache keeping a window of `kept` positions (None: all) holds every key a window of `needed` sees."""
    return kept is None or (needed is not None and kept >= needed)


def _explain_forward(arguments: dict[str, Any], failure: ExplainedError) -> str | None:
    if failure.arg == "value" and failure.dim in ("kv_seq", "new"):
        return "key and value must cover the same positions."
    if failure.arg in ("key", "value") and failure.dim == "batch":
        return f"{failure.arg} needs one sequence per query sequence."
    return explain_mask(arguments, failure)


def forward_key(
    module: Any,
    path: str,
    fused: FusedQKV | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: Any,
    need_weights: Any,
    kv_cache: KVCache | None,
    positions: Tensor | None,
) -> CallKey:
    """What the verdict of a `MultiHeadAttention` call depends on: its structure (kinds, ranks, dtypes, devices,
    flags, path, submodules) and its sizes; these exactly, for a lookup that costs one hash. `fused`: the fused
    projection this call runs, current (its projections are then read from it, see `module_state`)."""
    shape = query.shape
    key_shape = shape if key is query else key.shape
    kv_len = key_shape[1]
    cache_kind = buffer_shape = kept = None
    if kv_cache is not None:
        kv_len += kv_cache._start + kv_cache._length  # len(kv_cache), without a Python call of __len__
        buffer = kv_cache.keys_buffer
        cache_kind, buffer_shape = (type(kv_cache), buffer.dtype, buffer.device, kv_cache._window), buffer.shape
        if kv_cache._window is not None:
            kept = (kv_cache.kept, kv_cache.kept + key_shape[1])
    masked = attn_mask is not None or key_padding_mask is not None
    device = query.device
    modules = module._modules.values()
    own = module.__dict__  # its own tensors, read each call (`.data` swapped, a tensor keeps its identity)
    parameters = own["_parameters"]
    sinks, slopes = parameters.get("sinks"), own["_buffers"].get("alibi_slopes")
    structure = (
        path,
        type(query),
        query.dtype,
        device,
        None if key is query else (type(key), key.dtype, key.device),
        None if value is key else (type(value), value.dtype, value.device),
        None if attn_mask is None else (type(attn_mask), attn_mask.dtype, attn_mask.device),
        None if key_padding_mask is None else _kind(key_padding_mask),
        None if positions is None else (type(positions), positions.dtype, positions.device),
        cache_kind,
        type(is_causal),
        is_causal,
        type(need_weights),
        need_weights,
        shape[1] > kv_len,  # some rows have nothing to attend to
        shape[1] == 1 and K.native_decodes(shape[0], module.num_heads, kv_len, module.d_head),
        module.training,
        autocast_on() and autocast_dtype(device),
        *modules,  # a projection replaced is another module (compared by identity)
        module_state(modules, fused),  # hooks added, parameters replaced or re-typed
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
        None if slopes is None else (slopes.shape, slopes.dtype, slopes.device),
        None if _FIRST_LAMBDA not in parameters else _lambdas(parameters),  # (one lookup, usually)
    )
    shapes = (
        shape,
        None if key is query else key_shape,
        None if value is key else value.shape,
        None if attn_mask is None else attn_mask.shape,
        None if key_padding_mask is None else key_padding_mask.shape,
        buffer_shape,
        kept,
        None if positions is None else positions.shape,
    )
    # kv_seq counts the cached positions too; it is checked only against masks.
    return tuple.__new__(CallKey, (structure, shapes, kv_len if masked else None))  # without NamedTuple's frame


_FIRST_LAMBDA = K.LAMBDAS[0]


def _lambdas(parameters: dict[str, Any]) -> tuple[Any, ...]:
    """Differential attention's lambdas, as a verdict reads them (written through `.data`, a tensor keeps its
    identity)."""
    return tuple((t.shape, t.dtype, t.device) for n in K.LAMBDAS if (t := parameters.get(n)) is not None)


def checked_forward(
    module: Any,
    stage: Stage[..., Any],
    hints: dict[str, Any],
    cached_hints: dict[str, Any],
    check: bool,
    observer: Any,
    path: str,
    fused: FusedQKV | None,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    key_padding_mask: Any,
    is_causal: Any,
    need_weights: Any,
    kv_cache: Any,
    positions: Any,
) -> Any:
    """`MultiHeadAttention.forward` with every stage checked against one memo, and reported to the trace."""
    with Session("MultiHeadAttention.forward()", check=check, observer=observer) as session:
        sizes = (module.d_model, module.num_heads, module.num_kv_heads, module.d_head, module.group)
        session.seed(ModuleSizes, witness(sizes), "the module")
        if module.rope_dim is not None and module.rope_dim != module.d_head:
            session.seed(RotarySizes, witness((module.rope_dim,)), "the module")
        session.check_arguments(
            stage,
            (module, query, key, value),
            dict(
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                need_weights=need_weights,
                kv_cache=kv_cache,
                positions=positions,
            ),
            hints=hints if kv_cache is None else cached_hints,
        )
        if observer is not None:
            observer("query", "batch seq d_model", query)
        stages = session.stages(**STAGES)
        call = (query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, kv_cache, positions)
        result = module._run(stages, path, fused, *call)
        session.report(stage, result)
    return result


def forward_stage(forward: Any) -> tuple[Stage[..., Any], dict[str, Any], dict[str, Any]]:
    """The forward as a stage (its annotations, prechecks and explanations), and the hints checked at its call,
    without a cache and with one."""
    stage = Stage(
        forward,
        name="MultiHeadAttention.forward",
        public=("query", "key", "value", "attn_mask", "key_padding_mask", "kv_cache"),
        trace=("",),
        sources={},
        precheck=_precheck_forward,
        validate=None,
        explain=_explain_forward,
    )
    # Masks are checked where kv_seq is known (the mask stage, after the cache); with a cache, key and
    # value hold the new positions only.
    hints = {k: v for k, v in stage.hints.items() if k not in ("attn_mask", "key_padding_mask")}
    return stage, hints, hints | {"key": KVTokens, "value": KVTokens}
