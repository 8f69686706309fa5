"""KV cache decoding equals full causal attention; appends are views; a bad append changes nothing."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._core.trace import storage_id
from shapesafe_mha.testing import attention_configs, attention_inputs, projection_weights

F64 = {"atol": 1e-10, "rtol": 1e-8}


@st.composite
def chunkings(draw: st.DrawFn, length: int) -> list[int]:
    """Split `length` positions into a prefill of random chunks followed by single-token steps."""
    prefill = draw(st.integers(0, length))
    chunks: list[int] = []
    left = prefill
    while left:
        size = draw(st.integers(1, left))
        chunks.append(size)
        left -= size
    return chunks + [1] * (length - prefill)


@given(data=st.data())
def test_prefill_then_decoding_equals_one_causal_forward(data: st.DataObject, device: str) -> None:
    """Prefill in chunks, then token by token, through a KVCache == one causal forward (MHA, GQA, MQA)."""
    config = data.draw(attention_configs(cross=False, max_seq=10), label="config")
    weights = data.draw(projection_weights(config, device=device))
    x = data.draw(attention_inputs(config, device=device)).query
    chunks = data.draw(chunkings(config.seq), label="chunks")
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)

    full = module(x, is_causal=True)
    cache = module.new_cache(config.batch, capacity=config.seq + data.draw(st.integers(0, 3), label="spare"))
    pieces, start = [], 0
    for size in chunks:
        pieces.append(module(x[:, start : start + size], is_causal=True, kv_cache=cache))
        start += size
    assert len(cache) == config.seq
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **F64)


@given(data=st.data())
def test_a_window_cache_shorter_than_the_sequence_with_rope_equals_one_causal_windowed_forward(
    data: st.DataObject,
) -> None:
    """Prefill in chunks, then token by token, through a sliding-window cache that holds fewer positions than the
    sequence (capacity >= window), with rotary embeddings (half or interleaved, partial or whole): every step ==
    one causal windowed forward, whose rotary positions count every position seen, not only those kept."""
    config = data.draw(attention_configs(cross=False, max_seq=12), label="config")
    d_head = config.d_head
    assume(d_head % 2 == 0)  # (rotary embeddings rotate pairs)
    window = data.draw(st.integers(1, config.seq), label="window")
    capacity = data.draw(st.integers(window, max(window, config.seq - 1)), label="capacity")
    rope_dim = data.draw(st.sampled_from(sorted({2, d_head})), label="rope_dim")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    module = ssm.MultiHeadAttention(
        config.d_model,
        config.num_heads,
        config.num_kv_heads,
        d_head=d_head,
        window=window,
        rope_theta=data.draw(st.sampled_from([10.0, 10000.0]), label="rope_theta"),
        rope_dim=rope_dim,
        rope_interleaved=data.draw(st.booleans(), label="interleaved"),
    ).double()
    x = data.draw(attention_inputs(config)).query.double()
    chunks = data.draw(chunkings(config.seq), label="chunks")

    full = module(x, is_causal=True)
    cache = module.new_cache(config.batch, capacity)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(module(x[:, start : start + size], is_causal=True, kv_cache=cache))
        start += size
    assert len(cache) == config.seq
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **F64)


@given(data=st.data())
def test_decoding_with_key_padding_equals_full_forward(data: st.DataObject) -> None:
    """Masks during decoding cover every cached position: padding the prompt's start is respected at each step."""
    config = data.draw(attention_configs(cross=False, max_seq=8), label="config")
    weights = data.draw(projection_weights(config))
    x = data.draw(attention_inputs(config)).query
    module = ssm.MultiHeadAttention.from_weights(weights, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
    pad = data.draw(st.integers(0, config.seq - 1), label="left_padding")
    padding = torch.zeros(config.batch, config.seq, dtype=torch.bool)
    padding[:, :pad] = True
    full = module(x, is_causal=True, key_padding_mask=padding)
    cache = module.new_cache(config.batch, config.seq)
    steps = [
        module(x[:, i : i + 1], is_causal=True, kv_cache=cache, key_padding_mask=padding[:, : i + 1])
        for i in range(config.seq)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **F64)


def test_append_returns_views_of_the_buffers(any_device: str) -> None:
    """append writes in place and returns views of everything cached: no copy of past positions."""
    cache = ssm.KVCache(2, 3, 10, 4, dtype=torch.float32, device=any_device)
    k, v = torch.randn(2, 3, 4, 4, device=any_device), torch.randn(2, 3, 4, 4, device=any_device)
    keys, values = cache.append(k, v)
    assert storage_id(keys) == storage_id(cache.keys_buffer) and storage_id(values) == storage_id(cache.values_buffer)
    assert keys.shape == (2, 3, 4, 4) and len(cache) == 4
    keys, _ = cache.append(k[:, :, :0], v[:, :, :0])  # zero new positions: allowed, returns the contents
    assert keys.shape == (2, 3, 4, 4) and len(cache) == 4
    assert cache.capacity == 10 and cache.nbytes == 2 * 2 * 3 * 10 * 4 * 4
    cache.reset()
    assert len(cache) == 0


def test_appended_values_are_the_ones_read_back() -> None:
    """Two appends read back in order."""
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float64)
    first, second = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 2, 4, dtype=torch.float64)
    cache.append(first, -first)
    keys, values = cache.append(second, -second)
    assert torch.equal(keys, torch.cat([first, second], dim=2)) and torch.equal(values, -keys)


BAD_APPENDS = {
    "overflow": (dict(new=5), "exceed capacity=6"),
    "heads": (dict(heads=3), "k has num_kv_heads=3 \\(axis 1\\), but the cache set num_kv_heads=2"),
    "d_head": (dict(d_head=5), "k has d_head=5 \\(axis 3\\), but the cache set d_head=4"),
    "batch": (dict(batch=3), "k has batch=3 \\(axis 0\\), but the cache set batch=2"),
    "dtype": (dict(dtype=torch.float32), "k has dtype float32, but the cache holds float64"),
    "device": (dict(device="meta"), "k is on meta, but the cache is on cpu"),
    "lengths": (dict(v_new=2), "v has new=2 \\(axis 2\\), but k set new=1"),
    "rank": (dict(rank=3), "k must be 4-D"),
}


@pytest.mark.parametrize("mistake", list(BAD_APPENDS))
def test_a_bad_append_raises_and_leaves_the_cache_as_it_was(mistake: str) -> None:
    """Overflow, wrong heads/d_head/batch/dtype/device, k and v of different lengths: ShapeError, nothing changed."""
    change, message = BAD_APPENDS[mistake]
    cache = ssm.KVCache(2, 2, 6, 4, dtype=torch.float64)
    cache.append(torch.randn(2, 2, 2, 4, dtype=torch.float64), torch.randn(2, 2, 2, 4, dtype=torch.float64))
    before = (len(cache), cache.keys_buffer.clone(), cache.values_buffer.clone())
    shape = [change.get("batch", 2), change.get("heads", 2), change.get("new", 1), change.get("d_head", 4)]
    options = {"dtype": change.get("dtype", torch.float64), "device": change.get("device", "cpu")}
    k = torch.ones(*shape[: change.get("rank", 4)], **options)
    v = torch.ones(*shape[:2], change.get("v_new", shape[2]), shape[3], **options)
    with pytest.raises(ssm.ShapeError, match=message):
        cache.append(k, v)
    assert len(cache) == before[0]
    assert torch.equal(cache.keys_buffer, before[1]) and torch.equal(cache.values_buffer, before[2])


def test_a_bad_forward_leaves_cache_and_parameters_unchanged() -> None:
    """A forward that fails its checks (here: overflow, then a wrong width) appends nothing."""
    module = ssm.MultiHeadAttention(16, 4, 2, dtype=torch.float64)
    cache = module.new_cache(batch=1, capacity=4)
    module(torch.randn(1, 3, 16, dtype=torch.float64), is_causal=True, kv_cache=cache)
    snapshot = (len(cache), cache.keys_buffer.clone(), [p.clone() for p in module.parameters()])
    with pytest.raises(ssm.ShapeError, match="exceed its capacity=4"):
        module(torch.randn(1, 2, 16, dtype=torch.float64), is_causal=True, kv_cache=cache)
    with pytest.raises(ssm.ShapeError, match="query has d_model=8"):
        module(torch.randn(1, 1, 8, dtype=torch.float64), kv_cache=cache)
    with pytest.raises(ssm.ShapeError, match="kv_cache has batch=1 \\(axis 0\\), but query set batch=2"):
        module(torch.randn(2, 1, 16, dtype=torch.float64), kv_cache=cache)
    assert len(cache) == snapshot[0] and torch.equal(cache.keys_buffer, snapshot[1])
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), snapshot[2], strict=True))


def test_a_window_cache_slides_only_when_full_keeping_window_minus_one_positions() -> None:
    """Capacity 6, window 4, one position an append: it fills to 6, then the 7th append keeps the 3 most recent
    (all a query with a window of 4 sees besides itself) and writes after them; values slide with the keys.
    Pinned from generated mutants that slid one append early, or kept one position too many."""
    cache = ssm.KVCache(1, 1, 6, 2, window=4, dtype=torch.float32)
    held = []
    for position in range(9):
        step = torch.full((1, 1, 1, 2), float(position))
        cache.append(step, -step)
        held.append(cache.keys()[0, 0, :, 0].tolist())
        assert torch.equal(cache.values(), -cache.keys())
    assert [len(h) for h in held] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    assert held[6] == [3.0, 4.0, 5.0, 6.0] and held[8] == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert cache.seen == 9


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"batch": 0}, "KVCache(): batch must be a positive int, but got 0."),
        ({"num_kv_heads": True}, "KVCache(): num_kv_heads must be a positive int, but got True."),
        ({"capacity": 2.0}, "KVCache(): capacity must be a positive int, but got 2.0."),
        ({"d_head": -1}, "KVCache(): d_head must be a positive int, but got -1."),
        ({"window": 0}, "KVCache(): window must be a positive int or None, but got 0."),
        ({"window": True}, "KVCache(): window must be a positive int or None, but got True."),
    ],
)
def test_cache_sizes_are_positive_ints_named_in_the_refusal(sizes: dict, message: str) -> None:
    arguments = {"batch": 1, "num_kv_heads": 1, "capacity": 4, "d_head": 2, **sizes}
    window = arguments.pop("window", None)
    with pytest.raises(ssm.ConfigError) as raised:
        ssm.KVCache(*arguments.values(), window=window, dtype=torch.float32)
    assert str(raised.value) == message


def test_to_converts_both_buffers_and_keeps_what_they_hold() -> None:
    cache = ssm.KVCache(1, 2, 4, 2, dtype=torch.float32)
    k = torch.randn(1, 2, 3, 2)
    cache.append(k, 2 * k)
    moved = cache.to(torch.float64, "cpu")
    assert moved.keys_buffer.dtype == moved.values_buffer.dtype == moved.dtype == torch.float64
    assert torch.equal(moved.keys(), k.double()) and torch.equal(moved.values(), 2 * k.double()) and len(moved) == 3


# --- pinned from surviving generated mutants (mutmut) ---------------------------------------------------------


def _cache(**kwargs: object) -> ssm.KVCache:
    return ssm.KVCache(2, 2, 8, 4, dtype=torch.float32, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("k", "v", "first_line"),
    [
        (
            torch.zeros(2, 2, 3, 4, dtype=torch.float64),
            torch.zeros(2, 2, 3, 4, dtype=torch.float64),
            "KVCache.append(): k has dtype float64, but the cache holds float32; cast it with k.to(torch.float32) "
            "or the cache with kv_cache.to(torch.float64).",
        ),
        (
            torch.zeros(2, 2, 3, 4, device="meta"),
            torch.zeros(2, 2, 3, 4, device="meta"),
            "KVCache.append(): k is on meta, but the cache is on cpu.",
        ),
        (  # v's dtype is read even though k is not a tensor
            [[1.0]],
            torch.zeros(2, 2, 3, 4, dtype=torch.float64),
            "KVCache.append(): v has dtype float64, but the cache holds float32; cast it with v.to(torch.float32) "
            "or the cache with kv_cache.to(torch.float64).",
        ),
    ],
)
def test_an_append_of_another_dtype_or_device_is_refused_with_the_cast_to_make(
    k: object, v: object, first_line: str
) -> None:
    cache = _cache()
    with pytest.raises(ssm.ShapeError) as raised:
        cache.append(k, v)  # type: ignore[arg-type]
    assert str(raised.value).splitlines()[0] == first_line
    assert len(cache) == 0


def test_an_append_of_known_shapes_is_not_checked_again() -> None:
    """The verdict of an append is remembered: the same shapes again open no checking session."""
    from unittest import mock

    from shapesafe_mha._compute import cache as cache_module

    cache = _cache()
    with mock.patch.object(cache_module, "Session", wraps=cache_module.Session) as session:
        for _ in range(3):
            cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert session.call_count == 1


def test_to_a_device_moves_both_buffers() -> None:
    cache = _cache().to(device="meta")
    assert cache.device.type == "meta"
    assert cache.keys_buffer.device.type == cache.values_buffer.device.type == "meta"


def test_without_autograd_an_append_writes_into_the_same_buffers() -> None:
    """Nothing requires grad: the new positions are written in place, no buffer is copied (grad mode on or off)."""
    cache = _cache()
    keys, values = storage_id(cache.keys_buffer), storage_id(cache.values_buffer)
    cache.append(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    with torch.no_grad():
        cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert (storage_id(cache.keys_buffer), storage_id(cache.values_buffer)) == (keys, values)


@pytest.mark.parametrize("grad", ["k", "v"])
def test_gradients_flow_through_every_step_when_only_keys_or_only_values_require_grad(grad: str) -> None:
    """Decoding three steps with only k (or only v) requiring grad: the gradients equal those of attending the
    concatenated keys and values directly (in-place writes would break the earlier steps' graphs)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    ks = [torch.randn(1, 2, 1, 4, dtype=torch.float64, requires_grad=grad == "k") for _ in range(3)]
    vs = [torch.randn(1, 2, 1, 4, dtype=torch.float64, requires_grad=grad == "v") for _ in range(3)]
    leaves = ks if grad == "k" else vs
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float64)
    loss = sum(ssm.scaled_dot_product_attention(q, *cache.append(k, v)).sum() for k, v in zip(ks, vs, strict=True))
    cached = torch.autograd.grad(loss, leaves)
    direct = sum(
        ssm.scaled_dot_product_attention(q, torch.cat(ks[: t + 1], 2), torch.cat(vs[: t + 1], 2)).sum()
        for t in range(3)
    )
    torch.testing.assert_close(cached, torch.autograd.grad(direct, leaves), **F64)


@pytest.mark.parametrize("kind", ["mha", "window", "latent"])
def test_decoding_without_grad_after_a_prefill_with_grad_leaves_the_prefills_backward_intact(kind: str) -> None:
    """A prompt run with grad in two chunks (its loss kept for later), then steps decoded under no_grad into the
    same cache: the prompt's backward still runs and gives the gradients it gives with no decoding at all (an
    in-place write into a buffer the prompt's graph saved broke it), and the steps equal one causal forward."""
    torch.manual_seed(0)
    if kind == "latent":
        module: torch.nn.Module = ssm.LatentAttention(32, 4, kv_lora_rank=8, d_nope=8, d_rope=4, d_value=8)
    else:
        module = ssm.MultiHeadAttention(32, 4, 2, rope_theta=10000.0, window=4 if kind == "window" else None)
    module = module.double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    prompt, steps = x[:, :5], x[:, 5:]

    def prompt_gradients(decode: bool) -> tuple[torch.Tensor, ...]:
        cache = module.new_cache(2, 8)  # pyright: ignore[reportCallIssue]
        # two chunks: the second attends to what the first wrote into the buffer
        loss = sum(module(chunk, is_causal=True, kv_cache=cache).square().sum() for chunk in prompt.split([3, 2], 1))
        decoded = []
        if decode:
            with torch.no_grad():
                decoded = [module(steps[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(2)]
            full = module(x, is_causal=True)[:, 5:]
            torch.testing.assert_close(torch.cat(decoded, 1), full, **F64)
        return torch.autograd.grad(loss, list(module.parameters()))

    torch.testing.assert_close(prompt_gradients(decode=True), prompt_gradients(decode=False), **F64)


def test_reset_drops_the_graph_when_only_the_values_carried_one() -> None:
    cache = _cache()
    cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4, requires_grad=True))
    assert cache.values_buffer.requires_grad and not cache.keys_buffer.requires_grad
    cache.reset()
    assert not cache.values_buffer.requires_grad and len(cache) == 0


def test_a_chunk_that_exactly_fills_a_window_cache_stays_in_it() -> None:
    """Capacity 8, window 4, 6 positions held: a chunk of 5 keeps the last 3 and writes after them, filling the
    buffer exactly; every kept position stays readable."""
    cache = ssm.KVCache(1, 1, 8, 1, window=4, dtype=torch.float32)
    cache.append(torch.arange(6.0).view(1, 1, 6, 1), torch.zeros(1, 1, 6, 1))
    cache.append(torch.arange(6.0, 11.0).view(1, 1, 5, 1), torch.zeros(1, 1, 5, 1))
    assert cache.keys()[0, 0, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert len(cache) == 11


def test_a_chunk_longer_than_a_window_cache_then_decoding_equals_one_causal_forward() -> None:
    """Capacity 6, window 4: a prefill of 5, a chunk of 6 (more than the buffer holds beside the 3 kept: attended
    in passing, then the window's last 3 kept), then 2 decoding steps == one causal windowed forward over the 13
    positions, and len() counts all 13."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(8, 2, window=4).double()
    x = torch.randn(1, 13, 8, dtype=torch.float64)
    cache = module.new_cache(1, 6)
    outs = [module(x[:, :5], is_causal=True, kv_cache=cache), module(x[:, 5:11], is_causal=True, kv_cache=cache)]
    assert len(cache) == 11 and cache.kept == 3
    outs += [module(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in (11, 12)]
    torch.testing.assert_close(torch.cat(outs, 1), module(x, is_causal=True), **F64)
    assert len(cache) == 13


def test_the_repr_gives_the_sizes_what_is_held_and_with_a_window_what_was_seen() -> None:
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32)
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    assert repr(cache) == (
        "KVCache(batch=1, num_kv_heads=2, capacity=8, d_head=4, dtype=torch.float32, device=cpu, filled=3)"
    )
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.float32, window=4)
    for _ in range(10):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert repr(cache) == (
        "KVCache(batch=1, num_kv_heads=2, capacity=8, d_head=4, dtype=torch.float32, device=cpu, filled=5, "
        "window=4, seen=10)"
    )


def test_a_module_writing_its_cache_under_vmap_is_named_in_the_refusal() -> None:
    """The module's call is what the user wrote: the refusal names MultiHeadAttention.forward(), not KVCache.append(),
    without a verdict and after one (where only the cache's write refuses)."""
    module = ssm.MultiHeadAttention(16, 4, 2)
    for _ in range(2):
        cache = module.new_cache(1, 8)
        with pytest.raises(ssm.ShapeError) as raised:
            torch.vmap(lambda x, c=cache: module(x, kv_cache=c))(torch.randn(3, 1, 2, 16))
        assert str(raised.value).startswith("MultiHeadAttention.forward(): kv_cache cannot be written under torch.vmap")
        module(torch.randn(1, 2, 16), kv_cache=module.new_cache(1, 8))  # a verdict for that call's shapes


def test_a_cache_of_an_integer_dtype_is_refused_at_its_first_append() -> None:
    """Its buffer is the witness the append check is seeded with, and it must be floating point: a ShapeError
    naming the dtype, before anything is written (the message's word for the buffer pinned as it is)."""
    cache = ssm.KVCache(1, 2, 8, 4, dtype=torch.int64)
    new = torch.zeros(1, 2, 1, 4, dtype=torch.int64)
    with pytest.raises(ssm.ShapeError) as caught:
        cache.append(new, new)
    first = str(caught.value).splitlines()[0]
    assert first == "KVCache.append(): witness has dtype int64, but it must be floating point."
    assert len(cache) == 0


@pytest.mark.parametrize("value", [None, 2, 8, 0])
def test_a_window_set_on_a_built_cache_is_refused_and_changes_nothing(value: int | None) -> None:
    """Which positions a cache kept was decided by its window (and which blocks a paged cache freed): set afterwards,
    decoding would attend to positions a fresh cache of that window keeps and this one dropped. Refused, naming how to
    build one, before and after it has slid."""
    module = ssm.MultiHeadAttention(16, 2, window=4).eval()
    x = torch.randn(1, 10, 16)
    paged = ssm.PagedKVCache.for_module(module, num_blocks=8, block_size=2)
    paged.add()
    caches = [module.new_cache(1, capacity=8), paged]
    with torch.no_grad():
        module(x[:, :7], is_causal=True, kv_cache=caches[0])  # slid: positions 0..2 dropped
        module(x[:, :7], cu_seqlens=torch.tensor([0, 7], dtype=torch.int32), is_causal=True, kv_cache=paged)
    for cache in (*caches, module.new_cache(1, capacity=8)):
        before = repr(cache)
        with pytest.raises(ssm.ConfigError, match=rf"^{type(cache).__name__}: window cannot be set on a built cache"):
            cache.window = value
        assert cache.window == 4 and repr(cache) == before
