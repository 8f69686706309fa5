"""torch.compile(fullgraph=True) works for MHA, GQA and MQA, with and without a cache, with no false check failures."""

from typing import Any

import pytest
import torch

import shapesafe_mha as ssm


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_fullgraph_without_cache_has_no_graph_breaks_and_equals_eager(num_kv_heads: int, grad: bool) -> None:
    """dynamo traces the whole forward (checks are skipped while tracing), and the compiled module equals eager."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(64, 8, num_kv_heads).eval()
    x = torch.randn(2, 6, 64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, -2:] = True
    with torch.set_grad_enabled(grad):
        explanation = torch._dynamo.explain(module)(x, is_causal=True, key_padding_mask=padding)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        for causal in (False, True):
            torch.testing.assert_close(compiled(x, is_causal=causal), module(x, is_causal=causal))
        torch.testing.assert_close(compiled(x, key_padding_mask=padding), module(x, key_padding_mask=padding))


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
def test_fullgraph_decoding_with_a_cache(num_kv_heads: int) -> None:
    """Prefill then token-by-token decoding, compiled with fullgraph, equals eager step for step."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(64, 8, num_kv_heads).eval()
    x = torch.randn(1, 5, 64)
    eager_cache, compiled_cache = module.new_cache(1, 8), module.new_cache(1, 8)

    def step(tokens: torch.Tensor, cache: ssm.KVCache) -> torch.Tensor:
        return module(tokens, is_causal=True, kv_cache=cache)

    explanation = torch._dynamo.explain(step)(x[:, :2], module.new_cache(1, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x[:, :2], compiled_cache), step(x[:, :2], eager_cache))
        for i in range(2, 5):
            torch.testing.assert_close(compiled(x[:, i : i + 1], compiled_cache), step(x[:, i : i + 1], eager_cache))
    assert len(compiled_cache) == len(eager_cache) == 5


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside inductor
def test_inductor_compiles_the_module() -> None:
    """The default backend (inductor) compiles a GQA forward with fullgraph and matches eager."""
    torch.manual_seed(0)
    module = ssm.MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(2, 5, 32)
    compiled = torch.compile(module, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, is_causal=True), module(x, is_causal=True), atol=1e-5, rtol=1e-5)


def test_module_compile_in_place_runs_the_compiled_call() -> None:
    """`module.compile()` compiles in place: every later `module(x)` goes through the compiled call (a call with
    no hook otherwise skips nn.Module's call machinery, which is where that compiled call is taken)."""
    module = ssm.MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(2, 5, 32)
    graphs: list[torch.fx.GraphModule] = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph)
        return graph.forward

    with torch.no_grad():
        eager = module(x, is_causal=True)
        module.compile(fullgraph=True, backend=counting)
        torch.testing.assert_close(module(x, is_causal=True), eager)
        torch.testing.assert_close(module(x, is_causal=True), eager)
    assert len(graphs) == 1


def test_eager_checks_still_run_after_compiling() -> None:
    """Compiling does not switch checks off for eager calls."""
    module = ssm.MultiHeadAttention(32, 4, 2)
    torch.compile(module, fullgraph=True, backend="aot_eager")(torch.randn(1, 3, 32))
    with pytest.raises(ssm.ShapeError, match="query has d_model=30"):
        module(torch.randn(1, 3, 30))
