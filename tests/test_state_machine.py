"""A warm module equals a fresh one built from the same state, after any sequence of the ways a user changes it.

A hypothesis state machine: its rules are the public ways to change a `MultiHeadAttention` (each route of
writing a projection's parameters, options set, hooks added and removed, train/eval, dtype moves, decoding
steps into a cache, failed calls); after each step the module, warm (its verdicts, its fused view, remembered
from the calls before), computes what a deep copy with nothing remembered computes, and what the per-head
reference computes with the parameters as they are now. A bug of a kind nobody listed, in what is derived and
kept (verdict keys, fused weights, scales, windows), breaks this invariant on some sequence.
"""

import copy
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

import shapesafe_mha as ssm
from shapesafe_mha.reference import per_head_attention

D_MODEL, HEADS, KV_HEADS = 16, 4, 2
TOLERANCE = {"atol": 1e-10, "rtol": 1e-8}


def _outcome(run: Any) -> tuple[str, Any]:
    try:
        return "ok", run()
    except (ssm.ShapeError, ssm.ConfigError, RuntimeError) as error:  # (RuntimeError: raised in a user's wrapper)
        return type(error).__name__, str(error).splitlines()[0]


class Scaled(nn.Module):
    """A projection wrapped with a buffer of its own (a quantized layer's scale, an adapter's): `linear(x) * scale`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("scale", torch.ones(linear.weight.shape[0], dtype=linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _fresh(module: ssm.MultiHeadAttention) -> ssm.MultiHeadAttention:
    """The same parameters, options, hooks and mode, with nothing remembered (a copy carries no verdict)."""
    return copy.deepcopy(module)


@settings(stateful_step_count=12)  # sequences of up to 12 changes; how many, the profile's budget (ci: 50)
class WarmEqualsFresh(RuleBasedStateMachine):
    @initialize(
        options=st.fixed_dictionaries(
            {},
            optional={
                "rope_theta": st.just(10000.0),
                "window": st.integers(1, 6),
                "logit_softcap": st.sampled_from([2.0, 30.0]),
                "query_pre_attn_scalar": st.sampled_from([2.0, 8.0]),
                "attention_sinks": st.just(True),
                "alibi": st.just(True),
            },
        )
    )
    def build(self, options: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.module = ssm.MultiHeadAttention(D_MODEL, HEADS, KV_HEADS, dtype=torch.float64, **options).eval()
        self.cache: ssm.KVCache | None = None
        self.hooks: list[Any] = []
        self.generator = torch.Generator().manual_seed(1)

    def _linear(self, proj: str) -> nn.Linear:
        """The projection's own `nn.Linear` (inside its wrapper, where one was put around it)."""
        module = getattr(self.module, proj)
        return module.linear if isinstance(module, Scaled) else module

    def _x(self, seq: int, width: int = D_MODEL) -> torch.Tensor:
        return torch.randn(2, seq, width, dtype=torch.float64, generator=self.generator)

    # --- writes to the projections, by every route ------------------------------------------------------------

    @rule(proj=st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj"]), route=st.sampled_from(
        ["in place", "through .data", "through .detach()", "a new Parameter", ".data = another tensor"]))  # fmt: skip
    def write_weight(self, proj: str, route: str) -> None:
        weight = self._linear(proj).weight
        with torch.no_grad():
            if route == "in place":
                weight.mul_(1.5)
            elif route == "through .data":
                weight.data.add_(0.25)
            elif route == "through .detach()":
                weight.detach().mul_(-1.0)
            elif route == "a new Parameter":
                self._linear(proj).weight = nn.Parameter(torch.randn_like(weight))
            else:
                weight.data = torch.randn_like(weight)

    @rule()
    def vector_to_parameters_then_written(self) -> None:
        if not all(p.is_contiguous() for p in self.module.parameters()):
            return  # (torch's parameters_to_vector views each parameter flat: contiguous ones only)
        vector = nn.utils.parameters_to_vector(self.module.parameters())
        nn.utils.vector_to_parameters(vector, self.module.parameters())
        self.check_warm_equals_fresh()
        with torch.no_grad():
            vector.mul_(0.5)

    @rule()
    def load_state_dict(self) -> None:
        state = {k: v + 0.125 for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(state)

    @rule()
    def load_state_dict_assigned(self) -> None:
        """`assign=True`: the module's parameters become the given tensors (new objects, new storage)."""
        state = {k: (v * 0.5).clone() for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(state, assign=True)

    @rule(proj=st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj"]), same_address=st.booleans())
    def restrided_through_data(self, proj: str, same_address: bool) -> None:
        """`.data =` another layout: a transpose of a square weight at the same address (the same pointer, shape
        and storage: only the strides differ), or the same values column-major; then a row written in place."""
        weight = self._linear(proj).weight
        if same_address and weight.shape[0] == weight.shape[1]:
            weight.data = weight.data.t()
        else:
            weight.data = weight.data.t().contiguous().t()
        with torch.no_grad():
            weight[0].add_(1.0)

    @rule()
    def own_tensors_written(self) -> None:
        """The module's own tensors (sinks, a parameter; ALiBi's slopes, a buffer), written in place."""
        with torch.no_grad():
            if self.module.sinks is not None:
                self.module.sinks.data.add_(0.5)
            if self.module.alibi_slopes is not None:
                self.module.alibi_slopes.mul_(0.5)

    @rule(proj=st.sampled_from(["q_proj", "v_proj", "o_proj"]))
    def wrapped(self, proj: str) -> None:
        linear = getattr(self.module, proj)
        if isinstance(linear, nn.Linear):
            setattr(self.module, proj, Scaled(linear))

    @rule()
    def wrapped_buffers_written(self) -> None:
        """A wrapped projection's buffer (not a parameter) written in place: what it computes changes."""
        for module in self.module.modules():
            if isinstance(module, Scaled):
                module.scale.mul_(1.5)

    @rule()
    def narrowed_through_data(self) -> None:
        """A weight re-pointed at its first rows: a fresh module refuses the next call; so must the warm one."""
        weight = self._linear("v_proj").weight
        weight.data = weight.data[: weight.shape[0] // 2]

    # --- options, hooks, modes, moves ---------------------------------------------------------------------------

    @rule(name=st.sampled_from(["window", "logit_softcap", "query_pre_attn_scalar", "clip_qkv"]),
          value=st.sampled_from([None, 1, 3, 4.0]))  # fmt: skip
    def set_option(self, name: str, value: Any) -> None:
        before = self.module.config
        outcome = _outcome(lambda: setattr(self.module, name, value))
        if outcome[0] != "ok":  # refused: nothing changed
            assert self.module.config == before

    @rule(name=st.sampled_from(["rope_theta", "qk_norm", "attention_sinks", "output_gate"]))
    def set_an_option_built_into_submodules(self, name: str) -> None:
        before = self.module.config
        value = {"rope_theta": 500.0}.get(name, True)
        assert _outcome(lambda: setattr(self.module, name, value))[0] == "ConfigError"
        assert self.module.config == before

    @rule(proj=st.sampled_from(["q_proj", "o_proj"]))
    def add_hook(self, proj: str) -> None:
        self.hooks.append(getattr(self.module, proj).register_forward_hook(lambda m, a, out: out * 2.0))

    @rule()
    def remove_hook(self) -> None:
        if self.hooks:
            self.hooks.pop().remove()

    @rule(training=st.booleans())
    def mode(self, training: bool) -> None:
        self.module.train(training)

    @rule()
    def moved_through_float32(self) -> None:
        self.module.float().double()

    # --- calls --------------------------------------------------------------------------------------------------

    @rule(width=st.sampled_from([D_MODEL, D_MODEL + 1]))
    def a_call_that_may_fail(self, width: int) -> None:
        with torch.no_grad():
            _outcome(lambda: self.module(self._x(3, width), is_causal=True))

    @rule(steps=st.integers(1, 3))
    def decode(self, steps: int) -> None:
        """Decoding steps into the module's cache: warm and a fresh copy (with a copy of the cache) agree."""
        if self.cache is None:
            self.cache = _outcome(lambda: self.module.new_cache(2, 16))[1]
            if not isinstance(self.cache, ssm.KVCache):
                self.cache = None
                return
        for _ in range(steps):
            if len(self.cache) + 1 > self.cache.capacity and self.module.window is None:
                self.cache = None
                return
            x = self._x(1)
            fresh, fresh_cache = _fresh(self.module), copy.deepcopy(self.cache)
            with torch.no_grad():
                expected = _outcome(lambda x=x, f=fresh, c=fresh_cache: f(x, is_causal=True, kv_cache=c))
                got = _outcome(lambda x=x: self.module(x, is_causal=True, kv_cache=self.cache))
            _same(got, expected)
            if got[0] != "ok":
                self.cache = None
                return

    @invariant()
    def check_warm_equals_fresh(self) -> None:
        x = self._x(5)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                fresh = _fresh(self.module)
                expected = _outcome(lambda f=fresh: f(x, is_causal=True))
                got = _outcome(lambda: self.module(x, is_causal=True))
            _same(got, expected)
        m = self.module
        plain = all(isinstance(getattr(m, p), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        own = m.sinks is None and m.alibi_slopes is None
        if got[0] == "ok" and not self.hooks and not m.training and plain and own:
            reference = per_head_attention(
                x, x, x, m.weights(), num_heads=HEADS, num_kv_heads=KV_HEADS, is_causal=True, rope_theta=m.rope_theta,
                window=m.window, logit_softcap=m.logit_softcap, scale=m.scale, clip_qkv=m.clip_qkv,
            )  # fmt: skip
            torch.testing.assert_close(got[1].detach(), reference, **TOLERANCE)


def _same(got: tuple[str, Any], expected: tuple[str, Any]) -> None:
    assert got[0] == expected[0], (got, expected)
    if got[0] == "ok":
        torch.testing.assert_close(got[1].detach(), expected[1].detach(), **TOLERANCE)
    else:
        assert got[1] == expected[1]


test_warm_module_equals_a_fresh_one_after_any_sequence_of_changes = WarmEqualsFresh.TestCase
