"""Verdicts are keyed on all they read: a warm module answers every call as a fresh one does.

A remembered verdict skips the checks, so it must change whenever anything the checks read changes:
hooks added (on the module, a submodule, or module-wide), parameters replaced or re-typed, a mask moved
to another device, a latent cache split otherwise. Also: checked equals unchecked under autocast, and a
failed call changes nothing, a hook on the module itself raising included.
"""

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from jaxtyping import Float
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

import shapesafe_mha as ssm

Outcome = tuple[str, Any]


def _outcome(run: Callable[[], Any]) -> Outcome:
    """What a call did: its output, or the kind of error and its first line."""
    try:
        out = run()
    except Exception as error:
        return type(error).__name__, str(error).splitlines()[0] if str(error) else ""
    return "ok", out


def _same(warm: Outcome, fresh: Outcome) -> None:
    assert warm[0] == fresh[0], f"the warm module: {warm}; a fresh one: {fresh}"
    if warm[0] == "ok":
        torch.testing.assert_close(warm[1], fresh[1], atol=0, rtol=0)
    else:
        assert warm[1] == fresh[1]


def _fresh(module: nn.Module) -> Any:
    """The same module, hooks and parameters included, with nothing remembered (deepcopy drops verdicts)."""
    return copy.deepcopy(module)


def _cut_keys(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output[:, :-1]


def test_a_hook_added_after_a_verdict_is_checked_as_on_a_fresh_module() -> None:
    """A forward hook truncating k_proj and v_proj by one position: the warm module returned (2, 5, 16) silently."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module(x, is_causal=True)
    module.k_proj.register_forward_hook(_cut_keys)
    module.v_proj.register_forward_hook(_cut_keys)
    with pytest.raises(ssm.ShapeError, match=r"k_proj returned a wrong value: the result has new=5 \(axis 1\)"):
        module(x, is_causal=True)


def test_a_module_wide_hook_added_after_a_verdict_is_checked() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module(x, is_causal=True)
    module.k_proj.cut = True  # the module-wide hook cuts this module only
    handle = register_module_forward_hook(lambda m, i, o: o[:, :-1] if getattr(m, "cut", False) else o)
    try:
        with pytest.raises(ssm.ShapeError, match="k_proj returned a wrong value"):
            module(x, is_causal=True)
    finally:
        handle.remove()
    module(x, is_causal=True)  # removed: right again


def test_a_module_wide_hook_that_torch_would_not_catch_is_checked_after_a_verdict() -> None:
    """A hook that drops an output feature of o_proj makes no torch op fail: only the verdict's key (which counts
    module-wide hooks) sends the call back to the checks. Pinned from generated mutants that ignored them."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module(x, is_causal=True)
    module.o_proj.cut = True
    handle = register_module_forward_hook(lambda m, i, o: o[..., :-1] if getattr(m, "cut", False) else o)
    try:
        with pytest.raises(ssm.ShapeError, match="o_proj returned a wrong value"):
            module(x, is_causal=True)
    finally:
        handle.remove()
    assert module(x, is_causal=True).shape == (2, 6, 16)


def test_a_padding_mask_on_another_device_after_a_verdict_is_a_shape_error() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module(x, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ssm.ShapeError, match=r"key_padding_mask is on meta, but the module's parameters are on cpu"):
        module(x, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool, device="meta"))


def test_parameters_replaced_after_a_verdict_are_checked() -> None:
    """Another dtype (load_state_dict with assign=True) or another shape: the fresh module's ShapeError."""
    x = torch.randn(2, 6, 16)
    module = ssm.MultiHeadAttention(16, 4, 2)
    module(x)
    module.load_state_dict({k: v.double() for k, v in module.state_dict().items()}, assign=True)
    with pytest.raises(ssm.ShapeError, match=r"query has dtype float32, but the module's parameters are float64"):
        module(x)
    module = ssm.MultiHeadAttention(16, 4, 2, bias=False)
    module(x)
    module.k_proj.weight = nn.Parameter(torch.randn(4, 16))
    with pytest.raises(ssm.ShapeError, match=r"k_proj returned a wrong value: the result has num_kv_heads\*d_head=4"):
        module(x)


def test_a_latent_cache_split_otherwise_after_a_verdict_is_a_shape_error() -> None:
    """Same width (12), kv_lora_rank 10 + d_rope 2 instead of 8 + 4: named, after a verdict too."""
    module = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4)
    x = torch.randn(1, 3, 32)
    module(x, is_causal=True, kv_cache=module.new_cache(1, 16))
    other = ssm.LatentCache(1, 16, kv_lora_rank=10, d_rope=2, dtype=torch.float32)
    with pytest.raises(ssm.ShapeError, match=r"kv_cache holds kv_lora_rank=10 and d_rope=2 per position"):
        module(x, is_causal=True, kv_cache=other)


# --- the surgery property ---------------------------------------------------------------------------------


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Rounds of: a right call (its verdict remembered), surgery, then the same call again, right or wrong."""
    surgery = st.sampled_from(["hook", "unhook", "global hook", "retype", "reshape", "move mask"])
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        call = {
            "seq": draw(st.integers(1, 4)),
            "batch": draw(st.integers(1, 2)),
            "causal": draw(st.booleans()),
            "padding": draw(st.sampled_from(["none", "cpu", "meta", "float"])),
            "cache": draw(st.booleans()),
            "wrong": draw(st.sampled_from(["d_model", "dtype", "mask length", "mask heads", "cache dtype"])),
        }
        again = call
        kinds = draw(st.lists(surgery, max_size=2))
        if "move mask" in kinds:  # the same call with its padding mask on another device
            call = {**call, "padding": "cpu"}
            again = {**call, "padding": "meta"}
        steps.append(("call", call))
        for kind in kinds:
            target = draw(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj"]))
            steps.append((kind, {"target": target, "cut": draw(st.booleans())}))
        steps.append((draw(st.sampled_from(["call", "wrong call"])), again))
    return steps


def _call(module: Any, d: dict[str, Any], wrong: bool) -> Callable[[], Any]:
    generator = torch.Generator().manual_seed(d["seq"] * 7 + d["batch"])
    dtype = module.k_proj.weight.dtype if isinstance(module.k_proj, nn.Linear) else torch.float32
    width, seq, batch = 16, d["seq"], d["batch"]
    what = d["wrong"] if wrong else None
    x = torch.randn(batch, seq, 17 if what == "d_model" else width, generator=generator)
    x = x.to(torch.float64 if what == "dtype" and dtype != torch.float64 else dtype)
    kv_seq = seq + (2 if d["cache"] else 0)
    kwargs: dict[str, Any] = {"is_causal": d["causal"]}
    if d["padding"] != "none":
        mask = torch.zeros(batch, kv_seq - (what == "mask length"), dtype=torch.bool)
        kwargs["key_padding_mask"] = mask.to("meta") if d["padding"] == "meta" else mask
        if d["padding"] == "float":
            kwargs["key_padding_mask"] = mask.float()
    if what == "mask heads":
        kwargs["attn_mask"] = torch.ones(batch, 3, seq, kv_seq, dtype=torch.bool)

    def run() -> Any:
        if not d["cache"]:
            return module(x, **kwargs)
        cache = ssm.KVCache(batch, 2, 8, 4, dtype=torch.float16 if what == "cache dtype" else dtype)
        module(torch.zeros(batch, 2, width, dtype=x.dtype), is_causal=True, kv_cache=cache)  # a prefill of 2
        return module(x, kv_cache=cache, **kwargs)

    return run


def _cutting_hook(mark: str) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output[..., :-1] if getattr(module, mark, False) else output

    return hook


@given(steps=_steps())
def test_with_surgery_between_calls_a_warm_module_answers_as_a_fresh_one(steps: list[tuple[str, Any]]) -> None:
    """Random right and wrong calls, hooks added and removed (on submodules and module-wide), parameters
    re-typed and replaced by others of another shape, masks moved to another device or made float: each call
    of the warm module (verdicts remembered) has the outcome of the same call on a fresh copy."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, 2)
    handles: list[Any] = []
    global_hooks: list[Any] = []
    try:
        for kind, d in steps:
            if kind in ("call", "wrong call"):
                fresh = _fresh(module)
                _same(_outcome(_call(module, d, kind == "wrong call")), _outcome(_call(fresh, d, kind == "wrong call")))
            elif kind == "hook":
                cut = _cut_keys if d["cut"] else (lambda m, i, o: o)
                handles.append(module._modules[d["target"]].register_forward_hook(cut))  # pyright: ignore[reportOptionalMemberAccess]
            elif kind == "unhook" and handles:
                handles.pop().remove()
            elif kind == "global hook":  # a new module-wide hook, acting on the target only (a mark copies along)
                mark = f"cut_by_hook_{len(global_hooks)}"
                setattr(module._modules[d["target"]], mark, d["cut"])
                global_hooks.append(register_module_forward_hook(_cutting_hook(mark)))
            elif kind == "retype":
                new_dtype = torch.float64 if module.q_proj.weight.dtype == torch.float32 else torch.float32
                module.load_state_dict({k: v.to(new_dtype) for k, v in module.state_dict().items()}, assign=True)
            elif kind == "reshape":
                proj = module._modules[d["target"]]
                weight = proj.weight  # pyright: ignore[reportOptionalMemberAccess]
                rows = weight.shape[0] - 4 if d["cut"] and weight.shape[0] > 4 else weight.shape[0]
                proj.weight = nn.Parameter(torch.randn(rows, weight.shape[1], dtype=weight.dtype))  # pyright: ignore[reportOptionalMemberAccess]
                if proj.bias is not None:  # pyright: ignore[reportOptionalMemberAccess]
                    proj.bias = nn.Parameter(torch.randn(rows, dtype=weight.dtype))  # pyright: ignore[reportOptionalMemberAccess]
    finally:
        for handle in handles + global_hooks:
            handle.remove()


# --- autocast, failed calls, raw errors ---------------------------------------------------------------------


def test_autocast_on_agrees_with_torchs_public_test_of_each_device_type() -> None:
    """`autocast_on` reads torch's private any-autocast flag, in that one place: it agrees with the public
    `torch.is_autocast_enabled` of every device type, off, inside CPU autocast, nested, and after it."""
    from shapesafe_mha._compute.stages import autocast_on

    def public() -> bool:
        return any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda", "xpu", "mps", "hpu", "xla"))

    assert autocast_on() is public() is False
    with torch.autocast("cpu", torch.bfloat16):
        assert autocast_on() is public() is True
        with torch.autocast("cpu", enabled=False):
            assert autocast_on() is public() is False
        assert autocast_on() is True
    assert autocast_on() is public() is False


def test_under_autocast_the_checked_path_accepts_what_unchecked_computes() -> None:
    """A float32 module and input under bfloat16 autocast: a float32 attn_mask and a float32 KVCache were
    refused (the message said "bfloat16 like the module"); now checked == unchecked, and a cache in a third
    dtype is refused naming the dtype autocast computes in."""
    module = ssm.MultiHeadAttention(32, 4, 2)
    x, mask = torch.randn(2, 5, 32), torch.zeros(5, 5)
    with torch.autocast("cpu", torch.bfloat16):
        for call in (
            lambda: module(x, attn_mask=mask),
            lambda: module(x, is_causal=True, kv_cache=module.new_cache(2, 8)),
        ):
            checked = call()
            with ssm.unchecked():
                torch.testing.assert_close(checked, call(), atol=0, rtol=0)
        with pytest.raises(ssm.ShapeError, match=r"kv_cache holds float16 .* \(autocast computes in bfloat16\)"):
            module(x, is_causal=True, kv_cache=module.new_cache(2, 8).to(torch.float16))


@pytest.mark.parametrize("kind", ["multi-head", "latent"])
def test_a_raising_hook_on_the_module_itself_leaves_the_cache_as_it_was(kind: str) -> None:
    """The forward succeeded, then the module's own forward hook raised: len(cache) was 4, not 0."""
    if kind == "multi-head":
        module: Any = ssm.MultiHeadAttention(16, 4, 2)
        x = torch.randn(2, 4, 16)
    else:
        module = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4)
        x = torch.randn(2, 4, 32)
    cache = module.new_cache(2, 8)
    module(x[:, :1], is_causal=True, kv_cache=cache)

    def fails(m: nn.Module, i: Any, o: Any) -> None:
        raise RuntimeError("a hook failed")

    handle = module.register_forward_hook(fails)
    with pytest.raises(RuntimeError, match="a hook failed"):
        module(x, is_causal=True, kv_cache=cache)
    assert len(cache) == 1
    handle.remove()
    module(x[:, 1:], is_causal=True, kv_cache=cache)
    assert len(cache) == 4


def test_latent_attention_refuses_a_float_mask_of_another_dtype_as_multi_head_does() -> None:
    latent = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4, dtype=torch.float64)
    with pytest.raises(ssm.ShapeError, match=r"attn_mask has dtype float32; a float mask is added to the scores"):
        latent(torch.randn(1, 3, 32, dtype=torch.float64), attn_mask=torch.zeros(3, 3))


def test_latent_attention_with_masks_on_meta_checks_shapes() -> None:
    latent = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4, device="meta")
    x = torch.randn(1, 3, 32, device="meta")
    mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    assert latent(x, attn_mask=mask, is_causal=True).shape == (1, 3, 32)
    cache = latent.new_cache(1, 8)
    padding = torch.zeros(1, 3, dtype=torch.bool, device="meta")
    assert latent(x, key_padding_mask=padding, is_causal=True, kv_cache=cache).shape == (1, 3, 32)


@pytest.mark.parametrize("theta", [float("nan"), float("inf"), -1.0])
def test_a_rope_theta_that_is_not_a_positive_finite_number_is_refused(theta: float) -> None:
    """NaN theta gave finite garbage (0.58 off)."""
    with pytest.raises(ssm.ConfigError, match="rope_theta must be a positive finite number"):
        ssm.MultiHeadAttention(16, 4, rope_theta=theta)


def test_rope_with_cross_attention_is_refused_as_not_supported() -> None:
    module = ssm.MultiHeadAttention(16, 4, rope_theta=1e4)
    with pytest.raises(ssm.ShapeError, match=r"cross-attention with rotary embeddings is not supported"):
        module(torch.randn(2, 3, 16), torch.randn(2, 5, 16))


@pytest.mark.parametrize("kind", ["multi-head", "latent"])
def test_vmap_with_a_cache_is_a_shape_error_not_a_torch_error(kind: str) -> None:
    """A cache is one buffer for the batch; writing it from vmapped slices was torch's in-place RuntimeError
    (the module checked first: once without a verdict, once after one)."""
    module: Any = (
        ssm.MultiHeadAttention(16, 4, 2)
        if kind == "multi-head"
        else ssm.LatentAttention(16, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4)
    )
    for _ in range(2):
        cache = module.new_cache(1, 8)
        with pytest.raises(ssm.ShapeError, match=r"kv_cache cannot be written under torch.vmap"):
            torch.vmap(lambda x, c=cache: module(x, kv_cache=c))(torch.randn(3, 1, 2, 16))
        assert len(cache) == 0
        module(torch.randn(1, 2, 16), kv_cache=module.new_cache(1, 8))  # a verdict for that call's shapes
    cache = module.new_cache(3, 8)
    with pytest.raises(ssm.ShapeError, match=r"kv_cache has batch=3 \(axis 0\), but query set batch=1"):
        torch.vmap(lambda x: module(x[None], kv_cache=cache))(torch.randn(3, 2, 16))


def test_check_attention_on_meta_says_it_compares_values() -> None:
    from shapesafe_mha.testing import check_attention

    with pytest.raises(ssm.ConfigError, match=r"device='meta': these checks compare values"):
        check_attention(lambda *a, **k: None, device="meta", max_examples=1)


def test_a_call_the_checks_refuse_reaches_no_submodule_whatever_was_remembered() -> None:
    """Refused before anything runs (the user's hooks on q_proj never see the call), after a remembered
    verdict too: an input on another device, the module moved to another dtype, another d_model."""
    module = ssm.MultiHeadAttention(64, 8, 2)
    seen: list[int] = []
    module.q_proj.register_forward_pre_hook(lambda m, i: seen.append(1))
    x = torch.randn(2, 5, 64)
    module(x)
    assert seen == [1]
    for wrong in (lambda: module(x.to("meta")), lambda: module(torch.randn(2, 5, 32))):
        with pytest.raises(ssm.ShapeError):
            wrong()
        assert seen == [1]
    module.to(torch.float64)
    with pytest.raises(ssm.ShapeError, match="query has dtype float32, but the module's parameters are float64"):
        module(x)
    assert seen == [1]


def test_a_broadcast_of_one_is_not_remembered_as_any_size() -> None:
    """A mask of batch 1 broadcasts over a batch of 2; a mask of batch 3 for a query of batch 1 does not, and
    a verdict for the first must not let the second through (torch would broadcast it to batch 3)."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    module(torch.randn(2, 5, 16), attn_mask=torch.ones(1, 4, 5, 5, dtype=torch.bool))
    with pytest.raises(ssm.ShapeError, match=r"attn_mask has batch=3 \(axis 0\), but query set batch=1"):
        module(torch.randn(1, 5, 16), attn_mask=torch.ones(3, 4, 5, 5, dtype=torch.bool))


def test_a_cache_appended_under_vmap_says_why_and_what_to_do_instead() -> None:
    """The whole message of KVCache.append's refusal under vmap (pinned from surviving mutants of its text)."""
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32)
    with pytest.raises(ssm.ShapeError) as raised:
        torch.vmap(lambda k: cache.append(k[None], k[None]))(torch.randn(3, 2, 1, 4))
    assert str(raised.value) == (
        "KVCache.append(): kv_cache cannot be written under torch.vmap: it is one buffer for the whole batch, and "
        "each mapped slice would write into it; call the module on the batch instead (kv_cache's batch is its "
        "first axis)."
    )
    assert len(cache) == 0


# --- pinned from surviving generated mutants (mutmut) ---------------------------------------------------------


def _cut_marked_input(module: nn.Module, args: tuple[Any, ...]) -> Any:
    return (args[0][:, :-1],) if getattr(module, "cut", False) else None


def test_a_module_wide_pre_hook_that_torch_would_not_catch_is_checked_after_a_verdict() -> None:
    """A module-wide forward pre-hook dropping o_proj's last position makes no torch op fail: the verdict's key
    counts module-wide pre-hooks too, so the call is checked."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module(x, is_causal=True)
    module.o_proj.cut = True
    handle = register_module_forward_pre_hook(_cut_marked_input)
    try:
        with pytest.raises(ssm.ShapeError, match=r"o_proj returned a wrong value: the result has seq=5"):
            module(x, is_causal=True)
    finally:
        handle.remove()


def test_a_module_wide_hook_beside_a_submodules_own_hook_is_checked_after_a_verdict() -> None:
    """o_proj has a hook of its own when the verdict is made; a module-wide hook added later is still seen."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    module.o_proj.register_forward_hook(lambda m, i, o: o)
    module(x, is_causal=True)
    module.o_proj.cut = True
    handle = register_module_forward_hook(lambda m, i, o: o[..., :-1] if getattr(m, "cut", False) else o)
    try:
        with pytest.raises(ssm.ShapeError, match="o_proj returned a wrong value"):
            module(x, is_causal=True)
    finally:
        handle.remove()


def test_a_hook_replaced_by_another_after_a_verdict_is_checked() -> None:
    """One hook removed and another added (as many as before): the newest handle moved, so the call is checked."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 6, 16)
    handle = module.o_proj.register_forward_hook(lambda m, i, o: o)
    module(x, is_causal=True)
    handle.remove()
    module.o_proj.register_forward_hook(lambda m, i, o: o[..., :-1])
    with pytest.raises(ssm.ShapeError, match="o_proj returned a wrong value"):
        module(x, is_causal=True)


def test_an_output_projection_of_another_width_after_a_verdict_is_checked() -> None:
    """o_proj.weight replaced by one of 15 rows (no bias): torch computes a 15-wide output silently; the verdict's
    key holds the projections' weight shapes, so the call is checked."""
    module = ssm.MultiHeadAttention(16, 4, 2, bias=False)
    x = torch.randn(2, 6, 16)
    module(x)
    module.o_proj.weight = nn.Parameter(torch.randn(15, 16))
    with pytest.raises(ssm.ShapeError, match=r"o_proj returned a wrong value: the result has d_model=15"):
        module(x)


@pytest.mark.parametrize("kind", ["a hook on a projection", "rope"])
def test_a_hooked_or_rotary_module_remembers_its_verdicts(kind: str) -> None:
    """The same call again is not checked again, with a hook on q_proj or a rotary submodule (no weight) too."""
    from unittest import mock

    module = ssm.MultiHeadAttention(16, 4, 2, rope_theta=10000.0 if kind == "rope" else None)
    if kind != "rope":
        module.q_proj.register_forward_hook(lambda m, i, o: o)
    x = torch.randn(2, 6, 16)
    with mock.patch.object(ssm.MultiHeadAttention, "_checked", autospec=True, side_effect=module._checked.__func__):
        checked = ssm.MultiHeadAttention._checked
        for _ in range(3):
            module(x, is_causal=True)
        assert checked.call_count == 1  # pyright: ignore[reportAttributeAccessIssue]


def test_module_state_changes_with_every_hook_added_or_removed_and_every_weight_shape() -> None:
    """What a verdict reads of the submodules: a hook added or removed in any table (theirs, or module-wide
    forward and pre-forward) and a weight of another shape each give another state."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from shapesafe_mha._compute.fastpath import module_state

    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    states = [module_state([first, second])]
    handles = [first.register_forward_hook(lambda m, i, o: o)]
    states.append(module_state([first, second]))
    handles.append(second.register_forward_pre_hook(lambda m, i: None))
    states.append(module_state([first, second]))
    handles.append(register_module_forward_hook(lambda m, i, o: o))
    states.append(module_state([first, second]))
    handles.append(register_module_forward_pre_hook(lambda m, i: None))
    try:
        states.append(module_state([first, second]))
        for handle in handles[:-1]:
            handle.remove()
            states.append(module_state([first, second]))
    finally:
        handles[-1].remove()
    states.append(module_state([first, second]))
    second.weight = nn.Parameter(torch.randn(5, 4))
    states.append(module_state([first, second]))
    assert len(set(states[1:-2])) == len(states[1:-2]), states
    assert states[-2] == states[0] and states[-1] != states[0]


def test_a_module_wide_hook_raising_after_forward_leaves_the_cache_as_it_was() -> None:
    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 4, 16)
    cache = module.new_cache(2, 8)
    module(x[:, :1], is_causal=True, kv_cache=cache)

    def fails(m: nn.Module, i: Any, o: Any) -> None:
        if m is module:
            raise RuntimeError("a hook failed")

    handle = register_module_forward_hook(fails)
    try:
        with pytest.raises(RuntimeError, match="a hook failed"):
            module(x[:, 1:], is_causal=True, kv_cache=cache)
    finally:
        handle.remove()
    assert len(cache) == 1


def test_with_a_hook_on_the_module_decoding_still_equals_one_causal_forward() -> None:
    """The hook makes the call go through the cache-restoring wrapper: the keyword arguments reach forward."""
    module = ssm.MultiHeadAttention(16, 4, 2).double()
    module.register_forward_hook(lambda m, i, o: o)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    cache = module.new_cache(2, 8)
    steps = [module(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, 1), module(x, is_causal=True), atol=1e-10, rtol=1e-8)


def _same_relations(a: tuple[int, ...], b: tuple[int, ...], constants: frozenset[int]) -> bool:
    """What a shape check can tell apart, stated directly: sizes that are 0, 1 or a constant are seen as they are,
    any other only through which sizes equal it."""
    if len(a) != len(b):
        return False
    kept = [(x < 2 or x in constants, y < 2 or y in constants) for x, y in zip(a, b, strict=True)]
    if any(kx != ky or (kx and x != y) for (kx, ky), x, y in zip(kept, a, b, strict=True)):
        return False
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((5,), (1,)),  # another size is not a broadcast one
        ((5, 6), (5, 5)),  # two sizes are not one
        ((5, 6, 7), (5, 6, 1)),
        ((2, 3, 2), (4, 5, 4)),  # 2 is a size like any other: decoding from 2 keys to 3 keeps the key
        ((2, 3), (3, 2)),
        ((0, 1, 4, 9), (0, 1, 4, 8)),
        ((0, 1, 4, 9), (1, 0, 4, 9)),
        ((3, 4), (3, 5)),  # 4 is the module's constant here
        ((7, 7, 3), (9, 9, 3)),
    ],
)
def test_relational_keys_agree_exactly_when_a_check_cannot_tell_the_sizes_apart(
    a: tuple[int, ...], b: tuple[int, ...]
) -> None:
    from shapesafe_mha._core.contract import relational

    constants = frozenset({4})
    assert (relational(a, constants) == relational(b, constants)) == _same_relations(a, b, constants)


@given(sizes=st.lists(st.integers(0, 9), max_size=6), offset=st.integers(1, 20))
def test_relational_keys_stay_the_same_when_every_free_size_moves_alike(sizes: list[int], offset: int) -> None:
    from shapesafe_mha._core.contract import relational

    constants = frozenset({4})
    moved = tuple(s if s < 2 or s in constants else s + 100 * offset for s in sizes)
    assert relational(tuple(sizes), constants) == relational(moved, constants)
    assert _same_relations(tuple(sizes), moved, constants)


def test_the_verdict_memo_never_holds_more_than_max_verdicts() -> None:
    from shapesafe_mha._core.contract import MAX_VERDICTS, Verdicts

    verdicts = Verdicts()
    for n in range(MAX_VERDICTS + 2):
        verdicts.remember((n,), ("relations", n))
        assert len(verdicts.exact) <= MAX_VERDICTS and len(verdicts.relations) <= MAX_VERDICTS
    assert (MAX_VERDICTS + 1,) in verdicts.exact  # the newest is kept when the memo is forgotten


def test_a_call_known_by_its_relations_is_then_known_by_its_exact_key() -> None:
    """The relations key is asked for only when the exact key misses: once a call was answered by its relations,
    the same call again is one lookup."""
    from shapesafe_mha._core.contract import Verdicts

    verdicts = Verdicts()
    verdicts.remember(("exact", 5), ("relations",))
    assert verdicts.known(("exact", 6), lambda: ("relations",))

    def never() -> Any:
        raise AssertionError("the relations key was asked for a call already known exactly")

    assert verdicts.known(("exact", 6), never)
    assert not verdicts.known(("exact", 7))


def test_a_verdict_remembered_outside_autocast_does_not_cover_a_call_inside_it() -> None:
    """A float16 module decoding into its float16 cache passes; under bfloat16 autocast the same call computes
    bfloat16 keys, which that cache does not hold: refused, as on a fresh module, not let through by the verdict."""
    module = ssm.MultiHeadAttention(16, 4, 2, dtype=torch.float16)
    cache = module.new_cache(1, 8)
    module(torch.randn(1, 2, 16, dtype=torch.float16), is_causal=True, kv_cache=cache)
    module(torch.randn(1, 1, 16, dtype=torch.float16), is_causal=True, kv_cache=cache)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(ssm.ShapeError, match=r"kv_cache holds float16 on cpu, but the module computes bfloat16 on cpu"),
    ):
        module(torch.randn(1, 1, 16, dtype=torch.float16), is_causal=True, kv_cache=cache)
    assert len(cache) == 3


def _nearly_full_cache_and_a_retyped_output_projection() -> tuple[ssm.MultiHeadAttention, ssm.KVCache]:
    """A module whose cache has room for one more position, and whose o_proj weight became float64 in place (its
    shape kept, so a verdict's key cannot see it): the call fails in o_proj, after writing the cache."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = module.new_cache(1, 4)
    module(torch.randn(1, 2, 16), is_causal=True, kv_cache=cache)
    module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    return module, cache


def test_a_failure_after_the_cache_write_is_explained_from_the_cache_as_it_was() -> None:
    """After a verdict, the unchecked call fails past its cache write and is run again checked to explain it: that
    run starts from the cache before the call (a full one would add a capacity error of its own), so the warm module
    reports what a fresh one reports, and the cache keeps its length."""
    outcomes = []
    for warm in (True, False):
        module, cache = _nearly_full_cache_and_a_retyped_output_projection()
        if not warm:
            module._verdicts.forget()
        module.o_proj.weight.data = module.o_proj.weight.data.double()
        outcomes.append(_outcome(lambda m=module, c=cache: m(torch.randn(1, 1, 16), is_causal=True, kv_cache=c)))
        assert len(cache) == 3
    assert outcomes[0][0] != "ok"
    _same(outcomes[0], outcomes[1])


class _FailsOnce(nn.Linear):
    """A projection whose next call raises torch's kind of error once (a transient failure), when armed."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise RuntimeError("transient")
        return super().forward(x)


def test_after_a_verdict_an_error_the_checks_do_not_reproduce_reaches_the_caller_as_raised() -> None:
    """The unchecked call fails, the checked run passes: the caller gets that failure itself, not another error."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    module.q_proj = _FailsOnce(16, 16)
    x = torch.randn(1, 3, 16)
    module(x)
    module.q_proj.armed = True
    with pytest.raises(RuntimeError, match=r"^transient$"):
        module(x)


def test_a_repeated_module_call_is_known_by_its_exact_key() -> None:
    """The relations key is computed on first sight only (asked for, then remembered): the same call again is found
    by its exact key, without abstracting its sizes."""
    from shapesafe_mha._core.contract import CallKey

    computed: list[Any] = []
    original = CallKey.relations

    def counted(self: CallKey, constants: frozenset[int]) -> Any:
        computed.append(self)
        return original(self, constants)

    module = ssm.MultiHeadAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(CallKey, "relations", counted)
        module(x)  # first sight: asked for (the exact key missed), then remembered
        first = len(computed)
        for _ in range(2):
            module(x)
    assert first > 0 and len(computed) == first


class _Narrows(nn.Linear):
    """A projection that, once armed, returns four features fewer (state no verdict key can see)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out[..., :-4] if self.armed else out


def test_a_submodule_returning_another_width_after_a_verdict_is_explained_as_on_a_fresh_module() -> None:
    """The unchecked call fails in torch; run again checked it is our ShapeError naming q_proj, the same line a
    module with no verdict gives."""
    outcomes = []
    for warm in (True, False):
        module = ssm.MultiHeadAttention(16, 4, 2)
        module.q_proj = _Narrows(16, 16)
        x = torch.randn(1, 3, 16)
        module(x)
        if not warm:
            module._verdicts.forget()
        module.q_proj.armed = True
        outcomes.append(_outcome(lambda m=module, x=x: m(x)))
    assert outcomes[0][0] == "ShapeError" and "q_proj returned a wrong value" in outcomes[0][1], outcomes[0]
    _same(outcomes[0], outcomes[1])


class _KeepsOneKey(torch.Tensor):
    """A padding mask whose inversion keeps only its first key: a bug in the mask's own type, not in the call."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.narrow(-1, 0, 1) if func in (torch.Tensor.__invert__, torch.logical_not) else out


@pytest.mark.parametrize(
    ("make", "setter"),
    [
        (lambda: ssm.MultiHeadAttention(16, 4, 2), "key"),
        (lambda: ssm.LatentAttention(16, 4, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4), "the new latent"),
    ],
    ids=["mha", "latent"],
)
def test_a_verdict_for_a_plain_padding_mask_is_none_for_a_tensor_subclass_of_it(make: Any, setter: str) -> None:
    """The mask's type is part of what a verdict covers: after a call with a plain bool padding mask, the same
    mask as a subclass whose operations differ is checked as on a fresh module, a ShapeError, not run unchecked."""
    module, x = make(), torch.randn(2, 5, 16)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, :2] = True
    module(x, key_padding_mask=padding)
    odd = padding.as_subclass(_KeepsOneKey)
    message = rf"mask returned a wrong value: the result has kv_seq=1 \(axis 3\), but {setter} set kv_seq=5"
    for warm in (make(), module):
        with pytest.raises(ssm.ShapeError, match=message):
            warm(x, key_padding_mask=odd)


def test_a_verdict_for_a_key_of_one_position_is_none_for_a_longer_key() -> None:
    """Cross-attention to a single key, with a mask over that one key, is right; the same mask beside a key of 4
    positions would broadcast over all of them unchecked, so after that verdict it is refused as on a fresh module."""
    module, query = ssm.MultiHeadAttention(16, 4, 2), torch.randn(2, 5, 16)
    mask = torch.ones(5, 1, dtype=torch.bool)
    module(query, torch.randn(2, 1, 16), attn_mask=mask)
    message = r"attn_mask has kv_seq=1 \(axis 1\), but key set kv_seq=4\. Masks broadcast only over batch and heads"
    for warm in (ssm.MultiHeadAttention(16, 4, 2), module):
        with pytest.raises(ssm.ShapeError, match=message):
            warm(query, torch.randn(2, 4, 16), attn_mask=mask)


@pytest.mark.parametrize("value", [True, False])
def test_a_verdict_for_need_weights_is_none_for_the_int_equal_to_it(value: bool) -> None:
    """1 == True and 0 == False, and hash alike: after a call with the bool, the int is still refused, as on a
    fresh module (need_weights' annotation is bool; tests/test_contract.py shows the same of is_causal)."""
    module, x = ssm.MultiHeadAttention(16, 4, 2), torch.randn(2, 5, 16)
    module(x, need_weights=value)
    for warm in (ssm.MultiHeadAttention(16, 4, 2), module):
        with pytest.raises(ssm.ShapeError, match=rf"need_weights must be bool, but got int {int(value)}"):
            warm(x, need_weights=int(value))  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
def test_a_mask_over_the_first_step_only_is_refused_at_the_second(name: str) -> None:
    """Decoding with a mask: at the first step one key is all there is, and a mask over one key is right; at the
    second the cache holds two, and the same mask (which would broadcast over both unchecked) is refused, the cache
    left as it was."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = module.new_cache(2, 8)
    one = torch.ones(1, 1, dtype=torch.bool) if name == "attn_mask" else torch.zeros(2, 1, dtype=torch.bool)
    module(torch.randn(2, 1, 16), kv_cache=cache, **{name: one})
    with pytest.raises(ssm.ShapeError, match=rf"{name} has kv_seq=1 \(axis 1\), but the cache plus key set kv_seq=2"):
        module(torch.randn(2, 1, 16), kv_cache=cache, **{name: one})
    assert len(cache) == 1


def test_a_verdict_for_integer_positions_is_none_for_float_ones() -> None:
    """Float positions would turn queries and keys unchecked as well as integer ones do; after a call with integer
    positions they are still refused, as on a fresh module."""
    x, positions = torch.randn(2, 5, 16), torch.arange(5).expand(2, 5)
    module = ssm.MultiHeadAttention(16, 4, 2, rope_theta=1e4)
    module(x, positions=positions)
    for warm in (ssm.MultiHeadAttention(16, 4, 2, rope_theta=1e4), module):
        with pytest.raises(ssm.ShapeError, match=r"positions has dtype float32, but it must be int"):
            warm(x, positions=positions.float())


def test_a_verdict_under_float16_autocast_does_not_cover_a_call_under_bfloat16_autocast() -> None:
    """Under float16 autocast a float32 module decodes into a float16 cache; under bfloat16 autocast the same call
    computes bfloat16 keys, which that cache does not hold: refused, as on a fresh module, the cache as it was."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16):
        module(torch.randn(1, 2, 16), is_causal=True, kv_cache=cache)
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(ssm.ShapeError, match=r"kv_cache holds float16 on cpu, but the module computes bfloat16 on cpu"),
    ):
        module(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache)
    assert len(cache) == 3


# name: (the right value, one that would broadcast unchecked, the start of its refusal)
BROADCAST_UNCHECKED = {
    "attn_mask": (torch.ones(5, 5, dtype=torch.bool), torch.ones(5, 1, dtype=torch.bool),
                  r"attn_mask has kv_seq=1 \(axis 1\), but key set kv_seq=5\. Masks broadcast only over batch"),
    "key_padding_mask": (torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 1, dtype=torch.bool),
                         r"key_padding_mask has kv_seq=1 \(axis 1\), but key set kv_seq=5"),
    "positions": (torch.arange(5).expand(2, 5), torch.arange(5)[None], r"positions has batch=1 \(axis 0\)"),
}  # fmt: skip


@pytest.mark.parametrize("name", BROADCAST_UNCHECKED)
def test_a_verdict_for_a_full_size_argument_is_none_for_one_that_broadcasts(name: str) -> None:
    """A mask over one key, or positions for one sequence, would broadcast unchecked; after a call with the full
    size they are still refused, as on a fresh module (masks broadcast only over batch and heads)."""
    right, broadcast, message = BROADCAST_UNCHECKED[name]
    x, rope = torch.randn(2, 5, 16), {"rope_theta": 1e4} if name == "positions" else {}
    module = ssm.MultiHeadAttention(16, 4, 2, **rope)
    module(x, **{name: right})
    for warm in (ssm.MultiHeadAttention(16, 4, 2, **rope), module):
        with pytest.raises(ssm.ShapeError, match=message):
            warm(x, **{name: broadcast})


class _FirstSequenceOnly(ssm.KVCache):
    """A cache whose write hands back the first sequence's keys and values only: a bug in the cache's own type."""

    def write(self, k: torch.Tensor, v: torch.Tensor, owner: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().write(k, v, owner)
        return keys[:1], values[:1]


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_a_verdict_for_a_plain_cache_is_none_for_a_subclass_of_it(num_kv_heads: int) -> None:
    """The cache's type is part of what a verdict covers: after a call into a plain KVCache, the same call into a
    subclass whose write differs is checked as on a fresh module, a ShapeError, not run unchecked (attention would
    broadcast the one sequence's keys over the batch and return an output of the right shape)."""
    module, x = ssm.MultiHeadAttention(16, 4, num_kv_heads), torch.randn(2, 3, 16)
    module(x, is_causal=True, kv_cache=module.new_cache(2, 8))
    message = r"cache returned a wrong value: the result has batch=1 \(axis 0\), but query set batch=2"
    for warm in (ssm.MultiHeadAttention(16, 4, num_kv_heads), module):
        with pytest.raises(ssm.ShapeError, match=message):
            warm(x, is_causal=True, kv_cache=_FirstSequenceOnly(2, num_kv_heads, 8, 4, dtype=torch.float32))


_VALUES = [7, True, 7.0, None, "seven", torch.zeros(2, 7), nn.Parameter(torch.zeros(7)), torch.zeros(3, device="meta")]
_VALUE_IDS = ["int", "bool", "float", "None", "str", "tensor", "parameter", "meta tensor"]


def _key_by_definition(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """`signature_key` as its docstring defines it: each value's `signature_of`, a tensor's four parts inline,
    the keywords after `KEYWORDS`, each after its name."""
    from shapesafe_mha._core.contract import KEYWORDS, signature_of

    def parts(value: Any) -> tuple[Any, ...]:
        return signature_of(value) if isinstance(value, torch.Tensor) else (signature_of(value),)

    key = [part for value in args for part in parts(value)]
    if kwargs:
        key += [KEYWORDS, *(part for name, value in kwargs.items() for part in (name, *parts(value)))]
    return tuple(key)


@pytest.mark.parametrize("second", _VALUES, ids=_VALUE_IDS)
def test_a_stage_call_is_keyed_as_its_definition_says_on_every_fast_path(second: Any) -> None:
    """`signature_key` builds the usual keys in one tuple, (tensor,), (tensor, tensor), (tensor, head count) and
    a flag as a keyword: each the key its definition gives (so a bool or float never passes for the int, nor a
    meta tensor for a CPU one), whatever the other argument, in either order, positional or by keyword."""
    from shapesafe_mha._core.contract import signature_key

    first = torch.zeros(2, 3)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((second,), {}),
        ((first, second), {}),
        ((second, first), {}),
        ((first, first, second), {}),
        ((first,), {"flag": second}),
        ((first, first, first), {"is_causal": True, "flag": second}),
    ]
    for args, kwargs in calls:
        assert signature_key(args, kwargs) == _key_by_definition(args, kwargs), (args, kwargs)
    other = 8 if type(second) is int else 7
    assert signature_key((first, second), {}) != signature_key((first, other), {})
    assert signature_key((first,), {"flag": second}) != signature_key((first,), {"flag": other})


_TENSORS = st.sampled_from([
    torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2), torch.zeros(2, 3, device="meta"),
    torch.nn.Parameter(torch.zeros(2, 3)), torch.zeros(()),
])  # fmt: skip


@given(st.lists(_TENSORS, min_size=1, max_size=6))
def test_the_unrolled_key_of_a_call_of_tensors_is_its_signature_key(tensors: list[torch.Tensor]) -> None:
    """A decorated function of tensors only is keyed by `UNROLLED[n]`, unrolled for speed: our stages' key
    (`signature_key`, its definition) less the devices, which no annotation reads, and nothing else less."""
    from shapesafe_mha._core.contract import UNROLLED, signature_key

    args = tuple(tensors)
    full = signature_key(args, {})
    assert full == _key_by_definition(args, {})
    assert UNROLLED[len(args)](args) == tuple(part for part in full if not isinstance(part, torch.device))


def test_a_keyword_call_remembered_does_not_cover_a_text_argument_in_its_place() -> None:
    """`project(x, weight=w)` and `project(x, "weight", w)` are two keys (the keywords follow a marker), so the
    second, refused by a fresh process, is refused after the first too, with our message, not torch's TypeError;
    the same for the keys of users' decorated functions."""
    from shapesafe_mha._core.contract import signature_key

    x, w = torch.randn(2, 5, 8), torch.randn(6, 8)
    assert signature_key((x,), {"weight": w}) != signature_key((x, "weight", w), {})
    assert ssm.project(x, weight=w).shape == (2, 5, 6)
    with pytest.raises(ssm.ShapeError, match=r"^project\(\): weight must be a torch.Tensor, but got str"):
        ssm.project(x, "weight", w)  # pyright: ignore[reportArgumentType]


def test_a_stage_verdict_for_plain_tensors_does_not_cover_a_subclass_of_them() -> None:
    """A tensor's type is in a stage's key: a subclass can change what torch returns (here SDPA's result in
    int64), which the result check of a fresh call refuses; remembered for plain tensors, it is checked again."""

    q = torch.randn(2, 4, 5, 8)
    assert ssm.scaled_dot_product_attention(q, q, q).dtype == torch.float32
    with pytest.raises(ssm.ShapeError, match="returned a wrong value"):
        ssm.scaled_dot_product_attention(q.as_subclass(_Integral), q, q)


def test_the_hf_backend_s_verdict_for_plain_tensors_does_not_cover_a_subclass_of_them() -> None:
    """`attn_implementation="shapesafe"`'s key holds the tensors' types too: a subclass whose SDPA returns int64 is
    refused after a call with plain tensors of the same shapes, as by a fresh process."""
    from shapesafe_mha.hf import attention

    layer, q = nn.Module(), torch.randn(2, 4, 5, 8)
    assert attention(layer, q, q, q, is_causal=True)[0].dtype == torch.float32
    with pytest.raises(ssm.ShapeError, match="the result has dtype int64"):
        attention(layer, q.as_subclass(_Integral), q, q, is_causal=True)


class _Integral(torch.Tensor):
    """A tensor whose SDPA returns int64: what torch returns changed by a subclass."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.to(torch.int64) if func is torch.nn.functional.scaled_dot_product_attention else out


_Head = Float[torch.Tensor, "batch num_heads seq d_head"]


def _attend(q: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def _one(a: _Head) -> _Head:
    return _attend(a)


def _two(a: _Head, b: _Head) -> _Head:
    return _attend(a + b)


def _three(a: _Head, b: _Head, c: _Head) -> _Head:
    return _attend(a + b + c)


def _four(a: _Head, b: _Head, c: _Head, d: _Head) -> _Head:
    return _attend(a + b + c + d)


@pytest.mark.parametrize("fn", [_one, _two, _three, _four], ids=lambda fn: fn.__name__)
def test_a_decorated_function_s_verdict_for_plain_tensors_does_not_cover_a_subclass_of_them(fn: Any) -> None:
    """Users' decorated functions of one to six tensors are keyed as our stages' calls, unrolled (`UNROLLED`); the
    type is in that key: a subclass whose SDPA returns int64, refused by a fresh call's result check, is refused
    after a call with plain tensors of the same shapes too, in every position."""
    q = torch.randn(2, 4, 5, 8)
    arguments = len(inspect.signature(fn).parameters)
    for position in range(arguments):
        checked = ssm.shapecheck(fn)
        assert checked.__shapecheck__.arity == arguments  # the unrolled key, not the general one
        tensors = [q] * arguments
        assert checked(*tensors).dtype == torch.float32
        tensors[position] = q.as_subclass(_Integral)
        with pytest.raises(ssm.ShapeError, match="the result has dtype int64"):
            checked(*tensors)


def _sequential_output(module: ssm.MultiHeadAttention) -> None:
    module.o_proj = nn.Sequential(nn.Linear(16, 16))


def _narrowed_by_another_layer(module: Any) -> None:
    module.o_proj[0] = nn.Linear(16, 8)


def _narrowed_through_data(module: Any) -> None:
    layer = module.o_proj[0]
    layer.weight.data, layer.bias.data = torch.ones(8, 16), torch.ones(8)


def _set(name: str, value: Callable[[], Any]) -> Callable[[Any], None]:
    return lambda module: setattr(module, name, value())


def _written(name: str, value: Callable[[], Any]) -> Callable[[Any], None]:
    return lambda module: setattr(getattr(module, name), "data", value())


class _BufferLinear(nn.Module):
    """A projection whose weight is a buffer, as quantized layers hold theirs."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


class _PostLinear(nn.Linear):
    """A linear layer with a module of its own after it."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.post: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(super().forward(x))


def _buffer_output(module: Any) -> None:
    module.o_proj = _BufferLinear(16, 16)


def _post_output(module: Any) -> None:
    module.o_proj = _PostLinear(16, 16)


def _narrower_post(module: Any) -> None:
    module.o_proj.post = nn.Linear(16, 8)


def _narrowing_inner_hook(module: Any) -> None:
    module.o_proj[0].register_forward_hook(lambda layer, inputs, output: output[..., :8])


def _written_buffer(module: Any) -> None:
    module.o_proj.w.data = torch.ones(8, 16)


def _wider_rotary_tables(module: Any) -> None:
    module.rotary.inv_freq.data = torch.ones(2)


_CHANGES: dict[str, tuple[dict[str, Any], Callable[[Any], None] | None, Callable[[Any], None]]] = {
    "sinks set, one a KV head": ({"attention_sinks": True}, None, _set("sinks", lambda: nn.Parameter(torch.ones(2)))),
    "sinks written through .data": ({"attention_sinks": True}, None, _written("sinks", lambda: torch.ones(2))),
    "ALiBi slopes set, one a KV head": ({"alibi": True}, None, _set("alibi_slopes", lambda: torch.ones(2))),
    "ALiBi slopes written through .data": ({"alibi": True}, None, _written("alibi_slopes", lambda: torch.ones(2))),
    "num_heads set to the KV heads'": ({}, None, _set("num_heads", lambda: 2)),
    "window set wider than the cache's": ({"window": 4}, None, _set("window", lambda: 8)),
    "a wrapped projection's layer replaced": (
        {},
        _sequential_output,
        lambda m: m.o_proj.__setitem__(0, nn.Linear(16, 8)),
    ),
    "a wrapped projection's layer written through .data": ({}, _sequential_output, _narrowed_through_data),
    "a hook that narrows, added inside a wrapped projection": ({}, _sequential_output, _narrowing_inner_hook),
    "a buffer-held projection weight written through .data": ({}, _buffer_output, _written_buffer),
    "a projection's own submodule replaced": ({}, _post_output, _narrower_post),
    "partial rotary's tables written through .data": ({"rope_theta": 1e4, "rope_dim": 2}, None, _wider_rotary_tables),
}


@pytest.mark.parametrize(
    ("call", "change"),
    [(call, change) for call in ("decoding", "prefill with autograd") for change in _CHANGES
     if call == "decoding" or "cache" not in change],  # (a window matters only beside a cache)
)  # fmt: skip
def test_what_the_module_holds_changed_after_a_verdict_is_checked_as_by_a_fresh_module(call: str, change: str) -> None:
    """Calls remembered (decoding steps, or prefills with autograd on, the separate projections' path), then
    something the module holds changed without its submodules being replaced: its own tensors (sinks, ALiBi
    slopes) set or written through `.data`, a size or option set, a layer inside a wrapped projection replaced or
    written. The next call is refused as by a fresh copy of the changed module, with the same first line."""
    options, prepare, mutate = _CHANGES[change]
    module = ssm.MultiHeadAttention(16, num_heads=4, num_kv_heads=2, **options).eval()
    if prepare is not None:
        prepare(module)
    decoding = call == "decoding"
    cache = module.new_cache(1, 16) if decoding else None
    with torch.set_grad_enabled(not decoding):
        if cache is not None:
            module(torch.randn(1, 3, 16), is_causal=True, kv_cache=cache)
        for _ in range(3):
            x = torch.randn(1, 1 if decoding else 5, 16)
            assert _outcome(lambda x=x: module(x, is_causal=True, kv_cache=cache))[0] == "ok"
        mutate(module)
        fresh, fresh_cache = _fresh(module), copy.deepcopy(cache)
        x = torch.randn(1, 1 if decoding else 5, 16)
        expected = _outcome(lambda: fresh(x, is_causal=True, kv_cache=fresh_cache))
        assert expected[0] == "ShapeError", expected
        _same(_outcome(lambda: module(x, is_causal=True, kv_cache=cache)), expected)


class _Projection(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in))

    @ssm.shapecheck
    def forward(self, x: Float[torch.Tensor, "batch d_model"]) -> Float[torch.Tensor, "batch d_model"]:
        return x @ self.w.T


def _replaced(module: _Projection) -> _Projection:
    module.w = nn.Parameter(torch.randn(4, 8))
    return module


def _written(module: _Projection) -> _Projection:
    module.w.data = torch.randn(4, 8)
    return module


@pytest.mark.parametrize(
    "second",
    [lambda first: _Projection(8, 4), _replaced, _written],
    ids=["another instance", "its parameter replaced", "its parameter written through .data"],
)
def test_a_decorated_method_s_verdict_does_not_cover_what_self_changes_in_its_result(second: Any) -> None:
    """A method's body reads `self`, which its key does not hold (its sizes on self only): a call remembered for
    one instance does not cover another's whose parameter makes the result wrong, nor the same instance's after
    its parameter is replaced or written through `.data`; each is refused as by the same method with nothing
    remembered (the result compared with the checked call's, and checked where they differ)."""
    first, x = _Projection(8, 8), torch.randn(2, 8)
    assert first(x).shape == (2, 8)
    other = second(first)
    fresh = ssm.shapecheck(_Projection.forward.__wrapped__)  # the same method, nothing remembered
    expected = _outcome(lambda: fresh(other, x))
    assert expected[0] == "ShapeError", expected
    _same(_outcome(lambda: other(x)), expected)
    _same(_outcome(lambda: other(x)), expected)  # and again, the new result remembered as checked


@pytest.mark.parametrize(("name", "value"), [("num_heads", 2), ("d_rope", 2), ("d_value", 3), ("d_model", 32)])
def test_a_latent_module_s_size_set_after_a_verdict_is_what_it_checks_against(name: str, value: int) -> None:
    """A `LatentAttention` size set after construction (decoding remembered) is the size its checks seed, in the
    next step of the warm module and of a fresh copy alike: the step is refused by both, with the same first line
    (the sizes it checked against were the ones it was built with, so a changed `d_rope`, `d_value` or `d_model`
    ran silently, and a changed `num_heads` was blamed on the projection's split)."""
    module = ssm.LatentAttention(64, 4, q_lora_rank=24, kv_lora_rank=16, d_nope=8, d_rope=4, d_value=6)
    cache = module.new_cache(1, 16)
    with torch.no_grad():
        module(torch.randn(1, 5, 64), is_causal=True, kv_cache=cache)
        module(torch.randn(1, 1, 64), is_causal=True, kv_cache=cache)
        setattr(module, name, value)
        fresh, fresh_cache = _fresh(module), copy.deepcopy(cache)
        step = torch.randn(1, 1, 64)
        expected = _outcome(lambda: fresh(step, is_causal=True, kv_cache=fresh_cache))
        assert expected[0] == "ShapeError" and f"{name}={value}" in expected[1], expected
        _same(_outcome(lambda: module(step, is_causal=True, kv_cache=cache)), expected)


class _Block(nn.Module):
    """A feed-forward block whose hidden width its `forward` expects to be 4 * d_model."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.up, self.down = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    @ssm.shapecheck
    def forward(self, x: Float[torch.Tensor, "batch seq d_model"]) -> Float[torch.Tensor, "batch seq d_model"]:
        hidden = ssm.expect(self.up(x), "batch seq 4*d_model", "hidden")
        return self.down(ssm.expect(hidden.relu(), "batch seq 4*d_model", "activated"))


def test_a_decorated_method_s_expectations_are_compared_when_its_verdict_is_remembered() -> None:
    """`ssm.expect` inside a remembered method: its body reads `self`, so each expectation is compared with the
    checked call's and checked from the first that differs on, with the arguments' dimensions: another instance
    whose hidden width breaks `4*d_model`, or the same one's layers replaced, is refused as by the method with
    nothing remembered, and a right instance still passes, before and after."""
    x = torch.randn(2, 5, 16)
    right = _Block(16, 64)
    assert right(x).shape == (2, 5, 16)
    message = (
        r"^_Block.forward\(\): hidden has 4\*d_model=32 \(axis 2\), but the module \(d_model=16\) set 4\*d_model=64"
    )
    with pytest.raises(ssm.ShapeError, match=message):
        _Block(16, 32)(x)
    assert right(x).shape == (2, 5, 16)
    right.up, right.down = nn.Linear(16, 32), nn.Linear(32, 16)
    with pytest.raises(ssm.ShapeError, match=message):
        right(x)
    fresh = ssm.shapecheck(_Block.forward.__wrapped__)
    with pytest.raises(ssm.ShapeError, match=message):
        fresh(right, x)


def _verdict_of(fn: Callable[..., Any], *args: Any) -> type | None:
    try:
        fn(*args)
    except ssm.ShapeError as error:
        return type(error)
    return None


@given(calls=st.lists(st.tuples(st.sampled_from([1.0, -1.0]), st.sampled_from([1.0, 9.0])), min_size=1, max_size=4))
def test_a_value_validator_is_checked_on_every_call_as_by_a_fresh_decoration(calls: list[tuple[float, float]]) -> None:
    """An annotation whose verdict reads values (beartype's `Is[...]`), on an argument or the result, is never
    covered by a verdict remembered from another call with the same shapes: each call's outcome is a fresh one's."""
    from typing import Annotated

    from beartype.vale import Is

    Positive = Annotated[Float[torch.Tensor, "batch seq"], Is[lambda t: bool((t > 0).all())]]
    Small = Annotated[float, Is[lambda s: s < 5]]

    def body(x: Positive, scale: Small) -> Float[torch.Tensor, "batch seq"]:
        return x * scale

    warm = ssm.shapecheck(body)
    outcomes = []
    for sign, scale in calls:
        x = torch.full((2, 3), sign)
        outcomes.append(_verdict_of(warm, x, scale))
        assert outcomes[-1] == _verdict_of(ssm.shapecheck(body), x, scale)
