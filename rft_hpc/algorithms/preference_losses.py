"""Offline preference losses without a reference model: SimPO and ORPO.

Both train on the pairs DPO trains on (rows interleaved chosen, rejected:
`batching.collate_dpo`) and, unlike DPO, need no frozen copy of the policy: the margin is
taken on the policy's own length-normalised log-probabilities. Per pair, `c` and `r` are
the mean log-probs per trained token of the chosen and the rejected response. The loss is
a mean over the pairs of the whole batch (`norm.num_seqs / 2` of them when `norm` is
given), so that micro-batches add up to the batch (`aggregation`). Metrics as DPO's:
`chosen_reward`, `rejected_reward` (the loss's own scale), `accuracy_mean` (pairs whose
margin is positive).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rft_hpc.algorithms.policy_losses import Metrics, PolicyLossInputs, dpo_sequence_logps


def _mean_logps(inputs: PolicyLossInputs) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Each pair's mean log-prob per trained token, chosen and rejected ([P] each), and the
    number of pairs the batch's mean divides by."""
    chosen, rejected = dpo_sequence_logps(inputs.logp, inputs.mask)
    lengths = inputs.mask.sum(-1).clamp(min=1.0).to(chosen.dtype)
    pairs = len(chosen) if inputs.norm is None else inputs.norm.num_seqs / 2
    return chosen / lengths[0::2], rejected / lengths[1::2], max(pairs, 1.0)


def simpo_loss(inputs: PolicyLossInputs, *, beta: float = 2.0, gamma: float = 1.0,
               ) -> tuple[torch.Tensor, Metrics]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", arXiv:2405.14734): `loss = -logsigmoid(beta c - beta r - gamma)`, the reward of
    a response being `beta` times its mean log-prob per token and `gamma` a target margin.
    Defaults in the paper's range (beta 2.0-2.5, gamma / beta about 0.5).
    Metrics: `simpo_loss`, and DPO's with rewards `beta c`, `beta r`."""
    chosen, rejected, pairs = _mean_logps(inputs)
    z = beta * (chosen - rejected) - gamma
    loss = -F.logsigmoid(z).sum() / pairs
    with torch.no_grad():
        metrics = {"chosen_reward": beta * chosen.mean(), "rejected_reward": beta * rejected.mean(),
                   "accuracy_mean": (chosen > rejected).float().mean(),
                   "simpo_loss": loss.detach()}
    return loss, metrics


def orpo_loss(inputs: PolicyLossInputs, *, beta: float = 0.1,
              ) -> tuple[torch.Tensor, Metrics]:
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", arXiv:2403.07691): the chosen response's NLL (per token, averaged over pairs) plus
    `beta` (the paper's lambda, 0.1) times the odds-ratio loss `-logsigmoid(log odds(chosen)
    - log odds(rejected))`, with `odds(y) = P / (1 - P)` and `log P = ` the response's mean
    log-prob per token. Metrics: `orpo_loss`, `orpo_nll`, `log_odds_ratio` (per pair), and
    DPO's with rewards `beta log P`."""
    chosen, rejected, pairs = _mean_logps(inputs)

    def log_odds(logp: torch.Tensor) -> torch.Tensor:  # log(P / (1 - P)), P = exp(logp) < 1
        return logp - torch.log1p(-torch.exp(logp.clamp(max=-1e-6)))

    ratio = log_odds(chosen) - log_odds(rejected)
    nll = -chosen.sum() / pairs
    loss = nll - beta * F.logsigmoid(ratio).sum() / pairs
    with torch.no_grad():
        metrics = {"chosen_reward": beta * chosen.mean(), "rejected_reward": beta * rejected.mean(),
                   "accuracy_mean": (ratio > 0).float().mean(), "log_odds_ratio": ratio.mean(),
                   "orpo_nll": nll.detach(), "orpo_loss": loss.detach()}
    return loss, metrics
