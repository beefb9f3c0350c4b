"""SimPO and ORPO (`algorithms/preference_losses.py`) against an example worked by hand, and
the direction of each one's gradient on a two-token policy.

Two pairs, rows interleaved chosen, rejected: pair 0 chosen log-probs [-1.0, -2.0] (mean
-1.5), rejected [-0.5, -1.5] (mean -1.0); pair 1 chosen [-0.2] (one trained token, mean
-0.2), rejected [-3.0, -1.0] (mean -2.0).
"""

from __future__ import annotations

import math

import pytest
import torch

from rft_hpc.algorithms.policy_losses import PolicyLossInputs
from rft_hpc.algorithms.registry import compute_policy_loss

LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-0.2, -9.0], [-3.0, -1.0]],
                    dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)


def _run(name: str, **args):
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, PolicyLossInputs(logp=logp, mask=MASK), **args)
    loss.backward()
    return float(loss.detach()), logp.grad, {k: float(v) for k, v in metrics.items()}


def test_simpo_is_a_sigmoid_loss_on_the_length_normalised_margin():
    # z = beta (c - r) - gamma = 2 (-1.5 + 1.0) - 1 = -2.0 and 2 (-0.2 + 2.0) - 1 = 2.6;
    # loss = mean of -logsigmoid(z) = (2.126928 + 0.071645) / 2 = 1.099286
    loss, grad, m = _run("simpo")
    assert loss == pytest.approx(1.099286, abs=1e-6)
    # d loss / d c = -beta sigmoid(-z) / 2 pairs = -0.880797 and -0.069138, spread over the
    # response's trained tokens; the rejected rows get the opposite
    want = torch.tensor([[-0.440399, -0.440399], [0.440399, 0.440399],
                         [-0.069138, 0.0], [0.034569, 0.034569]], dtype=torch.float64)
    assert torch.allclose(grad, want, atol=1e-6, rtol=0.0)
    assert m["accuracy_mean"] == 0.5 and m["chosen_reward"] == pytest.approx(2 * -0.85)
    assert m["simpo_loss"] == pytest.approx(loss)


def test_orpo_adds_the_odds_ratio_to_the_chosen_nll():
    # log odds(y) = log P - log(1 - P), log P the mean log-prob: pair 0: -1.5 vs -1.0 ->
    # ratio -0.706193; pair 1: -0.2 vs -2.0 -> 3.362358. NLL = (1.5 + 0.2) / 2 = 0.85;
    # loss = 0.85 - 0.1 * mean(logsigmoid(ratio)) = 0.907070
    loss, grad, m = _run("orpo")
    assert loss == pytest.approx(0.907070, abs=1e-6)
    assert m["orpo_nll"] == pytest.approx(0.85) and m["accuracy_mean"] == 0.5
    assert m["log_odds_ratio"] == pytest.approx((-0.706193 + 3.362358) / 2, abs=1e-6)
    # the NLL pulls every chosen token up: -1/2 pairs / 2 tokens from it alone, more from
    # the odds term where the rejected response is the likelier
    assert float(grad[0, 0]) < -0.25 and float(grad[1, 0]) > 0.0
    assert float(grad[2, 1]) == 0.0  # untrained token
    # the odds-ratio term alone: beta = 0 leaves the NLL, whose gradient is -1 / (2 * len)
    _, grad0, _ = _run("orpo", beta=0.0)
    assert float(grad0[0, 0]) == pytest.approx(-0.25) and float(grad0[1, 0]) == 0.0
    assert math.isfinite(loss)


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_a_step_on_each_preference_loss_raises_the_chosen_token(name):
    """A policy over two tokens (logits theta) and one pair: token 0 chosen over token 1.
    One gradient step raises p(token 0)."""
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    logp_all = torch.log_softmax(theta, -1)
    logp = torch.stack([logp_all[0], logp_all[1]])[:, None]
    loss, _ = compute_policy_loss(name, PolicyLossInputs(
        logp=logp, mask=torch.ones(2, 1, dtype=torch.float64)))
    loss.backward()
    with torch.no_grad():
        after = torch.softmax(theta - 0.5 * theta.grad, -1)
    assert float(after[0]) > 0.5, (name, theta.grad)
