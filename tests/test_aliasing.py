"""Head splitting is a relabelling, not a copy: views alias their input, merge inverts split."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shapesafe_mha as ssm
from shapesafe_mha._core.trace import storage_id
from shapesafe_mha.testing import attention_configs


def _strided_input(batch: int, seq: int, width: int, layout: str, device: str) -> torch.Tensor:
    """A (batch, seq, width) tensor laid out contiguously, transposed, or as a slice of a wider one."""
    if layout == "contiguous":
        return torch.randn(batch, seq, width, device=device)
    if layout == "transposed":
        return torch.randn(seq, batch, width, device=device).transpose(0, 1)
    return torch.randn(batch, seq, 2 * width, device=device)[..., ::2]


@given(
    config=attention_configs(),
    layout=st.sampled_from(["contiguous", "transposed", "every_other_column"]),
)
def test_split_heads_is_a_view_for_every_layout(config, layout: str, any_device: str) -> None:  # type: ignore[no-untyped-def]
    """split_heads shares x's storage (data pointer and storage identity), whatever x's strides."""
    x = _strided_input(config.batch, config.seq, config.num_heads * config.d_head, layout, any_device)
    heads = ssm.split_heads(x, config.num_heads)
    assert heads.shape == (config.batch, config.num_heads, config.seq, config.d_head)
    assert storage_id(heads) == storage_id(x)
    assert heads.data_ptr() == x.data_ptr()


@given(config=attention_configs(), layout=st.sampled_from(["contiguous", "transposed", "every_other_column"]))
def test_writing_through_split_heads_changes_x(config, layout: str, device: str) -> None:  # type: ignore[no-untyped-def]
    """The view writes through: heads[:, h, i, j] is x[:, i, h*d_head + j]."""
    x = _strided_input(config.batch, config.seq, config.num_heads * config.d_head, layout, device)
    heads = ssm.split_heads(x, config.num_heads)
    h, i, j = config.num_heads - 1, config.seq - 1, config.d_head - 1
    heads[:, h, i, j] = 123.0
    assert torch.all(x[:, i, h * config.d_head + j] == 123.0)


@given(config=attention_configs(), layout=st.sampled_from(["contiguous", "transposed", "every_other_column"]))
def test_merge_inverts_split(config, layout: str, device: str) -> None:  # type: ignore[no-untyped-def]
    """merge_heads(split_heads(x)) == x exactly, and split_heads(merge_heads(h)) == h."""
    x = _strided_input(config.batch, config.seq, config.num_heads * config.d_head, layout, device)
    assert torch.equal(ssm.merge_heads(ssm.split_heads(x, config.num_heads)), x)
    heads = torch.randn(config.batch, config.num_heads, config.seq, config.d_head, device=device)
    assert torch.equal(ssm.split_heads(ssm.merge_heads(heads), config.num_heads), heads)


@given(config=attention_configs(), layout=st.sampled_from(["contiguous", "transposed", "every_other_column"]))
def test_splitting_a_fused_projection_is_splitting_each_projection(config, layout: str, device: str) -> None:  # type: ignore[no-untyped-def]
    """The fused path's split of Q, K and V into heads at once gives the very views that separating Q, K and V
    and then splitting each would: the same storage, offset, shape and strides (of every axis longer than 1: the
    stride of a length-1 axis addresses nothing), for every layout of the input."""
    from shapesafe_mha._compute import kernels

    widths = [config.num_heads * config.d_head, config.num_kv_heads * config.d_head]
    qkv = _strided_input(config.batch, config.seq, widths[0] + 2 * widths[1], layout, device)
    at_once = kernels.split_fused(qkv, config.num_heads, config.num_kv_heads)
    q, k, v = qkv.split_with_sizes([widths[0], widths[1], widths[1]], dim=-1)
    each = (ssm.split_heads(q, config.num_heads), *(ssm.split_heads(t, config.num_kv_heads) for t in (k, v)))
    for fused, separate in zip(at_once, each, strict=True):
        assert storage_id(fused) == storage_id(qkv)
        assert fused.storage_offset() == separate.storage_offset()
        assert fused.shape == separate.shape
        steps = [(a, b) for a, b, n in zip(fused.stride(), separate.stride(), fused.shape, strict=True) if n > 1]
        assert all(a == b for a, b in steps)


def test_merge_right_after_split_is_a_view(any_device: str) -> None:
    """Merging data still laid out (batch, seq, heads, d_head) moves nothing."""
    x = torch.randn(2, 5, 32, device=any_device)
    assert storage_id(ssm.merge_heads(ssm.split_heads(x, 4))) == storage_id(x)


def test_merge_after_attention_copies(any_device: str) -> None:
    """Attention output is laid out head by head, so bringing heads back beside d_head must copy."""
    out = torch.randn(2, 4, 5, 8, device=any_device)  # (batch, heads, seq, d_head), contiguous
    merged = ssm.merge_heads(out)
    assert storage_id(merged) != storage_id(out)


def test_group_queries_is_a_view(any_device: str) -> None:
    """The GQA grouping of query heads is a view of the queries."""
    q = ssm.split_heads(torch.randn(2, 5, 64, device=any_device), 8)
    grouped = ssm.group_queries(q, num_kv_heads=2)
    assert grouped.shape == (2, 2, 4, 5, 8)
    assert storage_id(grouped) == storage_id(q)
    assert grouped.flatten(1, 2).shape == q.shape


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_which_stages_copy_is_what_the_trace_observes(num_kv_heads: int) -> None:
    """State exactly which stages copy: the projections and the final merge (on meta) allocate; splits do not."""
    report = ssm.trace_forward(ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=num_kv_heads, seq=6))
    stages = {s.name: s for s in report.stages}
    # Inference self-attention projects Q, K and V with one fused matmul; each one's heads are a view of it.
    for name in ("split_q", "split_k", "split_v"):
        assert stages[name].aliases == "qkv_proj" and stages[name].allocated_bytes == 0
    for name in ("qkv_proj", "o_proj", "merge"):
        assert stages[name].aliases is None and stages[name].allocated_bytes >= stages[name].nbytes
    if num_kv_heads < 8:
        assert stages["group_queries"].aliases == "split_q"


def test_the_trace_observes_a_copying_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace's view/copy column is observed, not assumed: a split that copies shows as a new allocation."""
    import shapesafe_mha._compute.kernels as kernels

    honest = kernels.split_fused  # what the trace's inference forward splits its fused projection with
    monkeypatch.setattr(kernels, "split_fused", lambda x, h, kv: tuple(t.contiguous() for t in honest(x, h, kv)))
    report = ssm.trace_forward(ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=6))
    split_q = next(s for s in report.stages if s.name == "split_q")
    assert split_q.aliases is None and split_q.allocated_bytes >= split_q.nbytes


def test_the_trace_opens_with_the_query_by_its_named_dimensions() -> None:
    """The first row of a module's trace is its input, the query, named (batch, seq, d_model) with the sizes given."""
    report = ssm.trace_forward(ssm.TraceConfig(d_model=64, num_heads=8, num_kv_heads=2, seq=6))
    first = report.stages[0]
    assert (first.name, first.named_shape, tuple(first.shape)) == ("query", "batch seq d_model", (1, 6, 64))
