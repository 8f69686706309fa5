"""MultiHeadAttention under the torch tools its users run: it calls its submodules, keeps its parameters
plain, and traces, exports, shares and trains like any well-made nn.Module."""

import copy
import datetime
import gc
import io
import itertools
import pickle
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.export import Dim, export
from torch.utils.checkpoint import checkpoint

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention

F64 = {"atol": 1e-10, "rtol": 1e-8}
KINDS = {"mha": 4, "gqa": 2, "mqa": 1}


def _module(num_kv_heads: int = 2, dtype: torch.dtype = torch.float64, **kwargs: Any) -> ssm.MultiHeadAttention:
    torch.manual_seed(0)
    return ssm.MultiHeadAttention(32, 4, num_kv_heads, dtype=dtype, **kwargs)


def _x(batch: int = 2, seq: int = 5, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(batch, seq, 32, dtype=dtype)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_peft_lora_on_q_and_v_is_used_and_equals_the_merged_module(grad: bool) -> None:
    """The usual fine-tuning setup: LoRA adapters change the output, exactly as merging them does."""
    peft = pytest.importorskip("peft")
    module, x = _module(), _x()
    with torch.no_grad():
        base = module(x)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
    adapted = peft.get_peft_model(module, config)
    with torch.set_grad_enabled(grad):
        out = adapted(x)
    assert not torch.allclose(out, base)
    merged = adapted.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(out, merged(x), **F64)


def test_forward_hooks_on_the_projections_fire_on_every_path() -> None:
    module, x = _module(num_kv_heads=4), _x()
    fired: list[str] = []
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(module, name).register_forward_hook(lambda m, i, o, name=name: fired.append(name))
    with torch.no_grad():
        module(x)  # no-grad self-attention: the path that fuses when it may
        module(x, is_causal=True, kv_cache=module.new_cache(2, 5))
    module(x, x[:, :3])
    assert fired == ["q_proj", "k_proj", "v_proj", "o_proj"] * 3


def test_a_hook_that_changes_a_projection_is_honoured() -> None:
    """A hook's result is what the module uses: doubling v's output doubles attention's output before o_proj."""
    module, x = _module(bias=False), _x()
    with torch.no_grad():
        plain = module(x)
        module.v_proj.register_forward_hook(lambda m, i, o: 2 * o)
        torch.testing.assert_close(module(x), 2 * plain, **F64)


@pytest.mark.parametrize("kind", ["mha", "latent"])
def test_every_kind_of_hook_on_the_attention_module_itself_runs_as_nn_module_runs_it(kind: str) -> None:
    """A call with no hook skips nn.Module's call machinery, so each hook torch runs must still be seen: a
    forward pre-hook (with kwargs) that rewrites the input, a forward hook that rewrites the output, a
    backward hook and the module-wide ones (tests/test_compile.py: `module.compile()`)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    torch.manual_seed(0)
    module = _module() if kind == "mha" else ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=8, d_rope=4, d_value=8)
    module = module.double()
    x = _x()
    with torch.no_grad():
        plain = module(x)
        handle = module.register_forward_pre_hook(lambda m, args, kwargs: ((2 * args[0],), kwargs), with_kwargs=True)
        torch.testing.assert_close(module(x), module.forward(2 * x), **F64)
        handle.remove()
        handle = module.register_forward_hook(lambda m, i, o: o + 1)
        torch.testing.assert_close(module(x), plain + 1, **F64)
        handle.remove()
        handle = register_module_forward_pre_hook(lambda m, i: (i[0] * 3,) if m is module else None)
        torch.testing.assert_close(module(x), module.forward(3 * x), **F64)
        handle.remove()
        handle = register_module_forward_hook(lambda m, i, o: o - 1 if m is module else None)
        torch.testing.assert_close(module(x), plain - 1, **F64)
        handle.remove()
        torch.testing.assert_close(module(x), plain, **F64)
    grads: list[torch.Tensor] = []
    module.register_full_backward_hook(lambda m, grad_in, grad_out: grads.append(grad_out[0]))
    module(x.requires_grad_()).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], torch.ones_like(plain))

@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_an_accelerate_hook_on_a_projection_runs_on_every_path(grad: bool) -> None:
    """accelerate's hooks replace a module's `forward` on the instance (no torch hook to see): the projection
    is still called, so what the hook does is what the module computes (here: doubling v_proj's output)."""
    hooks = pytest.importorskip("accelerate.hooks")  # installed with peft

    class Doubling(hooks.ModelHook):
        def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
            return 2 * output

    module, x = _module(bias=False), _x()
    with torch.no_grad():
        plain = module(x)
    hooks.add_hook_to_module(module.v_proj, Doubling())
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(module(x), 2 * plain, **F64)
        torch.testing.assert_close(module(x, is_causal=True, kv_cache=module.new_cache(2, 5)).shape, plain.shape)
    hooks.add_hook_to_module(module.o_proj, Doubling())
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(module(x), 4 * plain, **F64)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["mha", "rope", "latent"])
def test_activation_checkpointing_gives_the_gradients_of_the_plain_forward(kind: str, reentrant: bool) -> None:
    """torch.utils.checkpoint recomputes the forward in backward; the non-reentrant kind (torch's default and
    transformers') stops that recomputation early with an exception of its own, which must pass through a
    remembered call as raised, not be run again checked (it once was: an AssertionError inside torch)."""
    torch.manual_seed(0)
    if kind == "latent":
        sizes = {"kv_lora_rank": 8, "d_nope": 8, "d_rope": 4, "d_value": 8}
        module: nn.Module = ssm.LatentAttention(32, 4, dtype=torch.float64, **sizes)
    else:
        module = _module(rope_theta=10000.0 if kind == "rope" else None)
    x = _x().requires_grad_()
    module(x, is_causal=True)  # the verdict remembered: the recomputation runs unchecked
    out = checkpoint(lambda t: module(t, is_causal=True), x, use_reentrant=reentrant)
    out.pow(2).sum().backward()
    checkpointed = [p.grad.clone() for p in module.parameters() if p.grad is not None] + [x.grad.clone()]
    module.zero_grad()
    x.grad = None
    module(x, is_causal=True).pow(2).sum().backward()
    plain = [p.grad for p in module.parameters() if p.grad is not None] + [x.grad]
    assert len(checkpointed) == len(plain)
    for a, b in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("kind", ["mha", "window", "latent"])
def test_a_prompt_under_inference_mode_then_decoding_outside_it_equals_one_causal_forward(kind: str) -> None:
    """torch.inference_mode makes the cache's buffers inference tensors, which torch lets no one write in place
    outside that mode: decoding after it (under no_grad, or with grad) continues as one causal forward would."""
    torch.manual_seed(0)
    if kind == "latent":
        sizes = {"kv_lora_rank": 8, "d_nope": 8, "d_rope": 4, "d_value": 8}
        module: Any = ssm.LatentAttention(32, 4, dtype=torch.float64, **sizes)
    else:
        module = _module(rope_theta=10000.0, window=3 if kind == "window" else None)
    x = _x(seq=7)
    with torch.inference_mode():  # the cache made and filled there, as a prompt would be
        cache = module.new_cache(2, 5 if kind == "window" else 7)
        outs = [module(x[:, :4], is_causal=True, kv_cache=cache)]
    with torch.no_grad():
        outs.append(module(x[:, 4:5], is_causal=True, kv_cache=cache))
    outs += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in (5, 6)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([o.clone() for o in outs], 1), module(x, is_causal=True), **F64)


@pytest.mark.parametrize("kind", ["mha", "llama3-scaled", "latent"])
def test_a_module_made_on_meta_then_to_empty_and_loaded_equals_the_original(kind: str) -> None:
    """How large models are built: made on the meta device, `to_empty()`, then `load_state_dict`. The rotary
    frequencies are no part of the state_dict, so they are computed again on load (they were uninitialized
    memory, silently: 0.36 off), and by `reset_parameters()` after `to_empty()` alone."""
    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip

    def make() -> Any:
        if kind == "latent":
            return ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=8, d_rope=4, d_value=8, dtype=torch.float64)
        return _module(rope_theta=500000.0, rope_scaling=scaling if kind == "llama3-scaled" else None)

    original = make()
    with torch.device("meta"):
        built = make()
    built = built.to_empty(device="cpu")
    built.load_state_dict(original.state_dict())
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(built(x, is_causal=True), original(x, is_causal=True), **F64)
    with torch.device("meta"):
        empty = make()
    empty = empty.to_empty(device="cpu")
    rotary = next(m for m in empty.modules() if isinstance(m, ssm.RotaryEmbedding))
    rotary.reset_parameters()
    expected = next(m for m in original.modules() if isinstance(m, ssm.RotaryEmbedding))
    assert torch.equal(rotary.inv_freq, expected.inv_freq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_module_cast_to_half_precision_keeps_its_rope_frequencies(dtype: torch.dtype) -> None:
    """`module.to(torch.bfloat16)` casts every floating buffer, the rotary frequencies too; rounded, they put a
    cosine at position 4000 off by up to 1.97. The tables are those of float32 frequencies, in `dtype`."""
    module = _module(dtype=torch.float32, rope_theta=500000.0)
    positions = torch.tensor([[1, 100, 4000, 30000]])
    expected = module.rotary(positions, torch.float32)
    half = copy.deepcopy(module).to(dtype)
    assert half.rotary.inv_freq.dtype == dtype  # torch cast it, as it casts any buffer
    for got, want in zip(half.rotary(positions, dtype), expected, strict=True):
        torch.testing.assert_close(got, want.to(dtype))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_dynamic_quantization_stays_close_to_float(kind: str) -> None:
    """Linear layers swapped for dynamically quantized ones (whose `weight` is a method): the module runs, prefill and
    decoding, and stays near the float module (a LatentAttention once read `.weight.dtype` and failed)."""
    torch.manual_seed(0)
    module: Any = (
        _module(dtype=torch.float32)
        if kind == "mha"
        else ssm.LatentAttention(32, 4, q_lora_rank=12, kv_lora_rank=8, d_nope=4, d_rope=4, d_value=4).eval()
    )
    x = torch.randn(2, 5, 32)

    def outputs(m: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            cache = m.new_cache(2, 8)
            return [m(x, is_causal=True), m(x[:, :4], is_causal=True, kv_cache=cache), m(x[:, 4:], kv_cache=cache)]

    expected = outputs(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        quantized = torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    for out, want in zip(outputs(quantized), expected, strict=True):
        assert (out - want).abs().max() < 0.05 * want.abs().max()
        assert not torch.equal(out, want)


def test_a_parametrized_weight_is_used() -> None:
    """weight_norm on q_proj: the module computes with the parametrized weight (and its changes)."""
    module, x = _module(), _x()
    nn.utils.parametrizations.weight_norm(module.q_proj)
    with torch.no_grad():
        module.q_proj.parametrizations.weight.original0.mul_(3.0)  # pyright: ignore[reportAttributeAccessIssue]
        out = module(x)
    expected = per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(out, expected, **F64)


class _ScaledLinear(nn.Linear):
    """A user's nn.Linear subclass: its forward is not nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


def test_a_user_linear_subclass_in_a_slot_is_called() -> None:
    module, x = _module(num_kv_heads=4, bias=False), _x()
    with torch.no_grad():
        plain = module(x)
        scaled = _ScaledLinear(32, 32, bias=False, dtype=torch.float64)
        scaled.weight.copy_(module.o_proj.weight)
        module.o_proj = scaled
        torch.testing.assert_close(module(x), 0.5 * plain, **F64)


def test_share_memory_shares_every_parameter_and_keep_vars_returns_them() -> None:
    module = _module()
    module.share_memory()
    assert all(p.is_shared() for p in module.parameters())
    state = module.state_dict(keep_vars=True)
    params = dict(module.named_parameters())
    assert state.keys() == params.keys()
    assert all(state[name] is param for name, param in params.items())
    with torch.no_grad():
        module(_x())  # the fused path's weight is a cache: the parameters stay the shared ones
    assert all(p.is_shared() for p in module.parameters())


def test_state_dict_deepcopy_pickle_and_optimizer_see_plain_parameters() -> None:
    module, x = _module(), _x()
    with torch.no_grad():
        before = module(x)
    state = module.state_dict()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in state.values())
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no two overlap
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module)), loaded):
        with torch.no_grad():
            torch.testing.assert_close(other(x), before, **F64)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        after = module(x)  # no-grad: the fused weight must notice the step
    torch.testing.assert_close(after, per_head_attention(x, x, x, module.weights(), num_heads=4, num_kv_heads=2), **F64)


def test_a_copy_carries_nothing_remembered_and_checks_its_first_call() -> None:
    """Verdicts and the fused Q/K/V weight belong to the module they were made on: a warm module pickles to the
    bytes of a cold one, and its deepcopy and its unpickled copy each check their first call."""
    from unittest import mock

    module, x = _module(), _x()
    cold = pickle.dumps(module)
    with torch.no_grad():
        module(x)  # a verdict, and the fused weight of the no-grad path
    assert module._fused is not None and len(pickle.dumps(module)) == len(cold)
    with mock.patch.object(ssm.MultiHeadAttention, "_checked", autospec=True, side_effect=module._checked.__func__):
        checked = ssm.MultiHeadAttention._checked
        for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
            with torch.no_grad():
                other(x)
        assert checked.call_count == 2  # pyright: ignore[reportAttributeAccessIssue]


def test_apply_without_recursion_converts_the_module_own_tensors_only() -> None:
    """`_apply(fn, recurse=False)` is nn.Module's conversion of a module's own parameters and buffers: the sinks
    and ALiBi slopes become float64, the projections stay float32, and calls after it are checked again."""
    module = ssm.MultiHeadAttention(32, 4, attention_sinks=True, alibi=True)
    module(_x(dtype=torch.float32))
    module._apply(lambda t: t.double(), recurse=False)
    assert module.sinks is not None and module.alibi_slopes is not None
    assert (module.sinks.dtype, module.alibi_slopes.dtype) == (torch.float64, torch.float64)
    assert {p.dtype for name, p in module.named_parameters() if "proj" in name} == {torch.float32}
    assert len(module._verdicts.exact) == 0


# torch.jit.trace is exercised on purpose: its deprecation, a DeprecationWarning up to torch 2.13 and a
# FutureWarning since 2.14, is expected here and nowhere else.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.trace(_method)?` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.trace(_method)?` is deprecated:FutureWarning")
@pytest.mark.parametrize("traced_grad", [False, True], ids=["traced_no_grad", "traced_grad"])
def test_jit_trace_gives_a_graph_right_in_both_grad_modes(traced_grad: bool) -> None:
    module, x = _module(), _x()
    with torch.set_grad_enabled(traced_grad):
        traced = torch.jit.trace(module, (x,))
    y = _x()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(traced(y), module(y), **F64)
    with torch.no_grad():
        module.q_proj.weight.add_(1.0)  # the weights are parameters of the graph, not constants
        torch.testing.assert_close(traced(y), module(y), **F64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_export_with_dynamic_batch_and_seq_equals_eager_at_other_sizes(kind: str, causal: bool) -> None:
    module = _module(num_kv_heads=KINDS[kind], dtype=torch.float32).eval()
    shapes = {"query": {0: Dim("batch"), 1: Dim("seq")}, "is_causal": None}
    program = export(module, (_x(2, 6, torch.float32),), kwargs={"is_causal": causal}, dynamic_shapes=shapes)
    for batch, seq in ((3, 11), (1, 2), (5, 33)):
        y = _x(batch, seq, torch.float32)
        torch.testing.assert_close(program.module()(y, is_causal=causal), module(y, is_causal=causal))


@pytest.mark.parametrize("kind", KINDS)
def test_a_kv_cache_under_autograd_gives_the_outputs_and_gradients_of_one_causal_forward(kind: str) -> None:
    module = _module(num_kv_heads=KINDS[kind])
    x = _x(2, 7).requires_grad_()
    full = module(x, is_causal=True)
    expected = torch.autograd.grad(full.square().sum(), [x, *module.parameters()])
    cache = module.new_cache(2, 7)
    steps = [module(x[:, :3], is_causal=True, kv_cache=cache)]
    steps += [module(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(3, 7)]
    out = torch.cat(steps, dim=1)
    torch.testing.assert_close(out, full, **F64)
    got = torch.autograd.grad(out.square().sum(), [x, *module.parameters()])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **F64)
    cache.reset()
    assert cache.keys_buffer.grad_fn is None and cache.values_buffer.grad_fn is None
    assert len(cache) == 0


def _ddp_rank(rank: int, world: int, path: str, store: str) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: nothing to collide with other runs on the machine.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        module = _module()
        ddp = nn.parallel.DistributedDataParallel(module)
        torch.manual_seed(1)
        x = _x(4, 5)
        shard = x.chunk(world)[rank]
        # Each rank's loss is its share of the mean over the whole batch: DDP averages gradients.
        ddp(shard, is_causal=True).square().mean().backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in module.named_parameters()}, path)
        # DDP's reducer holds the process group: left alive, it outlives destroy_process_group and the
        # group is torn down again at interpreter exit, where gloo can abort the process (seen once in CI
        # on torch 2.14, "terminate called without an active exception"). Free it first, and prove it.
        reducer_owner = weakref.ref(ddp)
        del ddp
        gc.collect()
        assert reducer_owner() is None, "the DistributedDataParallel wrapper outlived its own name"
        dist.barrier()  # neither rank tears gloo down while the other still uses it (that aborts the process)
    finally:
        dist.destroy_process_group()


def test_distributed_data_parallel_over_gloo_gives_the_gradients_of_one_process() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, store = str(Path(tmp) / "grads.pt"), str(Path(tmp) / "store")
        mp.start_processes(_ddp_rank, args=(2, path, store), nprocs=2, join=True, start_method="spawn")
        got = torch.load(path)
    module = _module()
    torch.manual_seed(1)
    x = _x(4, 5)
    module(x, is_causal=True).square().mean().backward()
    for name, param in module.named_parameters():
        torch.testing.assert_close(got[name], param.grad, **F64)
