"""SimPO, ORPO (`algorithms/preference_losses.py`) and KTO (`algorithms/kto.py`) against
examples worked by hand, and the direction of each one's gradient on a two-token policy.

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


def test_kto_judges_each_response_against_the_mismatched_reference_point():
    # one trained token a row; rows per pair: chosen, rejected, mismatched (`collate_kto`).
    # r = log p - log p_ref: pair 0 0.5, -1.0, 0.4; pair 1 0.0, 1.0, 0.2; z0 = mean(0.4, 0.2)
    # = 0.3. Losses (beta 0.1): 1 - sigmoid(0.1 (r_c - z0)) = 0.4950002, 0.5074994 for the
    # chosen, 1 - sigmoid(0.1 (z0 - r_r)) = 0.4675457, 0.5174929 for the rejected; mean
    # over the four responses 0.4968845
    logp = torch.tensor([[-1.0], [-2.0], [-3.0], [-0.5], [-1.0], [-2.0]], dtype=torch.float64,
                        requires_grad=True)
    ref = torch.tensor([[-1.5], [-1.0], [-3.4], [-0.5], [-2.0], [-2.2]], dtype=torch.float64)
    mask = torch.ones(6, 1, dtype=torch.float64)
    loss, m = compute_policy_loss("kto", PolicyLossInputs(logp=logp, mask=mask, ref_logp=ref))
    loss.backward()
    assert float(loss) == pytest.approx(0.4968845, abs=1e-7)
    assert m["kto_kl"] == pytest.approx(0.3) and m["accuracy_mean"] == 0.5
    # d/dr of each term: -beta s (1 - s) / 4 responses (chosen), +beta s (1 - s) / 4
    # (rejected); the mismatched rows set the reference point only: no gradient
    want = [[-0.00624938], [0.00622367], [0.0], [-0.00624859], [0.00624235], [0.0]]
    assert torch.allclose(logp.grad, torch.tensor(want, dtype=torch.float64), atol=1e-8)
    # a reference point below 0 is taken as 0 (a KL is never negative)
    _, m = compute_policy_loss("kto", PolicyLossInputs(logp=logp, mask=mask,
                                                       ref_logp=ref + 1.0))
    assert m["kto_kl"] == 0.0


@pytest.mark.parametrize("name", ["simpo", "orpo", "kto"])
def test_a_step_on_each_preference_loss_raises_the_chosen_token(name):
    """A policy over two tokens (logits theta) and one pair: token 0 chosen over token 1
    (KTO: the pair's third row, its mismatched response, is the lone pair's own chosen
    one, and the reference is the policy before the step). One gradient step raises
    p(token 0)."""
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    logp_all = torch.log_softmax(theta, -1)
    rows = [logp_all[0], logp_all[1], logp_all[0]] if name == "kto" else logp_all
    logp = torch.stack(list(rows))[:, None]
    loss, _ = compute_policy_loss(name, PolicyLossInputs(
        logp=logp, mask=torch.ones(len(logp), 1, dtype=torch.float64),
        ref_logp=logp.detach()))
    loss.backward()
    with torch.no_grad():
        after = torch.softmax(theta - 0.5 * theta.grad, -1)
    assert float(after[0]) > 0.5, (name, theta.grad)


def test_kto_rows_are_chosen_rejected_and_the_prompt_with_the_next_pairs_response():
    from rft_hpc.batch.tokens import collate_kto
    from rft_hpc.buffer.records import DPOPair

    tb = collate_kto([DPOPair([1, 2, 3, 4], [1, 2, 5], 2), DPOPair([6, 7, 8], [6, 9, 9, 9], 1)])
    rows = [tb.input_ids[i, :int(tb.attention_mask[i].sum())].tolist() for i in range(6)]
    assert rows == [[1, 2, 3, 4], [1, 2, 5], [1, 2, 7, 8], [6, 7, 8], [6, 9, 9, 9], [6, 3, 4]]
    # the responses are trained (the mask shifted by one, as the targets are)
    assert tb.loss_mask[2].tolist() == [0.0, 1.0, 1.0] and tb.loss_mask[5].tolist() == [
        1.0, 1.0, 0.0]
