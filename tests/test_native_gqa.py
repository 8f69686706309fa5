"""GQA/MQA by torch's own kernel where it copies nothing, folded where it would: the decision table for this
torch pinned against recorded allocations, both paths taken, and the native one equal to a per-head loop."""

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._compute import kernels as _kernels
from shapesafe_mha.reference import per_head_attention
from shapesafe_mha.testing import assert_no_kv_expansion, attention_configs, attention_masks

B, H, HKV, S, KV, D = 2, 8, 2, 3, 40, 8  # K at num_heads heads is larger than every legitimate tensor
LONG = 1100  # a decoding query against this many keys: B * H * LONG * D over NATIVE_DECODE_MAX, where the fold wins

# (device, masked, causal, grad, decode, dropout) -> torch's own kernel, or the fold and why. For this torch
# (2.13): on CPU its flash kernel computes GQA without expanding K/V in every case but dropout (the math kernel
# then repeats K and V); one decoding query copies nothing either, and against many keys ("long") it runs
# faster folded (a view; benchmarks), against few ("short") on torch's kernel; on `meta` SDPA runs the math
# kernel, which repeats K and V.
NATIVE, COPIES, SLOWER = "native", "fold: torch's kernel copies K/V", "fold: measured faster"
DECISIONS = [
    (("cpu", False, False, False, False, False), NATIVE),
    (("cpu", False, True, False, False, False), NATIVE),
    (("cpu", True, False, False, False, False), NATIVE),
    (("cpu", True, True, False, False, False), NATIVE),
    (("cpu", False, True, True, False, False), NATIVE),
    (("cpu", True, True, True, False, False), NATIVE),
    (("cpu", False, True, False, "short", False), NATIVE),
    (("cpu", True, True, False, "short", False), NATIVE),
    (("cpu", False, True, True, "short", False), NATIVE),
    (("cpu", False, True, False, "long", False), SLOWER),
    (("cpu", True, True, False, "long", False), SLOWER),
    (("cpu", False, True, True, "long", False), SLOWER),
    (("cpu", False, True, True, False, True), COPIES),
    (("meta", False, True, False, False, False), COPIES),
    (("meta", False, False, False, "short", False), COPIES),
]
MEASURED = (2, 13)  # the torch on which the table above was read


def _name(case: tuple[Any, ...], decision: str) -> str:
    flags = [name for name, on in zip(("masked", "causal", "grad", "decode", "dropout"), case[1:], strict=True) if on]
    return "-".join([case[0], *flags, *([case[4]] if case[4] else []), decision.split(":")[0]])


def _inputs(device: str, masked: bool, decode: str | bool, grad: bool) -> tuple[torch.Tensor, ...]:
    seq, kv_seq = (1 if decode else S), (LONG if decode == "long" else KV)
    q = torch.randn(B, H, seq, D, device=device, requires_grad=grad)
    k = torch.randn(B, HKV, kv_seq, D, device=device, requires_grad=grad)
    v = torch.randn(B, HKV, kv_seq, D, device=device, requires_grad=grad)
    mask = torch.ones(B, 1, seq, kv_seq, dtype=torch.bool, device=device).tril(kv_seq - seq) if masked else None
    return q, k, v, mask


@pytest.mark.skipif(_kernels.TORCH_RELEASE < MEASURED, reason="measured from torch 2.13; older torch folds everywhere")
@pytest.mark.parametrize(("case", "decision"), [pytest.param(c, d, id=_name(c, d)) for c, d in DECISIONS])
def test_the_decision_table_is_what_torchs_allocations_show(case: tuple[Any, ...], decision: str) -> None:
    """A case folds where torch's kernel, run on it, allocates K/V at num_heads heads, or where the fold was
    measured faster (decoding against many keys); every other case goes to torch's kernel."""
    device, masked, causal, grad, decode, dropout = case
    q, k, v, mask = _inputs(device, masked, decode, grad)
    dropout_p = 0.1 if dropout else 0.0
    assert _kernels.native_gqa(q, k, dropout_p) is (decision == NATIVE)

    def theirs() -> None:
        causal_here = causal and not masked and not decode  # square: torch's top-left is_causal is ours
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal_here, dropout_p=dropout_p, enable_gqa=True
        )
        if grad:
            out.sum().backward()

    sizes = {"batch": B, "num_heads": H, "kv_seq": k.shape[2], "d_head": D, "dtype": torch.float32}
    if decision != COPIES:
        assert_no_kv_expansion(theirs, **sizes)
    else:
        with pytest.raises(AssertionError, match="expanded to num_heads=8"):
            assert_no_kv_expansion(theirs, **sizes)


def test_unmeasured_devices_and_older_torch_fold() -> None:
    """Only devices in the table go native, and only from the torch version they were measured on."""
    assert _kernels.NATIVE_GQA_SINCE == {"cpu": (2, 13)}
    assert _kernels.NATIVE_GQA_DEVICES <= {"cpu"}
    assert ("cpu" in _kernels.NATIVE_GQA_DEVICES) is (_kernels.TORCH_RELEASE >= (2, 13))
    assert _kernels.TORCH_RELEASE == tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.fixture
def kernels_taken(monkeypatch: pytest.MonkeyPatch, patch_kernel: Any) -> list[str]:
    """Which kernel each attention ran on: 'native' (torch's GQA), 'folded' (the query groups folded)."""
    taken: list[str] = []
    native, fold, fold_one = _kernels.sdpa_gqa, _kernels.fold_queries, _kernels.fold_one_query

    def recording_native(*args: Any) -> torch.Tensor:
        taken.append("native")
        return native(*args)

    def recording_fold(grouped: torch.Tensor) -> torch.Tensor:
        taken.append("folded")
        return fold(grouped)

    def recording_fold_one(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        taken.append("folded")
        return fold_one(q, num_kv_heads)

    patch_kernel("sdpa_gqa", recording_native)
    patch_kernel("fold_queries", recording_fold)
    patch_kernel("fold_one_query", recording_fold_one)
    return taken


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("causal prefill", "native"),
        ("key-padded prefill", "native"),
        ("training step", "native"),
        ("decode, 8 cached", "native"),
        ("decode, 600 cached", "folded"),
        ("need_weights", "folded"),
        ("dropout in training", "folded"),
    ],
)
def test_the_module_runs_gqa_on_the_kernel_the_table_names(how: str, expected: str, kernels_taken: list[str]) -> None:
    """GQA prefill, padding, autograd and decoding against few keys go to torch's kernel; decoding against
    many keys (2 * 8 * 600 * 8 elements, over NATIVE_DECODE_MAX), weights and dropout fold."""
    module = ssm.MultiHeadAttention(64, 8, 2, dropout=0.1 if how == "dropout in training" else 0.0)
    module.train(how in ("training step", "dropout in training"))
    x = torch.randn(2, 5, 64)
    with torch.set_grad_enabled(module.training):
        for _ in range(2):  # the first call checked, the second remembered: the same kernel
            if how.startswith("decode"):
                cached = int(how.split()[1])
                cache = module.new_cache(2, cached + 1)
                module(torch.randn(2, cached, 64), is_causal=True, kv_cache=cache)
                kernels_taken.clear()  # the prefill is a causal prefill
                module(x[:, :1], is_causal=True, kv_cache=cache)
            elif how == "key-padded prefill":
                module(x, is_causal=True, key_padding_mask=torch.tensor([[False] * 5, [True] * 2 + [False] * 3]))
            elif how == "need_weights":
                module(x, is_causal=True, need_weights=True)
            else:
                module(x, is_causal=True).sum().backward() if module.training else module(x, is_causal=True)
    assert set(kernels_taken) == {expected}


def _per_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Head by head, query by query's row: softmax over allowed keys, lower-right causal, zeros where none is."""
    batch, heads, seq, d_head = q.shape
    group, kv_seq = heads // k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    allowed = torch.ones(batch, heads, seq, kv_seq, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(seq, kv_seq, dtype=torch.bool).tril(kv_seq - seq)
    if mask is not None:
        allowed &= mask
    for b in range(batch):
        for h in range(heads):
            scores = q[b, h] @ k[b, h // group].T / math.sqrt(d_head)
            scores = scores.masked_fill(~allowed[b, h], -math.inf)
            weights = torch.softmax(scores, -1).nan_to_num(0.0)
            out[b, h] = weights @ v[b, h // group]
    return out


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_public_stage_on_torchs_kernel_equals_a_per_head_loop(data: st.DataObject) -> None:
    """ssm.scaled_dot_product_attention, GQA/MQA with masks (rows with no key included) and lower-right causal,
    takes torch's own kernel (folds one query against many keys) and equals attention computed head by head."""
    config = data.draw(attention_configs(kinds=("gqa", "mqa"), max_seq=12), label="config")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    b, h, hkv, s, kv, d = config.batch, config.num_heads, config.num_kv_heads, config.seq, config.kv_seq, config.d_head
    q, k, v = (
        torch.randn(b, n, m, d, generator=generator, dtype=torch.float64) for n, m in ((h, s), (hkv, kv), (hkv, kv))
    )
    mask = data.draw(attention_masks(config), label="attn_mask")
    is_causal = data.draw(st.booleans(), label="is_causal")
    taken: list[bool] = []
    native = _kernels.sdpa_gqa

    def recording(*args: Any) -> torch.Tensor:
        taken.append(True)
        return native(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernels, "sdpa_gqa", recording)
        ours = ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    expected = s > 1 or _kernels.native_decodes(b, h, kv, d)
    assert bool(taken) is expected, "torch's own kernel for every seq but one decoding query against many keys"
    torch.testing.assert_close(ours, _per_head(q, k, v, mask, is_causal), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(("batch", "num_heads", "kv_seq"), [(1, 8, 1000), (16, 2, 300)])
def test_a_decoding_query_takes_torchs_kernel_up_to_native_decode_max_elements(
    batch: int, num_heads: int, kv_seq: int, kernels_taken: list[str]
) -> None:
    """One query against kv_seq keys goes to torch's kernel where batch * num_heads * kv_seq * d_head is at most
    NATIVE_DECODE_MAX, and folds above, whichever of batch and num_heads is the larger (1 * 8 * 1000 * 8 is under,
    16 * 2 * 300 * 8 over); both equal a per-head loop."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, num_heads, 1, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, 1, kv_seq, D, generator=generator, dtype=torch.float64) for _ in range(2))
    out = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
    under = batch * num_heads * kv_seq * D <= _kernels.NATIVE_DECODE_MAX
    assert kernels_taken == ["native" if under else "folded"]
    torch.testing.assert_close(out, _per_head(q, k, v, None, True), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("num_kv_heads", [H, HKV, 1])
@pytest.mark.parametrize("kv_seq", [S, KV])
def test_causal_attention_without_a_mask_equals_a_per_head_loop(num_kv_heads: int, kv_seq: int) -> None:
    """is_causal alone, MHA/GQA/MQA, square (where torch's own causal mask is ours) or with more keys than queries
    (lower-right): attention computed head by head."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, num_kv_heads, kv_seq, D, generator=generator, dtype=torch.float64) for _ in range(2))
    ours = ssm.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, _per_head(q, k, v, None, True), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("masked", [False, True])
def test_one_decoding_query_against_many_keys_folds_and_equals_a_per_head_loop(masked: bool) -> None:
    """GQA, one query against LONG keys (over NATIVE_DECODE_MAX: folded), unmasked or with a mask that leaves the
    first sequence no key: attention computed head by head, zeros where no key is allowed."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, LONG, D, generator=generator, dtype=torch.float64) for _ in range(2))
    assert not _kernels.native_decodes(B, H, LONG, D)
    mask = None
    if masked:
        mask = torch.rand(B, 1, 1, LONG, generator=generator) > 0.5
        mask[0] = False
    ours = ssm.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(ours, _per_head(q, k, v, mask, True), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("how", ["fused", "separate", "padding mask", "need_weights", "multi-query"])
def test_a_module_decoding_against_many_keys_folds_one_query_and_equals_the_reference(
    how: str, kernels_taken: list[str]
) -> None:
    """Decoding one query a step against LONG cached keys folds (each KV head's group of query heads as its rows,
    one view; the output merged by one reshape), on the fused projection (inference) and the separate ones (grad),
    with a padding mask that leaves a sequence no key, with weights, and MQA: every step equals
    `per_head_attention` over the whole sequence, and the fold ran at every step."""
    heads, kv_heads = H, (1 if how == "multi-query" else HKV)
    module = ssm.MultiHeadAttention(H * D, heads, kv_heads).double().eval()
    steps = 3
    x = torch.randn(B, LONG + steps, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    padding = None
    if how == "padding mask":
        padding = torch.rand(B, LONG + steps, generator=torch.Generator().manual_seed(1)) > 0.5
        padding[0] = True  # the first sequence attends to nothing: zeros
    expected = per_head_attention(
        x, x, x, module.weights(), num_heads=heads, num_kv_heads=kv_heads, is_causal=True, key_padding_mask=padding
    )
    cache = module.new_cache(B, LONG + steps)
    with torch.set_grad_enabled(how == "separate"):
        module(
            x[:, :LONG], is_causal=True, kv_cache=cache, key_padding_mask=None if padding is None else padding[:, :LONG]
        )
        kernels_taken.clear()
        got = []
        for i in range(LONG, LONG + steps):
            step = module(
                x[:, i : i + 1],
                is_causal=True,
                kv_cache=cache,
                key_padding_mask=None if padding is None else padding[:, : i + 1],
                need_weights=how == "need_weights",
            )
            got.append(step[0] if how == "need_weights" else step)
    assert not _kernels.native_decodes(B, heads, LONG, D)
    assert kernels_taken == ["folded"] * steps
    torch.testing.assert_close(torch.cat(got, dim=1), expected[:, LONG:], atol=1e-10, rtol=1e-8)


@pytest.mark.skipif(_kernels.TORCH_RELEASE < MEASURED, reason="measured from torch 2.13")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torchs_cpu_kernel_zeroes_rows_with_no_key_itself(dtype: torch.dtype) -> None:
    """Why the native path opens no empty row: torch's CPU kernel gives such a row zeros, value and gradients."""
    q = torch.randn(1, 4, 3, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 5, 8, dtype=dtype, requires_grad=True)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).index_fill(2, torch.tensor([1]), False)
    assert _kernels.zeroes_empty_rows(q, 0.0) and not _kernels.zeroes_empty_rows(q, 0.1)
    out = F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    out.sum().backward()
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert q.grad is not None and k.grad is not None
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1])) and not k.grad.isnan().any()
    module = ssm.MultiHeadAttention(32, 4, 2, bias=False, dtype=dtype)  # no o_proj bias: zero rows stay zero
    x = torch.randn(2, 3, 32, dtype=dtype, requires_grad=True)
    padding = torch.tensor([[True] * 3, [False] * 3])  # the first sequence is padding only
    out = module(x, key_padding_mask=padding)
    out.sum().backward()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and x.grad is not None and not x.grad.isnan().any()


def test_one_query_folded_and_merged_for_an_empty_batch_on_meta() -> None:
    """Where every decode folds (meta stands for the unmeasured devices), an empty batch decodes to an empty
    output of the right shape: the merge names its sizes (a reshape to -1 cannot infer one from 0 elements)."""
    module = ssm.MultiHeadAttention(H * D, H, HKV, device="meta").eval()
    with torch.no_grad():
        out = module(torch.empty(0, 1, H * D, device="meta"), torch.empty(0, 7, H * D, device="meta"))
    assert out.shape == (0, 1, H * D)


@pytest.mark.parametrize("num_kv_heads", [H, HKV, 1])
@pytest.mark.parametrize(
    "how",
    ["plain", "causal", "causal, more keys", "scale", "masked", "window", "softcap", "decode", "decode, many keys"],
)
def test_a_remembered_public_attention_runs_what_its_checked_call_ran(
    num_kv_heads: int, how: str, kernels_taken: list[str]
) -> None:
    """The second call of a signature runs the plan its first, checked call remembered (torch's own call with the
    flags bound, or the stage's body): the same kernels and the same values, the checked call's and a per-head
    loop's. Then the flags changed, the shapes kept: another key, checked again, and computed with the new flags."""
    generator = torch.Generator().manual_seed(0)
    seq, kv_seq = {"causal": (S, S), "decode": (1, KV), "decode, many keys": (1, LONG)}.get(how, (S, KV))
    q = torch.randn(B, H, seq, D, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, num_kv_heads, kv_seq, D, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(B, 1, seq, kv_seq, generator=generator) > 0.3
    flags: dict[str, Any] = {
        "plain": {},
        "causal": {"is_causal": True},
        "causal, more keys": {"is_causal": True},
        "scale": {"scale": 0.3},
        "masked": {"attn_mask": mask},
        "window": {"is_causal": True, "window": 4},
        "softcap": {"softcap": 0.5},
        "decode": {"is_causal": True},
        "decode, many keys": {"is_causal": True},
    }[how]
    first = ssm.scaled_dot_product_attention(q, k, v, **flags)
    checked_kernels = list(kernels_taken)
    kernels_taken.clear()
    again = ssm.scaled_dot_product_attention(q, k, v, **flags)
    assert ssm.scaled_dot_product_attention.exact, "the first call's verdict is remembered"
    assert kernels_taken == checked_kernels
    assert torch.equal(again, first)
    if how not in ("window", "softcap", "scale"):  # what the per-head loop computes: masks and causal only
        reference = _per_head(q, k, v, flags.get("attn_mask"), flags.get("is_causal", False))
        torch.testing.assert_close(again, reference, atol=1e-10, rtol=0)
    other = {"is_causal": not flags.get("is_causal", False), "scale": 0.5}
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(H // num_kv_heads, 1), v.repeat_interleave(H // num_kv_heads, 1), scale=0.5
    )
    changed = ssm.scaled_dot_product_attention(q, k, v, **{**flags, **other})
    if not other["is_causal"] and how not in ("masked", "window", "softcap"):
        torch.testing.assert_close(changed, expected, atol=1e-10, rtol=0)
    else:
        assert not torch.allclose(changed, again)
