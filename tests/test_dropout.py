"""Dropout as a distribution: in training, attention weights are dropped at the rate asked, on every path.

With one-hot values (a key's value is its own indicator), the output row of a query is its attention weights
after dropout, so the fraction of zeros is the fraction dropped and the mean is the weights' expectation.
Each is compared with p within 5 binomial standard deviations, on every route (the public stage, the module
with and without autograd: its separate and fused paths), and against torch's own SDPA dropout; eval drops
nothing. Seeds are fixed: the bounds hold for these draws, and a rate off by a bug (dropout in eval, the wrong
p, 1 - p, no rescale) lands far outside them.
"""

import math

import pytest
import torch

import shapesafe_mha as ssm

SEQ, BATCH = 24, 16  # kv_seq = SEQ keys, one-hot values of width SEQ


def _uniform_scores() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q = k = 0 (every weight 1/SEQ), v = the identity: `out[..., i, j]` is query i's weight on key j."""
    q = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.float64)
    v = torch.eye(SEQ, dtype=torch.float64).expand(BATCH, 1, SEQ, SEQ).contiguous()
    return q, q.clone(), v


def _one_hot_module(p: float) -> tuple[ssm.MultiHeadAttention, torch.Tensor]:
    """One head of width SEQ, q/k projections 0, v and o projections the identity, no biases: the module's
    output for one-hot inputs is the dropped weights, as the stage's above."""
    module = ssm.MultiHeadAttention(SEQ, 1, dropout=p, bias=False, dtype=torch.float64)
    with torch.no_grad():
        module.q_proj.weight.zero_()
        module.k_proj.weight.zero_()
        module.v_proj.weight.copy_(torch.eye(SEQ))
        module.o_proj.weight.copy_(torch.eye(SEQ))
    x = torch.eye(SEQ, dtype=torch.float64).expand(BATCH, SEQ, SEQ).contiguous()
    return module, x


def _route(name: str, p: float, training: bool) -> torch.Tensor:
    torch.manual_seed(0)
    if name == "stage":
        q, k, v = _uniform_scores()
        return ssm.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0)
    if name == "torch's SDPA":
        q, k, v = _uniform_scores()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0)
    module, x = _one_hot_module(p)
    module.train(training)
    with torch.set_grad_enabled(name == "module, autograd"):
        return module(x).detach()


ROUTES = ["stage", "torch's SDPA", "module, autograd", "module, no grad"]


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("route", ROUTES)
def test_weights_are_dropped_at_the_rate_asked_and_rescaled(route: str, p: float) -> None:
    out = _route(route, p, training=True)
    n = out.numel()
    dropped = float((out == 0).double().mean())
    bound = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) <= bound, (dropped, p, bound)
    kept = out[out != 0]  # each kept weight is 1/SEQ scaled by 1 / (1 - p)
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / SEQ / (1 - p)))
    # the mean is the weights' expectation, 1 / SEQ: within the same binomial bound, scaled
    mean = float(out.mean())
    assert abs(mean - 1 / SEQ) <= bound / (1 - p) / SEQ, mean


@pytest.mark.parametrize("route", ROUTES)
def test_eval_drops_nothing(route: str) -> None:
    out = _route(route, 0.5, training=False)
    torch.testing.assert_close(out, torch.full_like(out, 1 / SEQ))
