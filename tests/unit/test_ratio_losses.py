"""GSPO, CISPO, SAPO, Clip-Cov and KL-Cov (`algorithms/ratio_losses.py`) against examples
worked by hand, and the direction of each one's gradient on a two-token policy.

The worked examples share two rows of two trained tokens: log-ratios `d = log r` of
[[0.1, -0.3], [0.2, 0.0]] (KL-Cov: [[0.1, -0.3], [0.2, 0.4]]), log-probs
[[-1.0, -2.0], [-0.5, -1.5]], advantages +1 and -1 per row (Clip-Cov, KL-Cov: +2, -2).
"""

from __future__ import annotations

import math

import pytest
import torch

from rft_hpc.algorithms.policy_losses import PolicyLossInputs
from rft_hpc.algorithms.registry import compute_policy_loss

D = torch.tensor([[0.1, -0.3], [0.2, 0.0]], dtype=torch.float64)
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
MASK = torch.ones(2, 2, dtype=torch.float64)


def _inputs(d=D, logp=LOGP, adv=(1.0, -1.0)) -> PolicyLossInputs:
    logp = logp.clone().requires_grad_(True)
    return PolicyLossInputs(logp=logp, mask=MASK, old_logp=(logp - d).detach(),
                            advantages=torch.tensor(adv, dtype=torch.float64))


def _loss_and_grad(name: str, inputs: PolicyLossInputs, **args):
    loss, metrics = compute_policy_loss(name, inputs, **args)
    loss.backward()
    return float(loss.detach()), inputs.logp.grad, {k: float(v) for k, v in metrics.items()}


def _grad_is(grad: torch.Tensor, expected: list[list[float]], tol: float = 1e-6) -> bool:
    return torch.allclose(grad, torch.tensor(expected, dtype=grad.dtype), atol=tol, rtol=0.0)


def test_gspo_clips_one_ratio_per_sequence():
    # s_0 = exp((0.1 - 0.3) / 2) = 0.904837, s_1 = exp((0.2 + 0.0) / 2) = 1.105171
    # wide range (0.2): nothing clipped; loss = mean over rows of the token means of -A s:
    # (-0.904837 + 1.105171) / 2 = 0.100167; d/dlogp_t = -A s_i / (2 rows * 2 tokens)
    loss, grad, m = _loss_and_grad("gspo", _inputs(), clip_range_low=0.2, clip_range_high=0.2)
    assert loss == pytest.approx(0.100167, abs=1e-6)
    assert _grad_is(grad, [[-0.226209, -0.226209], [0.276293, 0.276293]])
    assert m["clip_fraction"] == 0.0 and m["seq_ratio_mean"] == pytest.approx(1.005004, abs=1e-6)
    # A = -1, +1 with a range of 0.05: s_0 < 0.95 with A < 0 and s_1 > 1.05 with A > 0 are
    # both clipped: loss (0.95 - 1.05) / 2 = -0.05, and no gradient at all
    loss, grad, m = _loss_and_grad("gspo", _inputs(adv=(-1.0, 1.0)), clip_range_low=0.05,
                                   clip_range_high=0.05)
    assert loss == pytest.approx(-0.05, abs=1e-9) and m["clip_fraction"] == 1.0
    assert _grad_is(grad, [[0.0, 0.0], [0.0, 0.0]], 0.0)


def test_gspo_per_sequence_ratio_is_the_geometric_mean_over_trained_tokens_only():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    logp = LOGP.clone().requires_grad_(True)
    inputs = PolicyLossInputs(logp=logp, mask=mask, old_logp=(logp - D).detach(),
                              advantages=torch.tensor([1.0, 1.0], dtype=torch.float64))
    loss, metrics = compute_policy_loss("gspo", inputs, clip_range_low=0.5, clip_range_high=0.5)
    # s_1 = exp(0.2) (its one trained token): (-0.904837 - 1.221403) / 2
    assert float(loss) == pytest.approx(-(0.904837 + 1.221403) / 2, abs=1e-6)
    assert float(metrics["seq_ratio_mean"]) == pytest.approx((0.904837 + 1.221403) / 2, abs=1e-6)


def test_cispo_caps_the_detached_weight_and_keeps_every_gradient():
    # w = min(r, 1.1), no lower bound: [[1.1, 0.740818], [1.1, 1.0]]; l = -A w logp:
    # [[1.1, 1.481636], [-0.55, -1.5]], token mean 0.132909; d/dlogp = -A w / 4
    loss, grad, m = _loss_and_grad("cispo", _inputs(), clip_range_high=0.1)
    assert loss == pytest.approx(0.132909, abs=1e-6)
    assert _grad_is(grad, [[-0.275, -0.185205], [0.275, 0.25]])
    assert m["clip_fraction"] == 0.5  # two of the four weights capped, none without gradient
    # a lower bound of 1 - 0.2 lifts r = 0.740818 to 0.8: l_01 = 0.8 * 2
    loss, _, m = _loss_and_grad("cispo", _inputs(), clip_range_low=0.2, clip_range_high=0.1)
    assert loss == pytest.approx((1.1 + 1.6 - 0.55 - 1.5) / 4, abs=1e-6)
    assert m["clip_fraction"] == 0.75


def test_sapo_gates_softly_with_a_temperature_per_sign():
    # f(r) = (4 / tau) sigmoid(tau (r - 1)), tau 1 (A > 0), 1.05 (A < 0); l = -f(r) A:
    # [[-2.105074, -1.742259], [2.125173, 1.904762]]; mean of row means 0.045650
    # d l / d logp = -A f'(r) r, f'(r) = 4 sigmoid (1 - sigmoid), over 2 rows x 2 tokens
    loss, grad, m = _loss_and_grad("sapo", _inputs())
    assert loss == pytest.approx(0.045650, abs=1e-6)
    assert _grad_is(grad, [[-0.275530, -0.182129], [0.301262, 0.25]])
    assert 0.9 < m["gate_mean"] < 1.0  # f'(r) = 4 sigmoid (1 - sigmoid) <= 1, near 1 here
    with pytest.raises(ValueError, match="tau"):
        compute_policy_loss("sapo", _inputs(), tau_neg=0.0)


def test_sapo_gradient_at_ratio_one_is_the_policy_gradient():
    inputs = _inputs(d=torch.zeros(2, 2, dtype=torch.float64))
    _, sapo, _ = _loss_and_grad("sapo", inputs, loss_agg_mode="token-mean")
    pg = _inputs(d=torch.zeros(2, 2, dtype=torch.float64))
    _, ppo, _ = _loss_and_grad("ppo", pg)
    assert torch.allclose(sapo, ppo, atol=1e-12, rtol=0.0)


LOGP_COV = torch.tensor([[-0.1, -0.2], [-2.0, -2.5]], dtype=torch.float64)
"""With advantages +2, -2 the covariances (A - 0)(logp + 1.2) are [[2.2, 2.0], [1.6, 2.6]]."""


def test_clip_cov_cuts_the_gradient_of_drawn_tokens_in_the_covariance_band():
    args = {"clip_cov_ratio": 0.5, "clip_cov_lb": 1.0, "clip_cov_ub": 2.5}
    inputs = _inputs(d=torch.zeros(2, 2, dtype=torch.float64), logp=LOGP_COV, adv=(2.0, -2.0))
    loss, grad, m = _loss_and_grad("clip_cov", inputs, **args)
    cut = {(i, t) for i in range(2) for t in range(2) if float(grad[i, t]) == 0.0}
    # 0.5 x 4 tokens = 2 cut, both from the band (1, 2.5): never (1, 1), whose cov is 2.6
    assert len(cut) == 2 and (1, 1) not in cut and m["cov_clip_fraction"] == 0.5
    kept = [(i, t) for i in range(2) for t in range(2) if (i, t) not in cut]
    # ratio 1: each kept token's loss is -A, its gradient -A / 4
    assert loss == pytest.approx(sum(-(2.0, -2.0)[i] for i, _ in kept) / 4, abs=1e-12)
    assert all(float(grad[i, t]) == pytest.approx(-(2.0, -2.0)[i] / 4) for i, t in kept)
    again = _inputs(d=torch.zeros(2, 2, dtype=torch.float64), logp=LOGP_COV, adv=(2.0, -2.0))
    assert torch.equal(_loss_and_grad("clip_cov", again, **args)[1], grad)  # the same draw
    # tokens PPO clips are never drawn: with every ratio far outside the clip, none is cut
    far = _inputs(d=torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64),
                  logp=LOGP_COV, adv=(2.0, -2.0))
    assert _loss_and_grad("clip_cov", far, **args)[2]["cov_clip_fraction"] == 0.0


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    # d = [[0.1, -0.3], [0.2, 0.4]], A = +2, -2: l = -A r = [[-2.210342, -1.481636],
    # [2.442806, 2.983649]]; the top quarter (1 token) by covariance is (1, 1) (2.6):
    # + 1.0 * |0.4|; token mean 0.533619; its gradient (-A r + |d|') / 4 = 0.995912
    d = torch.tensor([[0.1, -0.3], [0.2, 0.4]], dtype=torch.float64)
    loss, grad, m = _loss_and_grad("kl_cov", _inputs(d=d, logp=LOGP_COV, adv=(2.0, -2.0)),
                                   kl_cov_ratio=0.25)
    assert loss == pytest.approx(0.533619, abs=1e-6)
    assert float(grad[1, 1]) == pytest.approx(0.995912, abs=1e-6)
    assert float(grad[0, 0]) == pytest.approx(-2 * math.exp(0.1) / 4, abs=1e-9)
    assert m["kl_cov_fraction"] == 0.25 and m["kl_cov_abs_kl"] == pytest.approx(0.4)


@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo", "clip_cov", "kl_cov"])
def test_a_step_on_each_loss_raises_the_rewarded_token(name):
    """A policy over two tokens (logits theta), two rollouts: token 0 with advantage +1,
    token 1 with -1, sampled by the current policy (ratio 1). One gradient step on the loss
    raises p(token 0)."""
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    logp_all = torch.log_softmax(theta, -1)
    logp = torch.stack([logp_all[0], logp_all[1]])[:, None]  # [2 rollouts, 1 token]
    inputs = PolicyLossInputs(logp=logp, mask=torch.ones(2, 1, dtype=torch.float64),
                              old_logp=logp.detach(),
                              advantages=torch.tensor([1.0, -1.0], dtype=torch.float64))
    loss, _ = compute_policy_loss(name, inputs)
    loss.backward()
    with torch.no_grad():
        after = torch.softmax(theta - 0.5 * theta.grad, -1)
    assert float(after[0]) > 0.5, (name, theta.grad)
