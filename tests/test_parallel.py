"""Head-parallel attention on real gloo process groups equals the unsharded module: outputs, gradients, decoding."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from parallel_worker import VARIANTS, run_cases

import shapesafe_mha as ssm
from shapesafe_mha.parallel import plan_heads, working_world_sizes

# Configs every run includes: sharded KV, replicated KV, MQA, and ones that cannot be split.
PINNED = [(8, 8), (8, 4), (8, 2), (4, 1), (6, 3), (12, 3)]  # (num_heads, num_kv_heads)


@st.composite
def cases(draw: st.DrawFn, heads: tuple[int, int] | None = None) -> dict[str, object]:
    """One case: a config (heads drawn so that many split over 2 and 4 ranks), inputs and options."""
    if heads is None:
        num_kv_heads = draw(st.sampled_from([1, 2, 3, 4]))
        heads = (num_kv_heads * draw(st.sampled_from([1, 2, 3, 4])), num_kv_heads)
    seq = draw(st.integers(1, 5))
    variant = draw(st.sampled_from(sorted(VARIANTS)))
    d_head = draw(st.integers(1, 4))
    if variant == "rope":
        d_head = 2 * ((d_head + 1) // 2)  # RoPE rotates pairs
    return {
        "num_heads": heads[0],
        "num_kv_heads": heads[1],
        "batch": draw(st.integers(1, 2)),
        "seq": seq,
        "kv_seq": draw(st.integers(1, 5)),
        "d_model": draw(st.integers(4, 16)),
        "d_head": d_head,
        "bias": draw(st.sampled_from(["qkvo", "", "q", "v", "qkv", "o"])),  # which projections have one
        "variant": variant,
        "cross": variant == "none" and draw(st.booleans()),  # the variants are self-attention layers
        "causal": draw(st.booleans()),
        "mask": draw(st.sampled_from(["none", "2d", "heads"])),
        "padding": draw(st.booleans()),
        "prefill": draw(st.integers(0, seq)),
        "seed": draw(st.integers(0, 2**16)),
    }


def draw_cases(strategy: st.SearchStrategy[dict[str, object]], count: int) -> list[dict[str, object]]:
    """`count` hypothesis-drawn cases, collected in this process so that the ranks are spawned only once."""
    drawn: list[dict[str, object]] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: dict[str, object]) -> None:
        drawn.append(case)

    collect()
    return drawn


def all_cases() -> list[dict[str, object]]:
    pinned = [case for heads in PINNED for case in draw_cases(cases(heads), 3)]
    # every option once at sizes where it shows, with KV heads replicated over 4 ranks (8/2), where shared
    # gradients are summed (hypothesis's first draw is the smallest case: d_head 1, one position)
    sized = {"num_heads": 8, "num_kv_heads": 2, "batch": 2, "seq": 4, "kv_seq": 4, "d_model": 12, "d_head": 4,
             "bias": "qkv", "cross": False, "causal": True, "mask": "heads", "padding": True, "prefill": 2}  # fmt: skip
    each = [{**sized, "variant": variant, "seed": seed} for seed, variant in enumerate(VARIANTS)]
    each.append({**sized, "variant": "rope_partial", "d_head": 6, "seed": len(each)})
    # MQA with each head's own norm weights: the one KV head's k_norm row is shared by every rank (up to 4)
    each.append({**sized, "variant": "qk_norm_per_head", "num_heads": 4, "num_kv_heads": 1, "seed": len(each)})
    # a 4-D mask of one head, broadcast over every head: each rank passes it whole (there are no heads to slice)
    each.append({**sized, "variant": "none", "mask": "broadcast", "seed": 42})
    cross = {**sized, "variant": "none", "cross": True, "kv_seq": 3, "causal": False, "seed": 39}
    # a group of half the ranks, each half its own module: every collective stays in the group it was given
    halves = [{**sized, "variant": v, "seed": 40, "halves": True} for v in ("qk_norm", "qk_norm_per_head", "sinks")]
    halves.append({**halves[1], "num_heads": 4, "num_kv_heads": 1})  # a KV head replicated in each half, twice:
    halves.append({**halves[-1], "seed": 41})  # subgroups of sharers built there hung the second time
    halves.append({**cross, "halves": True})  # keys and values each summed in their own group's backward
    return [*pinned, *each, cross, *halves, *draw_cases(cases(), 24)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_equals_unsharded_on_every_rank(world_size: int) -> None:
    """World sizes 1, 2, 4; MHA, GQA (sharded and replicated KV), MQA; masks (2-D, per head, one broadcast over the
    heads), padding, causal, cross-attention.

    Forward, per-head weights, input and parameter gradients (gathered back, and each rank's own KV rows) of a
    loss on the output and of one on the returned weights, and prefill-then-decode with per-rank caches all equal
    the unsharded float64 module on every rank, also where the module is split over a group of half the ranks
    (each half its own weights and inputs, beside the other half); configs that cannot be split raise the same
    ConfigError on every rank, and no rank hangs (one spawn runs every case).
    """
    case_list = all_cases()
    results = run_cases(world_size, case_list)
    checked = 0
    for index, case in enumerate(case_list):
        per_rank = [rank_results[index] for rank_results in results]
        try:
            plan_heads(case["num_heads"], case["num_kv_heads"], world_size, 0)  # type: ignore[arg-type]
            shardable = True
        except ssm.ConfigError:
            shardable = False
        for rank, result in enumerate(per_rank):
            assert "failure" not in result, f"rank {rank}, case {case}:\n{result.get('failure')}"
            assert ("config_error" not in result) == shardable, (rank, case, result)
        checked += shardable
        if not shardable:
            messages = {r["config_error"] for r in per_rank}
            assert len(messages) == 1, messages
            message = messages.pop()
            assert f"world_size={world_size}" in message and f"num_heads={case['num_heads']}" in message
            assert str(working_world_sizes(case["num_heads"], case["num_kv_heads"])) in message  # type: ignore[arg-type]
    assert checked >= 12, f"only {checked} shardable cases for world_size={world_size}"


def test_plan_places_kv_heads_with_their_query_groups() -> None:
    """Every query head's KV head is on the same rank, for every world size that works."""
    for num_heads, num_kv_heads in [(8, 8), (8, 4), (8, 2), (8, 1), (12, 3), (32, 8)]:
        group = num_heads // num_kv_heads
        for world in working_world_sizes(num_heads, num_kv_heads):
            covered = []
            for rank in range(world):
                shard = plan_heads(num_heads, num_kv_heads, world, rank)
                covered += list(shard.q_heads)
                assert all(h // group in shard.kv_heads for h in shard.q_heads)
                assert rank in shard.kv_sharers
            assert covered == list(range(num_heads))


def test_unshardable_config_names_the_sizes_and_what_works() -> None:
    """The ConfigError names num_heads, num_kv_heads and the world size, and lists world sizes that work."""
    with pytest.raises(
        ssm.ConfigError, match=r"num_heads=6, num_kv_heads=3 cannot be split over world_size=4.*\[1, 3, 6\]"
    ):
        plan_heads(6, 3, 4, 0)


def test_from_module_needs_an_initialised_process_group() -> None:
    """Without torch.distributed initialised: a ConfigError that names the call and says what to call first."""
    from shapesafe_mha.parallel import HeadParallelAttention

    refusal = (
        r"HeadParallelAttention\.from_module\(\): torch\.distributed is not initialised; call "
        r"torch\.distributed\.init_process_group first \(torchrun sets the environment for it\)\.$"
    )
    with pytest.raises(ssm.ConfigError, match=refusal):
        HeadParallelAttention.from_module(ssm.MultiHeadAttention(16, 4))


@pytest.mark.slow
def test_the_documented_torchrun_example_runs() -> None:
    """`torchrun --standalone --nproc-per-node 2 examples/head_parallel.py` runs and every rank agrees."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--standalone", "--nproc-per-node", "2", str(root / "examples" / "head_parallel.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 0/2: query heads [0, 1, 2, 3], KV heads [0]: equal" in result.stdout
    assert "rank 1/2: query heads [4, 5, 6, 7], KV heads [1]: equal" in result.stdout


def test_from_module_refuses_shards_that_compute_something_else(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A sharding that drops an option (here the window) is caught by the probe, on a real gloo group; verify=False
    skips the probe (the sharding is returned as it is)."""
    import torch
    import torch.distributed as dist

    from shapesafe_mha._modules import parallel as _parallel
    from shapesafe_mha.parallel import HeadParallelAttention

    honest = _parallel._local_share

    def forgets_the_window(module, shard):  # type: ignore[no-untyped-def]
        local, bias = honest(module, shard)
        local.window = None
        return local, bias

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        full = ssm.MultiHeadAttention(16, 4, 2, window=2, dtype=torch.float64)
        HeadParallelAttention.from_module(full)  # the honest sharding verifies
        monkeypatch.setattr(_parallel, "_local_share", forgets_the_window)
        differs = r"^HeadParallelAttention\.from_module\(\): the converted layer differs from the unsharded module"
        with pytest.raises(ssm.ConfigError, match=differs):
            HeadParallelAttention.from_module(full)
        assert HeadParallelAttention.from_module(full, verify=False).local.window is None
    finally:
        dist.destroy_process_group()


def test_from_module_keeps_the_shards_on_the_modules_device(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A module on another device than the default (here `meta`, as built before loading weights) is split into
    shards on that device, the output bias too; its dropout (random, so no probe compares it) is carried."""
    import torch
    import torch.distributed as dist

    from shapesafe_mha.parallel import HeadParallelAttention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = HeadParallelAttention.from_module(ssm.MultiHeadAttention(16, 4, 2, dropout=0.25, device="meta"))
        assert {param.device for param in sharded.parameters()} == {torch.device("meta")}
        assert sharded.local.dropout == 0.25
    finally:
        dist.destroy_process_group()


def test_a_qk_norm_over_every_head_is_refused_by_from_module(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """qk_norm_over='all' (OLMo-2) and differential attention's head pairs (DiffLlama) cannot be split by heads:
    from_module refuses each, naming it."""
    import torch.distributed as dist

    from shapesafe_mha.parallel import HeadParallelAttention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ssm.ConfigError, match=r"^HeadParallelAttention\.from_module\(\): qk_norm_over='all' "):
            HeadParallelAttention.from_module(ssm.MultiHeadAttention(16, 4, 2, qk_norm=True, qk_norm_over="all"))
        with pytest.raises(ssm.ConfigError, match=r"^HeadParallelAttention\.from_module\(\): differential attention"):
            HeadParallelAttention.from_module(ssm.MultiHeadAttention(16, 4, 2, differential_lambda_init=0.2))
    finally:
        dist.destroy_process_group()


def test_gradients_gathered_before_any_backward_are_zeros(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """gather_gradients() before any backward: every parameter of the unsharded module, each zeros of its shape."""
    import torch
    import torch.distributed as dist

    from shapesafe_mha.parallel import HeadParallelAttention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for over in ("head", "per_head"):
            full = ssm.MultiHeadAttention(16, 4, 2, qk_norm=True, qk_norm_over=over, attention_sinks=True)
            gathered = HeadParallelAttention.from_module(full).gather_gradients()
            assert set(gathered) == {name for name, _ in full.named_parameters()}
            for name, param in full.named_parameters():
                assert torch.equal(gathered[name], torch.zeros_like(param)), name
    finally:
        dist.destroy_process_group()


def test_a_mask_with_another_number_of_heads_is_refused_by_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A mask whose heads axis is neither the module's num_heads nor 1 is refused before it is sliced to the rank's
    heads (a slice would hide the mismatch), with both numbers."""
    import torch
    import torch.distributed as dist

    from shapesafe_mha.parallel import HeadParallelAttention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = HeadParallelAttention.from_module(ssm.MultiHeadAttention(16, 4, 2))
        mask = torch.ones(2, 3, 5, 5, dtype=torch.bool)
        refusal = r"attn_mask has num_heads=3 \(axis 1\), but the module has num_heads=4 \(or 1, to broadcast\)\.$"
        with pytest.raises(ssm.ShapeError, match=refusal):
            sharded(torch.randn(2, 5, 16), attn_mask=mask)
    finally:
        dist.destroy_process_group()


def test_an_option_set_on_a_head_parallel_module_is_its_shards_and_a_size_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Set on the built module, an option is the shard's (followed as `MultiHeadAttention` follows it: the output
    equals a module built with it, split again), and a size, which split the heads, is refused by name. Neither is
    kept as a plain attribute the forward never reads."""
    import torch
    import torch.distributed as dist

    from shapesafe_mha.parallel import HeadParallelAttention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = ssm.MultiHeadAttention(16, 4, 2).eval()
        sharded = HeadParallelAttention.from_module(module).eval()
        x = torch.randn(2, 5, 16)
        for name, value in (("window", 2), ("logit_softcap", 1.0)):
            setattr(sharded, name, value)
            setattr(module, name, value)
            assert getattr(sharded, name) == getattr(sharded.local, name) == value and name not in sharded.__dict__
        with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention: scale cannot be set: it is derived from"):
            sharded.scale = 0.01  # the shard's, refused there (as a plain attribute it was read by nothing)
        sharded.num_heads = 4  # the value it has: nothing to refuse
        with torch.no_grad():
            torch.testing.assert_close(sharded(x, is_causal=True), module(x, is_causal=True))
        with pytest.raises(ssm.ConfigError, match=r"^MultiHeadAttention: rope_theta cannot be set on a built module"):
            sharded.rope_theta = 10000.0
        with pytest.raises(ssm.ConfigError, match=r"^HeadParallelAttention: num_heads cannot be set on a built one"):
            sharded.num_heads = 8
        assert sharded.num_heads == 4
    finally:
        dist.destroy_process_group()
