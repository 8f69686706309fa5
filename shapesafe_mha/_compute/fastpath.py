"""Fast paths: one matrix multiply for Q, K and V, and torch's fused MHA kernel, when provably the same.

A fast path runs only where it computes exactly what calling the projection submodules would:
plain `nn.Linear`s (not a subclass, a LoRA wrapper, a quantized or parametrized layer), with no
hooks and no `forward` of their own (accelerate's hooks replace the instance's), in one dtype and on
one device, without autograd and outside any tracer or compiler. Otherwise the module calls its
submodules, silently. A plain projection is computed as its `forward` would, `F.linear(x, weight,
bias)`, without nn.Module's call (`project`), on every path.

The fused Q/K/V weight is never a copy: `pack_qkv` lays the three projections' weights (and biases) out
one after another in one storage, and the fused weight is a view over all three, so every write to them, by
any route (an optimizer step, `load_state_dict`, `p.data.add_`, a write through another view), is a write to
it. It is used only while the parameters still lie so (`fused_qkv` compares their data pointers, shapes and
strides with the layout on every call); a weight replaced, re-pointed with `.data =` or assigned from
elsewhere (`load_state_dict(assign=True)`, `vector_to_parameters`) makes the module call its projections
separately, until it is packed again where that is safe (`.to()` and deep copies make fresh tensors).

torch has no public API for some of what this needs (a module's hooks, a tensor's version counter,
the fused kernel itself, whether a tensor is a `vmap` slice, whether `nn.Module.__call__` would do more
than call `forward`); those uses are here and nowhere else, each tested (tests/test_fused.py,
tests/test_verdicts.py, tests/test_ecosystem.py, tests/test_compile.py).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks

from .._core.errors import ShapeError
from .._core.trace import current_observer

# Up to this many positions torch's fused MHA kernel is as fast as our fused-QKV + SDPA path or
# faster; beyond it SDPA's flash kernel wins (measured on CPU: 0.82x of the kernel's time at 256).
NATIVE_MAX_SEQ = 128


def global_hooks() -> bool:
    """Whether any module-wide hook (`register_module_forward_hook` and friends) is registered."""
    hooks = _module_hooks.__dict__  # each table by its name, unrolled: this runs on every inference call
    return bool(
        hooks["_global_forward_hooks"]
        or hooks["_global_forward_pre_hooks"]
        or hooks["_global_forward_hooks_with_kwargs"]
        or hooks["_global_backward_hooks"]
        or hooks["_global_backward_pre_hooks"]
    )


def module_state(modules: Iterable[nn.Module | None], fused: "FusedQKV | None" = None) -> tuple[Any, ...]:
    """What a verdict reads of `modules` (a module's submodules) besides which they are: their forward hooks
    and torch's module-wide ones, as how many and the newest one's handle id, and their weights' shapes; of a
    leaf without a weight parameter, its tensors' shapes (rotary tables, a quantized layer's buffers); of a module
    with modules of its own (a LoRA layer, `nn.Sequential`), what it `held`, all the way down.

    Handle ids only grow, so adding a hook raises the newest and removing one lowers the count. A weight
    of another shape can change a result without an error (`o_proj`'s rows are the output's width), and so can
    a bias of one feature (broadcast); a dtype or device that disagrees makes torch fail instead, and `recheck`
    explains that failure.

    With `fused`, current for this call (`fused_qkv` found the projections plain, with no hook of their own
    nor any module-wide one, and their weights the very tensors it was fused from, unwritten, of the rows the
    module's sizes fix), those three are not read: no hook, and weights whose only free size, their columns,
    must be the query's width (in the key) or torch refuses the product and `recheck` explains. (A projection
    replaced by a module with the same weights is not the one recorded, and is read.)
    """
    count = newest = 0
    hooks = _module_hooks.__dict__
    tables: list[Any] = []
    if fused is None:
        tables += (hooks.get("_global_forward_hooks"), hooks.get("_global_forward_pre_hooks"))
    shapes: list[Any] = []
    q = k = v = None
    if fused is not None:
        q, k, v = fused.modules
    for module in modules:  # a plain loop: this runs on every call whose verdict is known
        if module is None or module is q or module is k or module is v:
            continue
        own = module.__dict__  # subscripts, cheaper than nn.Module's attribute lookups
        forward_hooks, pre_hooks = own["_forward_hooks"], own["_forward_pre_hooks"]
        if forward_hooks or pre_hooks:
            tables += (forward_hooks, pre_hooks)
        parameters, buffers = own["_parameters"], own["_buffers"]
        weight = parameters.get("weight")
        if own["_modules"]:  # a wrapper (a LoRA layer, nn.Sequential, a layer with one of its own): all it holds
            shapes.append(held(module))
        elif weight is not None:
            bias = parameters.get("bias")  # a bias of one feature broadcasts without an error: in the key too
            shapes += (weight.shape, None if bias is None else bias.shape)
        elif parameters or buffers:  # a leaf without a weight parameter: rotary tables, a quantized layer's buffers
            shapes.append(tuple(None if t is None else t.shape for t in (*parameters.values(), *buffers.values())))
        else:
            shapes.append(None)
    for table in tables:
        if table:
            count += len(table)
            newest = max(newest, *table)
    return (count, newest, *shapes)


def held(module: nn.Module) -> tuple[Any, ...]:
    """What a module holds, all the way down, flat: each module in it (one replaced is another key), then its
    hooks' handle ids (after `_Hooks`) and its parameters' and buffers' shapes (written through `.data`, a tensor
    keeps its identity). A walk of `_modules` by hand: this runs on every call of a module with a wrapped
    projection (a LoRA layer, 11 modules: 2.9 us, 13 us by `modules()` and a tuple each)."""
    found: list[Any] = []
    stack: list[Any] = [module]
    while stack:
        inner = stack.pop()
        found.append(inner)
        if inner is None:  # (an empty slot of `_modules`)
            continue
        own = inner.__dict__
        hooks, pre_hooks = own["_forward_hooks"], own["_forward_pre_hooks"]
        if hooks or pre_hooks:
            found.append((_Hooks, *hooks, *pre_hooks))
        for tensor in own["_parameters"].values():  # (plain loops: comprehensions cost a frame each here)
            found.append(None if tensor is None else tensor.shape)
        for tensor in own["_buffers"].values():
            found.append(None if tensor is None else tensor.shape)
        children = own["_modules"]
        if children:
            stack += children.values()
    return tuple(found)


class _Hooks:
    """Marks a module's hook ids in what it `held` (a tuple of ints would equal a `torch.Size`)."""


def forward_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (the module's own or a module-wide one) runs after `module.forward` returns."""
    hooks = _module_hooks.__dict__
    return bool(module._forward_hooks or hooks.get("_global_forward_hooks"))


def call_restoring(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cache_kind: type | tuple[type, ...]
) -> Any:
    """`module(*args, **kwargs)`, its `kv_cache` restored if a forward hook raises after `forward` returned
    (a failed call changes nothing); without such a hook, the plain call. `cache_kind`: the caches the module
    writes (a `KVCache` or `LatentCache`, and a `PagedKVCache`), as `isinstance` takes them.

    With no hook of any kind (the module's own or module-wide), not compiled by `module.compile()` and not
    under `torch.jit.trace`, `nn.Module.__call__` calls `module.forward(*args, **kwargs)` and nothing else
    (its `_call_impl`'s first branch), so that is called, without its two frames (about 1.5 us)."""
    hooks = _module_hooks.__dict__
    if not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks.get("_global_forward_hooks")
        or hooks.get("_global_forward_pre_hooks")
        or hooks.get("_global_backward_hooks")
        or hooks.get("_global_backward_pre_hooks")
        or module._compiled_call_impl is not None
        or torch._C._get_tracing_state()  # pyright: ignore[reportAttributeAccessIssue]  (what nn.Module reads)
    ):
        return module.forward(*args, **kwargs)
    cache: Any = kwargs.get("kv_cache")
    if not isinstance(cache, cache_kind) or not forward_hooked(module):
        return nn.Module.__call__(module, *args, **kwargs)
    state = cache.state()
    try:
        return nn.Module.__call__(module, *args, **kwargs)
    except BaseException:
        cache.restore(state)
        raise


# Whether a tensor is one slice of a `torch.vmap`: torch documents no public test for it, so its private one is
# named here only (`vmapped`; `KVCache.write` calls it directly, once a decoding step).
batched_tensor = torch._C._functorch.is_batchedtensor  # pyright: ignore[reportAttributeAccessIssue]


def vmapped(tensor: Tensor) -> bool:
    """Whether `tensor` is one slice of a `torch.vmap`."""
    return bool(batched_tensor(tensor))


def refuse_under_vmap(tensor: Tensor, owner: str | None) -> None:
    """A cache is one buffer for the whole batch: `torch.vmap` would write each slice into it."""
    if vmapped(tensor):
        raise ShapeError(
            f"{owner or 'KVCache.append()'}: kv_cache cannot be written under torch.vmap: it is one buffer for "
            "the whole batch, and each mapped slice would write into it; call the module on the batch instead "
            "(kv_cache's batch is its first axis)."
        )


def plain_linear(*modules: Any) -> bool:
    """Whether each module is an `nn.Linear` as torch ships it: no subclass, parametrization, adapter, hook or
    forward of its own. (Several in one call: the fused path asks it of three on every inference call.)"""
    for module in modules:
        own = module.__dict__  # its attributes read from it: a subscript each, cheaper than attribute lookups
        if not (
            type(module) is _Linear  # parametrize swaps the class; LoRA and quantization replace the module
            and not own["_forward_hooks"]
            and not own["_forward_pre_hooks"]
            and not own["_backward_hooks"]
            and not own["_backward_pre_hooks"]
            and "forward" not in own  # accelerate's offloading hooks replace the instance's forward
        ):
            return False
    return True


_Linear = nn.Linear


def project(proj: nn.Module, x: Tensor) -> Tensor:
    """`proj(x)`. A plain `nn.Linear` with no hook anywhere (`plain_linear`, `global_hooks`) computes
    `F.linear(x, weight, bias)` and nothing else, so that is called, without nn.Module's call (about 1.5 us)."""
    if plain_linear(proj) and not global_hooks():
        parameters = proj._parameters
        weight = parameters["weight"]
        if weight is not None:
            return F.linear(x, weight, parameters["bias"])
    return proj(x)


@dataclass
class FusedQKV:
    """The q/k/v weights (and biases) as one view over the storage they are laid out in, and that layout."""

    sources: tuple[Tensor | None, ...]
    layout: tuple[Any, ...]
    weight: Tensor
    bias: Tensor | None
    modules: tuple[nn.Module, nn.Module, nn.Module]  # the projections, for `module_state`


def _layout(sources: tuple[Tensor | None, ...]) -> tuple[Any, ...]:
    # Where each tensor's values lie: the same data pointers, shapes and strides read the same memory, which the
    # fused view keeps alive (so no other tensor can come to lie at those addresses). A plain loop: this runs on
    # every inference call.
    layout: list[Any] = []
    for p in sources:
        if p is not None:
            layout += (p.data_ptr(), p.shape, p.stride())
    return tuple(layout)


def _adjacent(tensors: list[Tensor]) -> Tensor | None:
    """One view over `tensors` (same dtype, device and trailing shape, each contiguous), where each begins where
    the one before it ends in one storage: their concatenation, without a copy. None where they do not lie so."""
    first = tensors[0]
    if first.device.type == "meta":  # no values to go stale: the concatenation allocates nothing
        kinds = {(t.dtype, t.device, t.shape[1:]) for t in tensors}
        return torch.cat([t.detach() for t in tensors]) if len(kinds) == 1 else None
    if not all(t.is_contiguous() for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]:
            return None
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def pack_qkv(q: Any, k: Any, v: Any, fresh: Any = None) -> None:
    """Lay the weights (and biases) of three plain linears out one after another in one new storage, each
    parameter re-pointed (`.data =`) at its rows, so that `fused_qkv` can view them as one without a copy.

    Only tensors `fresh(tensor)` says no one else holds are moved (a tensor the user pointed a parameter at, with
    `.data =` or `vector_to_parameters`, stays theirs); default: each, where it is its storage whole."""
    if not all(isinstance(m, nn.Module) for m in (q, k, v)) or not plain_linear(q, k, v):
        return
    fresh = fresh or _whole
    for name in ("weight", "bias"):
        tensors = [m._parameters[name] for m in (q, k, v)]
        if any(t is None for t in tensors):
            continue
        if _adjacent(tensors) is not None or not all(fresh(t) for t in tensors):
            continue
        if len({(t.dtype, t.device, t.shape[1:]) for t in tensors}) != 1:
            continue
        with torch.no_grad():
            packed = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            t.data = packed[start : start + t.shape[0]]
            start += t.shape[0]


def _kind(tensor: Tensor) -> tuple[torch.dtype, torch.device]:
    return tensor.dtype, tensor.device


def _whole(tensor: Tensor) -> bool:
    """Whether `tensor` is the whole of its storage (not a slice of a flat vector someone else holds)."""
    storage = tensor.untyped_storage()
    return tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()


def fused_qkv(q: Any, k: Any, v: Any, cached: FusedQKV | None, rows: tuple[int, int, int]) -> FusedQKV | None:
    """The projection of three plain linears as one, a view over their weights, reusing `cached` while they lie
    where it was made; None where they do not lie one after another in one storage (see `pack_qkv`).

    Only weights of exactly `rows` rows and one width are fused (the module's sizes): the fused path splits the
    product by heads, so weights of other widths that add up to the same (rows moved from one to another) would
    be split silently wrong there, where the separate path's checks refuse them."""
    if not plain_linear(q, k, v) or global_hooks():
        return None
    qp, kp, vp = q._parameters, k._parameters, v._parameters
    sources = (qp["weight"], kp["weight"], vp["weight"], qp["bias"], kp["bias"], vp["bias"])
    if cached is not None:  # the very tensors it was made from (by identity, unrolled), where they lay
        a, b, c, d, e, f = cached.sources
        s0, s1, s2, s3, s4, s5 = sources
        if a is s0 and b is s1 and c is s2 and d is s3 and e is s4 and f is s5 and cached.layout == _layout(sources):
            return cached
    weights, biases = sources[:3], sources[3:]
    if any(w is None or w.dim() != 2 for w in weights):
        return None
    if tuple(w.shape[0] for w in weights if w is not None) != rows:
        return None  # (the separate path's checks explain these)
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    if biases[0] is not None and any(b is None or b.shape != (n,) for b, n in zip(biases, rows, strict=True)):
        return None  # a bias that does not fit its weight: the separate path's checks explain it
    weight = _adjacent([w for w in weights if w is not None])
    bias = None if biases[0] is None else _adjacent([b for b in biases if b is not None])
    if weight is None or (biases[0] is not None and (bias is None or _kind(bias) != _kind(weight))):
        return None
    return FusedQKV(sources, _layout(sources), weight, bias, (q, k, v))


def native_fits(module: Any, query: Tensor, fused: FusedQKV, tracing: bool) -> bool:
    """Whether torch's fused MHA kernel computes this call exactly: MHA, num_heads * d_head == d_model,
    biases, no dropout, a plain output projection, a short sequence, a dtype and device it supports."""
    o_proj = module._modules["o_proj"]
    return (
        module.native_shape
        and fused.bias is not None
        and query.shape[1] <= NATIVE_MAX_SEQ
        and (module.dropout == 0.0 or not module.training)
        and plain_linear(o_proj)
        and o_proj._parameters["bias"] is not None
        and query.dtype in _NATIVE_DTYPES
        and query.device.type in _NATIVE_DEVICES
        and not tracing
    )


SEPARATE, FUSED, NATIVE = "separate", "fused", "native"
_compiling = torch.compiler.is_compiling  # the execution paths of MultiHeadAttention.forward


def choose_path(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    key_padding_mask: Any,
    is_causal: Any,
    need_weights: Any,
    kv_cache: Any,
    positions: Any,
    jit_tracing: bool | None = None,
    compiling: bool | None = None,
) -> tuple[str, FusedQKV | None]:
    """Which computation a `MultiHeadAttention` call runs: separate projections (always correct), or a fast
    path where provably the same; the fused Q/K/V weight it builds is kept on the module for the next call.
    `jit_tracing`, `compiling`: `torch.jit.is_tracing()` and `torch.compiler.is_compiling()`, where the caller has
    asked already."""
    if key is not query or value is not query or torch.is_grad_enabled() or module.__dict__["_plan"].gated:
        return SEPARATE, None  # (a gated q_proj holds each head's gate beside its queries: no fused split)
    if jit_tracing is None:
        jit_tracing = torch.jit.is_tracing()  # pyright: ignore[reportPrivateImportUsage]
    if (_compiling() if compiling is None else compiling) or jit_tracing or not isinstance(query, Tensor):
        return SEPARATE, None
    modules = module._modules
    fused = fused_qkv(modules["q_proj"], modules["k_proj"], modules["v_proj"], module._fused, module._qkv_rows)
    module.__dict__["_fused"] = fused  # not nn.Module.__setattr__: this runs on every inference call
    if fused is None:
        return SEPARATE, None
    plain = attn_mask is None and key_padding_mask is None and kv_cache is None
    if plain and is_causal is False and need_weights is False:
        if native_fits(module, query, fused, tracing=current_observer() is not None):
            return NATIVE, fused
    return FUSED, fused


_NATIVE_DTYPES = (torch.float32, torch.float64)
_NATIVE_DEVICES = ("cpu", "cuda")


def native_kernel(
    query: Tensor, in_weight: Tensor, in_bias: Tensor, out_weight: Tensor, out_bias: Tensor, num_heads: int
) -> Tensor:
    """Exactly what nn.MultiheadAttention's inference fast path runs."""
    kernel = torch._native_multi_head_attention  # pyright: ignore[reportPrivateImportUsage]
    d_model = query.shape[-1]
    return kernel(query, query, query, d_model, num_heads, in_weight, in_bias, out_weight, out_bias, None, False)[0]


def tensor_kind(module: nn.Module, projection: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the tensors a module computes with, read from `projection`'s weight; where that is no
    floating tensor (a dynamically quantized layer's `weight` is a method, an int8 one's integers: they take and give
    floats), from the module's first floating parameter or buffer, else the default dtype on the CPU (where torch's
    quantized layers run)."""
    weight = getattr(projection, "weight", None)
    if isinstance(weight, Tensor) and weight.is_floating_point():  # (an int8 weight, bitsandbytes': not the kind)
        return weight.dtype, weight.device
    floating = (t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point())
    found = next(floating, None)
    return (torch.get_default_dtype(), torch.device("cpu")) if found is None else (found.dtype, found.device)
