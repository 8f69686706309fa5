"""Runs on every rank of a gloo process group: checks HeadParallelAttention against the unsharded module.

`run_cases(world_size, cases)` spawns the ranks once and runs every case in them; each rank writes
what failed (and the ConfigError it saw, if any) to a JSON file that the test reads back.
"""

import datetime
import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shapesafe_mha as ssm
from shapesafe_mha.parallel import HeadParallelAttention

F64 = {"atol": 1e-10, "rtol": 1e-8}
# The module's options each case may draw: every one must be carried to the shards.
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "rope": {"rope_theta": 10.0},
    "window": {"window": 2},
    "softcap": {"logit_softcap": 0.7},
    "qk_norm": {"qk_norm": True, "norm_eps": 0.5},  # an epsilon that shows, so that copying it matters
    "qk_norm_per_head": {"qk_norm": True, "qk_norm_over": "per_head", "qk_norm_centred": True},  # Cohere's
    "scalar": {"query_pre_attn_scalar": 3.0},
    "sinks": {"attention_sinks": True},
    "clip_qkv": {"clip_qkv": 0.3},
    "output_gate": {"output_gate": True},
    "temperature_tuning": {"temperature_tuning": (2, 0.5)},
    "chunk_size": {"chunk_size": 2},
    "alibi": {"alibi": True},
}
# Options run at the sized case only, where they show: RoPE on 4 of 6 features, in interleaved pairs, YaRN-scaled.
SIZED_VARIANTS: dict[str, dict[str, Any]] = {
    "rope_partial": {
        "rope_theta": 10.0,
        "rope_dim": 4,
        "rope_interleaved": True,
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4},
    },
}


def _inputs(case: dict[str, Any]) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(case["seed"])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    b, s, d = case["batch"], case["seq"], case["d_model"]
    kv = case["kv_seq"] if case["cross"] else s
    x, memory = randn(b, s, d), randn(b, kv, d)
    mask = None
    if case["mask"] == "heads":
        mask = torch.rand(b, case["num_heads"], s, kv, generator=generator) < 0.7
    elif case["mask"] == "broadcast":  # one mask for every head: (batch, 1, seq, kv_seq)
        mask = torch.rand(b, 1, s, kv, generator=generator) < 0.7
    elif case["mask"] == "2d":
        mask = torch.rand(s, kv, generator=generator) < 0.7
    padding = None
    if case["padding"]:
        lengths = torch.randint(0, kv + 1, (b,), generator=generator)
        padding = torch.arange(kv)[None, :] >= lengths[:, None]
    probe, weights_probe = randn(b, s, d), randn(b, case["num_heads"], s, kv)
    values = randn(b, kv, d)  # a cross-attention's values, apart from its keys
    return {"x": x, "memory": memory, "values": values, "mask": mask, "padding": padding, "probe": probe,
            "weights_probe": weights_probe}  # fmt: skip


def _same_gradients(full: ssm.MultiHeadAttention, sharded: HeadParallelAttention) -> None:
    """Every parameter's gradient, gathered back from the ranks, is the unsharded module's (none: zeros)."""
    gathered = sharded.gather_gradients()
    for name, param in full.named_parameters():
        expected = torch.zeros_like(param) if param.grad is None else param.grad
        torch.testing.assert_close(gathered[name], expected, **F64, msg=lambda m, n=name: f"{n}: {m}")
    # and each rank's own rows of its KV heads hold their whole gradient (summed over the ranks sharing a replicated
    # head), so that an optimizer step on every rank keeps the copies equal
    kv_heads, d_head = sharded.shard.kv_heads, sharded.d_head
    for name in ("k_proj", "v_proj"):
        mine, whole = getattr(sharded.local, name).weight, getattr(full, name).weight
        expected = torch.zeros_like(whole) if whole.grad is None else whole.grad
        got = torch.zeros_like(mine) if mine.grad is None else mine.grad
        torch.testing.assert_close(got, expected[kv_heads.start * d_head : kv_heads.stop * d_head], **F64)


def _halves(case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """For a case with `halves`: two process groups of half the ranks each, this rank's, and the case its half runs.

    Each half gets its own weights and inputs (its seed), so a collective that leaves its group (the default
    group's sum, or a rank numbered in the wrong group) mixes in the other half's numbers and shows.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if not case.get("halves") or world == 1:
        return None, case
    half = world // 2
    groups = [dist.new_group(list(range(start, start + half))) for start in (0, half)]  # every rank makes both
    return groups[rank // half], {**case, "seed": case["seed"] + 1000 * (rank // half)}


def _check_case(case: dict[str, Any]) -> dict[str, Any]:
    group, case = _halves(case)
    torch.manual_seed(case["seed"])  # the same weights on every rank (of the group)
    full = ssm.MultiHeadAttention(
        case["d_model"],
        case["num_heads"],
        case["num_kv_heads"],
        d_head=case["d_head"],
        bias=bool(case["bias"]),
        dtype=torch.float64,
        **{**VARIANTS, **SIZED_VARIANTS}[case.get("variant", "none")],
    )
    for role in "qkvo":  # biases on the projections named in case["bias"] only
        if role not in case["bias"]:
            getattr(full, f"{role}_proj").register_parameter("bias", None)
    if full.qk_norm:  # norm weights other than ones, so that copying them matters
        with torch.no_grad():
            full.q_norm.weight.uniform_(0.5, 1.5)
            full.k_norm.weight.uniform_(0.5, 1.5)
    if full.sinks is not None:  # logits that take a share of each row, one per head, so the heads' order matters
        with torch.no_grad():
            full.sinks.copy_(torch.linspace(-2.0, 2.0, case["num_heads"], dtype=torch.float64))
    try:
        sharded = HeadParallelAttention.from_module(full, group)
    except ssm.ConfigError as error:
        return {"config_error": str(error).splitlines()[0]}
    t = _inputs(case)
    key = t["memory"] if case["cross"] else t["x"]
    value = t["values"] if case["cross"] else key
    kwargs: dict[str, Any] = {"attn_mask": t["mask"], "key_padding_mask": t["padding"]}
    if case["causal"]:  # otherwise is_causal's default
        kwargs["is_causal"] = True
    if full.rotary is not None:  # positions of our own (a left-padded batch would pass them)
        kwargs["positions"] = torch.arange(3, 3 + case["seq"]).expand(case["batch"], -1)

    # Forward, with weights.
    expected, expected_weights = full(t["x"], key, value, need_weights=True, **kwargs)
    got, got_weights = sharded(t["x"], key, value, need_weights=True, **kwargs)
    torch.testing.assert_close(got, expected, **F64)
    torch.testing.assert_close(got_weights, expected_weights, **F64)
    if case["cross"]:  # and with the values left to default to the keys
        torch.testing.assert_close(sharded(t["x"], key, **kwargs), full(t["x"], key, **kwargs), **F64)

    # Gradients of a loss on the output, then of one on the returned weights (through the gather, each rank's heads
    # get the gradient of their share): the same loss on every rank; the gradients of the inputs (a cross-attention's
    # keys and values too) and of the parameters match the unsharded ones.
    for weights_loss in (False, True):
        full.zero_grad()
        sharded.zero_grad()
        input_grads = []
        given = (t["x"], key, value) if case["cross"] else (t["x"],)
        for module in (full, sharded):
            inputs = [tensor.clone().requires_grad_() for tensor in given]
            result = module(*inputs, need_weights=weights_loss, **kwargs)
            loss = result[1] * t["weights_probe"] if weights_loss else result * t["probe"]
            loss.sum().backward()
            input_grads.append([tensor.grad for tensor in inputs])
        for got_grad, expected_grad in zip(input_grads[1], input_grads[0], strict=True):
            torch.testing.assert_close(got_grad, expected_grad, **F64)
        if not weights_loss:
            assert all(param.grad is not None for param in full.parameters())
        _same_gradients(full, sharded)

    # Prefill then token-by-token decoding with per-rank caches == the unsharded causal forward.
    with torch.no_grad():
        whole = full(t["x"], is_causal=True)
        cache = sharded.new_cache(case["batch"], max(case["seq"], full.window or 1))  # a window cache holds a window
        prefill = case["prefill"]
        pieces = [sharded(t["x"][:, :prefill], is_causal=True, kv_cache=cache)] if prefill else []
        pieces += [sharded(t["x"][:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(prefill, case["seq"])]
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, **F64)
    return {"ok": True}


def _worker(rank: int, world_size: int, store: str, cases: list[dict[str, Any]], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    results = []
    try:
        for case in cases:
            try:
                results.append(_check_case(case))
            except Exception:
                results.append({"failure": traceback.format_exc(limit=4)})
            dist.barrier()  # a failed case on one rank must not leave the others waiting in a collective
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def run_cases(world_size: int, cases: list[dict[str, Any]], timeout: float = 240.0) -> list[list[dict[str, Any]]]:
    """Spawn `world_size` ranks once, run every case on all of them, and return each rank's results."""
    with tempfile.TemporaryDirectory() as out_dir:
        store = os.path.join(out_dir, "store")
        context = mp.start_processes(
            _worker, args=(world_size, store, cases, out_dir), nprocs=world_size, join=False, start_method="spawn"
        )
        try:
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
            while not context.join(timeout=1):
                if datetime.datetime.now() > deadline:
                    raise TimeoutError(f"head-parallel ranks did not finish within {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
