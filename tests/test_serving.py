"""Serving shapes: a packed batch computes each sequence as if alone; a paged cache computes what a KVCache does."""

import inspect
import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute.paged import _Decoding
from shapesafe_mha._modules import latent, plan
from shapesafe_mha.reference import packed_per_head_attention

F64 = {"atol": 1e-10, "rtol": 1e-8}


@st.composite
def serving_modules(draw: st.DrawFn, *, variants: bool = True) -> ssm.MultiHeadAttention:
    """A float64 module with MHA, GQA or MQA by construction, and the variants a packed batch must keep per
    sequence: RoPE (positions restart), a sliding window, softcapping, sinks, QK-norm, ALiBi (distances within a
    sequence), Llama 4's temperature tuning (each query's scale from its own cache index)."""
    num_kv_heads = draw(st.sampled_from([1, 2]), label="num_kv_heads")
    group = draw(st.integers(1, 3), label="group")
    d_head = draw(st.sampled_from([2, 4]), label="d_head")
    options = {
        "rope_theta": draw(st.sampled_from([None, 10000.0]), label="rope"),
        "window": draw(st.none() | st.integers(1, 5), label="window"),
    }
    if variants:
        options |= {
            "logit_softcap": draw(st.sampled_from([None, 2.0]), label="softcap"),
            "attention_sinks": draw(st.booleans(), label="sinks"),
            "qk_norm": draw(st.booleans(), label="qk_norm"),
            "alibi": draw(st.booleans(), label="alibi"),
            "temperature_tuning": draw(st.sampled_from([None, (2, 0.5)]), label="temperature_tuning"),
        }
    torch.manual_seed(draw(st.integers(0, 2**16), label="seed"))
    module = ssm.MultiHeadAttention(
        draw(st.integers(4, 12), label="d_model"),
        num_kv_heads * group,
        num_kv_heads,
        d_head=d_head,
        dtype=torch.float64,
        **options,  # pyright: ignore[reportArgumentType]
    )
    with torch.no_grad():  # learned values, not their neutral initial ones
        for name in ("sinks",):
            parameter = getattr(module, name, None)
            if parameter is not None:
                parameter.normal_()
        if module.qk_norm:
            module.q_norm.weight.uniform_(0.5, 1.5)
            module.k_norm.weight.uniform_(0.5, 1.5)
    return module


def _packed(lengths: list[int], d_model: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(1, sum(lengths), d_model, dtype=torch.float64), cu


@given(
    module=serving_modules(),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    causal=st.booleans(),
    data=st.data(),
)
def test_packed_equals_each_sequence_alone(
    module: ssm.MultiHeadAttention, lengths: list[int], causal: bool, data: st.DataObject
) -> None:
    """Packed == each sequence through the module alone == the packed per-head reference (RoPE positions restart,
    windows, softcap, sinks, QK-norm, ALiBi, temperature tuning, GQA/MQA, empty sequences); with positions given
    (any, gaps included), each sequence alone with its own."""
    x, cu = _packed(lengths, module.d_model)
    out = module(x, cu_seqlens=cu, is_causal=causal)
    bounds = cu.tolist()
    alone = [module(x[:, a:b], is_causal=causal) for a, b in itertools.pairwise(bounds) if b > a]
    assert out.shape == x.shape
    if alone:
        torch.testing.assert_close(out, torch.cat(alone, dim=1), **F64)
    if module.rotary is not None and sum(lengths):
        given = data.draw(st.lists(st.integers(0, 40), min_size=sum(lengths), max_size=sum(lengths)), label="positions")
        positions = torch.tensor([given])
        positioned = module(x, cu_seqlens=cu, is_causal=causal, positions=positions)
        alone = [
            module(x[:, a:b], is_causal=causal, positions=positions[:, a:b])
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        torch.testing.assert_close(positioned, torch.cat(alone, dim=1), **F64)
    norms = (module.q_norm.weight, module.k_norm.weight) if module.qk_norm else None
    tensors = {"sinks": module.sinks, "qk_norm": norms}  # every option the reference reads from the config
    reference = packed_per_head_attention(x, cu, module.weights(), config=module.config, is_causal=causal, **tensors)
    torch.testing.assert_close(out, reference, **F64)


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[list[int], list[int], dict[int, int]]]:
    """Steps of continuous batching: who joins (prompt lengths), who leaves (indices among the live), and how many
    new tokens each live sequence brings (a prompt, a chunk, one token, or none this step)."""
    steps, live = [], 0
    for _ in range(draw(st.integers(1, 6), label="steps")):
        joining = draw(st.lists(st.integers(1, 6), max_size=2 if live < 3 else 0), label="joining")
        leaving = sorted(set(draw(st.lists(st.integers(0, max(live - 1, 0)), max_size=1 if live > 1 else 0))))
        live += len(joining) - len(leaving)
        if live == 0:
            joining, live = [*joining, 1], live + 1
        sizes = {i: draw(st.sampled_from([1, 1, 1, 0, 2, 3]), label="new") for i in range(live - len(joining))}
        steps.append((joining, leaving, sizes))
    return steps


@given(
    module=serving_modules(),
    block_size=st.integers(1, 16),
    schedule=schedules(),
    data=st.data(),
)
def test_paged_equals_a_kv_cache_per_sequence(
    module: ssm.MultiHeadAttention, block_size: int, schedule: list, data: st.DataObject
) -> None:
    """Every step of a paged cache (prefill, chunks, decoding, sequences joining and leaving, shuffled free blocks,
    windows freeing blocks; then decoding steps after whatever came before) == each sequence decoded through its own
    contiguous KVCache."""
    cache = ssm.PagedKVCache.for_module(module, num_blocks=64, block_size=block_size)
    cache._free = data.draw(st.permutations(range(64)), label="free list")  # fragmented, shuffled tables
    live: list[tuple[int, ssm.KVCache]] = []  # (paged id, its own contiguous cache)
    # then: every live sequence decodes, one brings a chunk of another size, and every one decodes again (buffers a
    # decoding step keeps must not outlive lengths that moved unequally)
    decode, uneven = ([], [], dict.fromkeys(range(64), 1)), ([], [], {i: 1 + i % 2 for i in range(64)})
    tail = [decode, uneven, decode, decode]
    for step, (joining, leaving, sizes) in enumerate([*schedule, *tail]):
        forced = step >= len(schedule) and sizes is decode[2]
        for index in reversed(leaving):
            seq, _ = live.pop(index)
            cache.remove(seq)
        old = len(live)
        live += [(cache.add(), module.new_cache(1, 64)) for _ in joining]
        news = [sizes.get(i, 0) for i in range(old)] + joining
        x, cu = _packed(news, module.d_model)
        if all(n == 1 for n in news) and (forced or data.draw(st.booleans(), label="decode form")):
            out = module(x[0][:, None], is_causal=True, kv_cache=cache)[:, 0][None]
        else:
            out = module(x, cu_seqlens=cu, is_causal=True, kv_cache=cache)
        bounds = cu.tolist()
        for (seq, contiguous), a, b in zip(live, bounds[:-1], bounds[1:], strict=True):
            if b > a:
                torch.testing.assert_close(out[:, a:b], module(x[:, a:b], is_causal=True, kv_cache=contiguous), **F64)
            assert cache.length(seq) == len(contiguous)
    if module.window is not None:  # blocks no query can see any more went back to the free list
        held = sum(1 for row in cache.block_table().tolist() for block in row if block >= 0)
        bound = sum(math.ceil((module.window - 1) / block_size) + 1 for _ in live)
        assert held <= bound


_ROOM = inspect.signature(_Decoding.aligned).parameters["room"].default  # steps a decoding map's buffers serve


@pytest.mark.parametrize("steps", [_ROOM + 1, 2 * _ROOM + 1])
@pytest.mark.parametrize("block_size", [1, 2 * _ROOM])
@pytest.mark.parametrize("rope_theta", [None, 10000.0])
def test_any_number_of_decoding_steps_equals_a_kv_cache_per_sequence(
    rope_theta: float | None, block_size: int, steps: int
) -> None:
    """Batched decoding steps one after another, as many as a server makes (up to and past the steps that the slot
    map's buffers of positions and padding serve before they are made again), == each sequence decoded through its
    own contiguous KVCache: every step's output, and its length. (A block of many positions: a map made again only
    when a block is appended past its width would hide the steps its buffers serve.)"""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(8, 4, 2, rope_theta=rope_theta, dtype=torch.float64)
    cache = ssm.PagedKVCache.for_module(module, num_blocks=3 * (2 * _ROOM + 6) // block_size + 6, block_size=block_size)
    prompts = [3, 1, 5]
    live = [(cache.add(), module.new_cache(1, max(prompts) + steps)) for _ in prompts]
    x, cu = _packed(prompts, module.d_model)
    module(x, cu_seqlens=cu, is_causal=True, kv_cache=cache)
    for (_, contiguous), a, b in zip(live, cu.tolist()[:-1], cu.tolist()[1:], strict=True):
        module(x[:, a:b], is_causal=True, kv_cache=contiguous)
    for _ in range(steps):
        new = torch.randn(len(prompts), 1, module.d_model, dtype=torch.float64)
        out = module(new, is_causal=True, kv_cache=cache)
        for i, (seq, contiguous) in enumerate(live):
            torch.testing.assert_close(
                out[i : i + 1], module(new[i : i + 1], is_causal=True, kv_cache=contiguous), **F64
            )
            assert cache.length(seq) == len(contiguous)


def _two_sequences(
    block_size: int = 2, num_blocks: int = 8
) -> tuple[ssm.MultiHeadAttention, ssm.PagedKVCache, int, int]:
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(8, 2, 1, rope_theta=10000.0, dtype=torch.float64)
    cache = ssm.PagedKVCache.for_module(module, num_blocks=num_blocks, block_size=block_size)
    a, b = cache.add(), cache.add()
    with torch.no_grad():  # (serving: the pools are written in place)
        for _ in range(3):  # interleaved: each sequence's next block is the other's
            module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
    return module, cache, a, b


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 3, 5], r"cu_seqlens\[0\] is 1, but a packed batch's first sequence starts at 0"),
        ([0, 4, 2, 5], r"cu_seqlens\[2\]=2 is less than cu_seqlens\[1\]=4, so sequence 1 would hold -2 tokens"),
        ([0, 2, 4], r"cu_seqlens\[2\] \(the end\) is 4, but query holds total=5"),
    ],
)
def test_bad_cu_seqlens_is_a_shape_error_naming_the_index(offsets: list[int], match: str) -> None:
    module = ssm.MultiHeadAttention(8, 2)
    with pytest.raises(ssm.ShapeError, match=match):
        module(torch.randn(1, 5, 8), cu_seqlens=torch.tensor(offsets, dtype=torch.int32), is_causal=True)


def test_cu_seqlens_must_be_integer_offsets_and_the_batch_packed() -> None:
    module = ssm.MultiHeadAttention(8, 2)
    with pytest.raises(ssm.ShapeError, match="cu_seqlens must be a 1-D int32"):
        module(torch.randn(1, 5, 8), cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ssm.ShapeError, match="batch=2, but with cu_seqlens it is a packed batch"):
        module(torch.randn(2, 5, 8), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ssm.ConfigError, match="takes no attn_mask or key_padding_mask"):
        module(
            torch.randn(1, 5, 8), cu_seqlens=torch.tensor([0, 5]), key_padding_mask=torch.zeros(1, 5, dtype=torch.bool)
        )
    with pytest.raises(ssm.ConfigError, match="caches into a PagedKVCache"):
        module(torch.randn(1, 5, 8), cu_seqlens=torch.tensor([0, 5]), kv_cache=module.new_cache(1, 8))


def _snapshot(cache: ssm.PagedKVCache) -> tuple:
    """All a paged cache's bookkeeping: the tables, lengths, free list (in its order) and which sequence owns each
    block (what its checks read: a block given back but still owned would let a bad table read it)."""
    tables = cache.block_table().tolist()
    return tables, [cache.length(s) for s in cache.sequences], list(cache._free), dict(cache._owner_of)


@pytest.mark.parametrize(
    ("where", "match"), [("outside", "outside the pool of num_blocks=8"), ("stolen", "belongs to sequence")]
)
def test_a_bad_block_table_is_a_shape_error_and_changes_nothing(where: str, match: str) -> None:
    """A block table pointing outside the pool or at another sequence's block is refused before any gather."""
    module, cache, a, b = _two_sequences()
    cache._tables[a][0] = 99 if where == "outside" else cache._tables[b][0]  # corrupted, as a scheduler bug would
    before = _snapshot(cache)
    with pytest.raises(ssm.ShapeError, match=f"block table of sequence {a} points at block .*{match}"):
        module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
    assert _snapshot(cache) == before


def test_a_full_pool_is_a_shape_error_and_changes_nothing() -> None:
    module, cache, _, _ = _two_sequences()
    before = _snapshot(cache)
    with pytest.raises(ssm.ShapeError, match="need 6 more blocks of block_size=2, but the PagedKVCache has 4 free"):
        module(torch.randn(1, 12, 8, dtype=torch.float64), cu_seqlens=torch.tensor([0, 6, 12]), kv_cache=cache)
    assert _snapshot(cache) == before


@pytest.mark.parametrize("form", ["decoding", "chunks"])
def test_a_planted_off_by_one_block_is_caught_and_named(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """A paged layer that reads the block after the right one (the bug a block table off by one makes) is a
    ShapeError naming the sequence and the block, not another sequence's keys silently attended."""
    module, cache, a, _ = _two_sequences()
    right = ssm.PagedKVCache.locate

    def off_by_one(self: ssm.PagedKVCache, tables: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return right(self, tables, where) + self.block_size  # the next block of the pool

    monkeypatch.setattr(ssm.PagedKVCache, "locate", off_by_one)
    before = _snapshot(cache)
    with pytest.raises(ssm.ShapeError, match=f"block table of sequence {a} points at block [0-9]+, which belongs to"):
        if form == "decoding":
            module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
        else:
            module(torch.randn(1, 4, 8, dtype=torch.float64), cu_seqlens=torch.tensor([0, 2, 4]), kv_cache=cache)
    assert _snapshot(cache) == before


@pytest.mark.parametrize("failure", ["bad table", "after the write"])
def test_a_failed_decoding_step_gives_back_the_blocks_it_took(monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """A decoding step whose sequences are at their blocks' ends takes a new block for each; when the step fails
    (a block table found bad after the blocks were taken, or a failure after the keys were written) it gives them
    back: tables, lengths and the free list, in its order, are as they were, and the next step runs."""
    module, cache, a, b = _two_sequences(num_blocks=16)
    with torch.no_grad():
        module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)  # (lengths 4: blocks full)
    if failure == "bad table":
        cache._tables[b][0] = cache._tables[a][0]  # (b's table is read after both sequences took their new block)
    else:
        write = cache.write_decoded

        def failing(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            write(slots, k, v)
            raise RuntimeError("planted after the write")

        monkeypatch.setattr(cache, "write_decoded", failing)
    before, free = _snapshot(cache), list(cache._free)
    with torch.no_grad(), pytest.raises((ssm.ShapeError, RuntimeError), match=r"belongs to sequence|planted"):
        module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
    assert _snapshot(cache) == before and cache._free == free
    if failure == "after the write":
        monkeypatch.undo()
        with torch.no_grad():
            module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
        assert [cache.length(seq) for seq in cache.sequences] == [5, 5] and cache.free_blocks == len(free) - 2


def test_decoding_a_paged_cache_copies_no_pool() -> None:
    """A decoding step writes in place and gathers only the keys it attends to: the pools are never reallocated,
    and no tensor as large as a pool is made."""
    module, cache, _, _ = _two_sequences(block_size=4, num_blocks=256)
    pointers = cache.keys_pool.data_ptr(), cache.values_pool.data_ptr()
    made: list[int] = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    made.append(tensor.untyped_storage().nbytes())
            return out

    with torch.no_grad(), Sizes():
        module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
    assert (cache.keys_pool.data_ptr(), cache.values_pool.data_ptr()) == pointers
    pool = cache.keys_pool.untyped_storage().nbytes()
    assert max(size for size in made if size != pool) < pool // 16  # (views of the pool share its storage)


def test_sequences_join_and_leave() -> None:
    module, cache, a, b = _two_sequences()
    assert cache.sequences == (a, b)
    free = cache.free_blocks
    cache.remove(a)
    assert cache.sequences == (b,) and cache.free_blocks == free + 2
    with pytest.raises(ssm.ConfigError, match="is not a live sequence"):
        cache.remove(a)
    with pytest.raises(ssm.ShapeError, match=r"decodes one new token of each of its 1 live sequences"):
        module(torch.randn(2, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)


@pytest.mark.parametrize("window", [3, None])
def test_gradients_through_paged_steps_equal_a_kv_caches(window: int | None) -> None:
    """Under autograd the pools are written out of place (as KVCache's buffers are): a prefill and two decoding
    steps backpropagate, and the gradients are the contiguous cache's (with a window and without: the two decoding
    routes)."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(8, 4, 2, rope_theta=10000.0, window=window, dtype=torch.float64)
    x = torch.randn(1, 7, 8, dtype=torch.float64)
    paged = ssm.PagedKVCache.for_module(module, num_blocks=16, block_size=2)
    paged.add(), paged.add()
    caches = [module.new_cache(1, 16), module.new_cache(1, 16)]
    steps = [torch.randn(2, 1, 8, dtype=torch.float64) for _ in range(2)]

    def run(route: str) -> list[torch.Tensor]:
        module.zero_grad()
        if route == "paged":
            outs = [module(x, cu_seqlens=torch.tensor([0, 4, 7]), is_causal=True, kv_cache=paged)]
            outs += [module(step, is_causal=True, kv_cache=paged) for step in steps]
        else:
            outs = [
                module(x[:, a:b], is_causal=True, kv_cache=c)
                for (a, b), c in zip([(0, 4), (4, 7)], caches, strict=True)
            ]
            outs += [
                module(step[i : i + 1], is_causal=True, kv_cache=c) for step in steps for i, c in enumerate(caches)
            ]
        sum(out.square().sum() for out in outs).backward()  # pyright: ignore[reportAttributeAccessIssue]
        return [p.grad.clone() for p in module.parameters()]  # pyright: ignore[reportOptionalMemberAccess]

    for ours, theirs in zip(run("paged"), run("contiguous"), strict=True):
        torch.testing.assert_close(ours, theirs, **F64)


@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    block_size=st.integers(1, 16),
    schedule=schedules(),
    seed=st.integers(0, 2**16),
    grad=st.booleans(),
    data=st.data(),
)
def test_latent_attention_packed_and_paged(
    lengths: list[int], block_size: int, schedule: list, seed: int, grad: bool, data: st.DataObject
) -> None:
    """LatentAttention: packed == each sequence alone, and paged (one shared pool of latent entries) == a
    LatentCache per sequence, sequences joining and leaving; decoding every sequence's new token as one batch
    (`(num_seqs, 1, d_model)` or packed), by absorption (no_grad) and by rebuilt keys and values (grad)."""
    torch.manual_seed(seed)
    mla = ssm.LatentAttention(16, 2, kv_lora_rank=4, d_nope=2, d_rope=2, d_value=3, dtype=torch.float64)
    x, cu = _packed(lengths, 16)
    bounds = cu.tolist()
    alone = [mla(x[:, a:b], is_causal=True) for a, b in itertools.pairwise(bounds) if b > a]
    if alone:
        torch.testing.assert_close(mla(x, cu_seqlens=cu, is_causal=True), torch.cat(alone, dim=1), **F64)
    cache = ssm.PagedKVCache.for_module(mla, num_blocks=64, block_size=block_size)
    assert cache.values_pool is cache.keys_pool and cache.nbytes == cache.keys_pool.numel() * 8
    cache._free = data.draw(st.permutations(range(64)), label="free list")
    live: list[tuple[int, object]] = []
    decoding = [([], [], dict.fromkeys(range(64), 1))] * 3  # then every live sequence decodes, lengths apart
    with torch.set_grad_enabled(grad):
        for joining, leaving, sizes in [*schedule, *decoding]:
            for index in reversed(leaving):
                cache.remove(live.pop(index)[0])
            old = len(live)
            live += [(cache.add(), mla.new_cache(1, 64)) for _ in joining]
            news = [sizes.get(i, 0) for i in range(old)] + joining
            x, cu = _packed(news, 16)
            if all(n == 1 for n in news) and data.draw(st.booleans(), label="decode form"):
                out = mla(x[0][:, None], is_causal=True, kv_cache=cache)[:, 0][None]
            else:
                out = mla(x, cu_seqlens=cu, is_causal=True, kv_cache=cache)
            bounds = cu.tolist()
            for (seq, contiguous), a, b in zip(live, bounds[:-1], bounds[1:], strict=True):
                if b > a:
                    expected = mla(x[:, a:b], is_causal=True, kv_cache=contiguous)  # pyright: ignore[reportArgumentType]
                    torch.testing.assert_close(out[:, a:b], expected, **F64)
                assert cache.length(seq) == len(contiguous)  # pyright: ignore[reportArgumentType]
            # one pool after every call (with grad, the writes are out of place): keys and values are one entry
            assert cache.values_pool is cache.keys_pool and cache.nbytes == cache.keys_pool.numel() * 8


def _visible(cache: ssm.PagedKVCache) -> tuple:
    """What a paged cache holds as its sequences see it: tables, lengths, free blocks and each held position's key
    and value (slots past a sequence's length are nobody's)."""
    keys, values = [], []
    for seq in cache.sequences:
        slots = cache.slots(seq, cache.first_kept(seq), cache.length(seq))
        keys.append(cache.keys_pool.flatten(0, 1)[slots].clone())
        values.append(cache.values_pool.flatten(0, 1)[slots].clone())
    return _snapshot(cache), keys, values


@pytest.mark.parametrize("form", ["decoding", "packed"])
@pytest.mark.parametrize("kind", ["multihead", "latent"])
def test_a_forward_hook_that_raises_leaves_a_paged_cache_as_it_was(form: str, kind: str) -> None:
    """A failed call changes nothing, also when a forward hook raises after the paged cache was written: the
    tables, lengths, free list and every held key are as before, and the next call computes what it would have."""
    torch.manual_seed(0)
    if kind == "multihead":
        module: torch.nn.Module = ssm.MultiHeadAttention(8, 2, 1, rope_theta=10000.0, dtype=torch.float64)
    else:
        module = ssm.LatentAttention(8, 2, kv_lora_rank=4, d_nope=2, d_rope=2, d_value=2, dtype=torch.float64)
    cache = ssm.PagedKVCache.for_module(module, num_blocks=8, block_size=2)
    twin = ssm.PagedKVCache.for_module(module, num_blocks=8, block_size=2)
    for paged in (cache, twin):
        paged.add(), paged.add()
    prompt, cu = _packed([3, 2], 8)
    new = torch.randn(2, 1, 8, dtype=torch.float64)
    with torch.no_grad():
        for paged in (cache, twin):
            module(prompt, cu_seqlens=cu, is_causal=True, kv_cache=paged)
        before = _visible(cache)

        def fail(*_: object) -> None:
            raise RuntimeError("a hook failed")

        handle = module.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="a hook failed"):
            if form == "decoding":
                module(new, is_causal=True, kv_cache=cache)
            else:
                module(new.transpose(0, 1), cu_seqlens=torch.tensor([0, 1, 2]), is_causal=True, kv_cache=cache)
        handle.remove()
        after = _visible(cache)
        assert after[0] == before[0]
        for held, kept in zip(after[1] + after[2], before[1] + before[2], strict=True):
            assert torch.equal(held, kept)
        torch.testing.assert_close(
            module(new, is_causal=True, kv_cache=cache), module(new, is_causal=True, kv_cache=twin), rtol=0, atol=0
        )


@pytest.mark.parametrize(("kind", "window"), [("multihead", None), ("multihead", 4), ("latent", None)])
def test_a_remembered_decoding_step_that_fails_is_rerun_on_the_cache_it_found(
    monkeypatch: pytest.MonkeyPatch, kind: str, window: int | None
) -> None:
    """A decoding step whose verdict is remembered runs unchecked; when it fails after writing the paged cache, it is
    run again with checks to explain the failure, on the cache as the call found it (the rerun writes where the
    failed run wrote, from the same lengths), and the call then leaves the cache as it was: equal to a twin that never
    saw the call, the next step computing exactly what the twin's computes."""
    torch.manual_seed(0)
    if kind == "multihead":
        module: torch.nn.Module = ssm.MultiHeadAttention(8, 2, 1, rope_theta=1e4, window=window, dtype=torch.float64)
        stages, last = plan.RAW, "project_output"
    else:
        module = ssm.LatentAttention(8, 2, kv_lora_rank=4, d_nope=2, d_rope=2, d_value=2, dtype=torch.float64)
        stages, last = latent._RAW, "project_latent_output"
    cache = ssm.PagedKVCache.for_module(module, num_blocks=32, block_size=2)
    twin = ssm.PagedKVCache.for_module(module, num_blocks=32, block_size=2)
    for paged in (cache, twin):
        paged.add(), paged.add(), paged.add()
    with torch.no_grad():
        for _ in range(11):  # (lengths past the module's sizes: later steps share the verdict by relations)
            step = torch.randn(3, 1, 8, dtype=torch.float64)
            for paged in (cache, twin):
                module(step, is_causal=True, kv_cache=paged)
        before = _visible(cache)
        written: list[list[int]] = []  # the lengths each write of the failed call found
        write = cache.write_decoded

        def spy(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            written.append([cache.length(seq) for seq in cache.sequences])
            return write(slots, k, v)

        def planted(*_: object) -> None:
            raise RuntimeError("planted after the cache was written")

        monkeypatch.setattr(cache, "write_decoded", spy)
        monkeypatch.setattr(stages, last, planted)  # the unchecked run only: checks run the stage
        with pytest.raises(RuntimeError, match="planted after the cache was written"):
            module(torch.randn(3, 1, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
        monkeypatch.undo()
        assert written == [before[0][1], before[0][1]]  # the unchecked run, then the checked one, from one cache
        after = _visible(cache)
        assert after[0] == before[0] == _visible(twin)[0]
        for held, kept, twins in zip(after[1] + after[2], before[1] + before[2], _visible(twin)[1] + _visible(twin)[2],
                                     strict=True):  # fmt: skip
            assert torch.equal(held, kept) and torch.equal(held, twins)
        new = torch.randn(3, 1, 8, dtype=torch.float64)
        torch.testing.assert_close(
            module(new, is_causal=True, kv_cache=cache), module(new, is_causal=True, kv_cache=twin), rtol=0, atol=0
        )


@given(
    module=serving_modules(variants=False),
    block_size=st.integers(1, 8),
    count=st.integers(1, 3),
    operations=st.lists(st.sampled_from(["decode", "decode", "chunk", "undo", "shuffle"]), min_size=1, max_size=10),
    data=st.data(),
)
def test_decoding_after_undone_steps_and_chunks_equals_a_kv_cache_per_sequence(
    module: ssm.MultiHeadAttention, block_size: int, count: int, operations: list[str], data: st.DataObject
) -> None:
    """What decoding keeps between steps (slot maps, right-aligned slots, positions) follows the cache through
    steps undone by `restore` (the blocks they took given back, then other blocks handed out for the same positions)
    and packed chunks between steps (every sequence the same number of new tokens): each step computes what a
    contiguous KVCache per sequence computes."""
    cache = ssm.PagedKVCache.for_module(module, num_blocks=96, block_size=block_size)
    cache._free = data.draw(st.permutations(range(96)), label="free list")
    seqs = [(cache.add(), module.new_cache(1, 64)) for _ in range(count)]
    x, cu = _packed([2] * count, module.d_model)
    module(x, cu_seqlens=cu, is_causal=True, kv_cache=cache)
    for i, (_, contiguous) in enumerate(seqs):
        module(x[:, 2 * i : 2 * i + 2], is_causal=True, kv_cache=contiguous)
    saved: list[tuple] = []
    with torch.no_grad():
        for operation in operations:
            if operation == "shuffle":  # (after an undo: the blocks given back are not the next ones handed out)
                cache._free = data.draw(st.permutations(cache._free), label="free list")
                continue
            if operation == "undo":
                if saved:
                    state, states = saved.pop()
                    cache.restore(state)
                    for (_, contiguous), kept in zip(seqs, states, strict=True):
                        contiguous.restore(kept)
                continue
            saved.append((cache.state(), [contiguous.state() for _, contiguous in seqs]))
            size = 1 if operation == "decode" else data.draw(st.integers(1, 3), label="chunk")
            x, cu = _packed([size] * count, module.d_model)
            if operation == "decode":
                out = module(x.view(count, 1, -1), is_causal=True, kv_cache=cache).view(1, count, -1)
            else:
                out = module(x, cu_seqlens=cu, is_causal=True, kv_cache=cache)
            for i, (seq, contiguous) in enumerate(seqs):
                part = slice(size * i, size * (i + 1))
                expected = module(x[:, part], is_causal=True, kv_cache=contiguous)
                torch.testing.assert_close(out[:, part], expected, **F64)
                assert cache.length(seq) == len(contiguous)


def test_torch_refuses_causal_jagged_attention_on_cpu_so_packed_prefill_loops() -> None:
    """Packed prefill runs sequence by sequence because torch's nested jagged tensors have no causal SDPA on CPU
    (docs/serving.md): when a torch release computes it, this fails, and the route should be measured again.
    (torch 2.13 says "No viable backend for scaled_dot_product_attention"; 2.14's CUDA wheel, on a machine
    without a driver, fails initialising CUDA: both refuse, in words of their own.)"""
    offsets = torch.tensor([0, 5, 8])
    q = torch.nested.nested_tensor_from_jagged(torch.randn(8, 2, 4), offsets).transpose(1, 2)
    k = torch.nested.nested_tensor_from_jagged(torch.randn(8, 2, 4), offsets).transpose(1, 2)
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
