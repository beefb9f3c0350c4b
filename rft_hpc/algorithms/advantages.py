"""Advantage functions: from rewards (and a critic's values) to per-token advantages.

Every function takes an `AdvantageBatch` and keyword parameters (Trinity-RFT's
`advantage_fn_args`) and returns `Advantages(advantages, returns)`, both [B, T] with T = L-1
the shifted length of a `TokenBatch` and 0 wherever `mask` is 0. Advantages are computed over
the whole batch (group statistics, whitening) before it is split into micro-batches.

Rewards: one per record, earned at the record's last trained token. A per-token KL penalty
(`kl.kl_reward_penalty`) is subtracted token by token; the outcome methods (GRPO, RLOO, OPMD)
score a record by its reward minus its summed penalty, as verl does.

Multi-turn records (mask 0 on tool/environment tokens inside the response): GAE and
REINFORCE++ skip untrained tokens, as if they were not there (no discount, no value), as
verl's masked GAE does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from rft_hpc.algorithms.aggregation import masked_whiten


@dataclass(frozen=True)
class AdvantageBatch:
    """What an advantage function reads (all per-token tensors [B, T], T = L-1)."""

    rewards: torch.Tensor  # [B] one reward per record
    mask: torch.Tensor  # [B, T] 1 on trained (response) tokens, TokenBatch.loss_mask
    group_ids: torch.Tensor | None = None  # [B] records of one task share an id (GRPO...)
    values: torch.Tensor | None = None  # [B, T] critic values V(s_j) at each position (GAE)
    kl_penalty: torch.Tensor | None = None  # [B, T] per-token penalty (kl_reward_penalty)
    baselines: torch.Tensor | None = None  # [B] ReMax: the greedy response's reward per record
    # [B, T] on-policy distillation: a teacher's and the rollout policy's log-prob of each
    # target token (the records' `teacher_logprobs` and `logprobs`, shifted as `mask`)
    teacher_logprobs: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    def scores(self) -> torch.Tensor:
        """Each record's score [B] float64: its reward minus its summed KL penalty."""
        score = self.rewards.detach().to(torch.float64)
        if self.kl_penalty is not None:
            score = score - (self.kl_penalty.detach().to(torch.float64) * self.mask).sum(-1)
        return score

    def token_rewards(self) -> torch.Tensor:
        """Per-token rewards [B, T] float64: the reward at each record's last trained token,
        minus the KL penalty on every trained token. A record without trained tokens gets
        none."""
        mask = self.mask > 0
        t = mask.shape[-1]
        last = (torch.arange(t, device=mask.device) * mask).argmax(-1)
        out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        has_any = mask.any(-1)
        rows = torch.arange(mask.shape[0], device=mask.device)[has_any]
        out[rows, last[has_any]] = self.rewards.detach().to(torch.float64)[has_any]
        if self.kl_penalty is not None:
            out = out - self.kl_penalty.detach().to(torch.float64) * mask
        return out

    def need_groups(self, name: str) -> torch.Tensor:
        """`group_ids`, or a ValueError naming the advantage function `name` that needs them."""
        if self.group_ids is None:
            raise ValueError(f"the {name} advantage needs group_ids")
        if self.group_ids.shape != self.rewards.shape or self.rewards.dim() != 1:
            raise ValueError(f"rewards {tuple(self.rewards.shape)} and group_ids "
                             f"{tuple(self.group_ids.shape)} must be equal-length vectors")
        return self.group_ids


class Advantages(NamedTuple):
    """Per-token advantages and returns [B, T] float32, 0 on untrained tokens. For the
    outcome methods (no critic) the returns equal the advantages, as in verl."""

    advantages: torch.Tensor
    returns: torch.Tensor


def _per_token(seq_adv: torch.Tensor, mask: torch.Tensor) -> Advantages:
    adv = (seq_adv[:, None] * (mask > 0)).to(torch.float32)
    return Advantages(adv, adv)


class _Groups(NamedTuple):
    index: torch.Tensor  # [B] group number 0..G-1 of each record
    count: torch.Tensor  # [G] float64 records per group

    def sum(self, values: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
        """Per-group reduction [G] of the float64 per-record `values`."""
        init = {"sum": 0.0, "amax": -torch.inf, "amin": torch.inf}[reduce]
        out = torch.full(self.count.shape, init, dtype=torch.float64, device=values.device)
        return out.scatter_reduce(0, self.index, values, reduce)


def _groups(group_ids: torch.Tensor) -> _Groups:
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max()) + 1 if len(index) else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=group_ids.device)
    return _Groups(index, count.index_add_(0, index, torch.ones_like(count[index])))


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6,
                    std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantage of each rollout relative to the rollouts of its group [B].

    `A_i = (r_i - mean_g) / (std_g + eps)`, where g is i's group, `mean_g` and `std_g` the
    mean and population standard deviation (divide by n, not n-1) of the group's rewards;
    `A_i = r_i - mean_g` without `std_normalize`. A group whose rewards are all equal
    (a single rollout included) gets exactly 0. Computed in float64, returned as float32.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids "
                         f"{tuple(group_ids.shape)} must be equal-length vectors")
    r = rewards.detach().to(torch.float64)
    groups = _groups(group_ids)
    centered = r - (groups.sum(r) / groups.count)[groups.index]
    adv = centered
    if std_normalize:
        std = (groups.sum(centered**2) / groups.count).sqrt()
        adv = centered / (std[groups.index] + eps)
    equal = (groups.sum(r, "amax") == groups.sum(r, "amin"))[groups.index]
    return torch.where(equal, 0.0, adv).to(torch.float32)


def grpo(batch: AdvantageBatch, *, epsilon: float = 1e-6,
         std_normalize: bool = True) -> Advantages:
    """GRPO: `(score - group mean) / (group std + epsilon)` on every trained token.

    See `grpo_advantages` (population std; a group of equal scores, a single rollout
    included, gets exactly 0, where verl/Trinity-RFT divide by the n-1 std and give a lone
    rollout its raw score). `std_normalize=False` is Dr. GRPO's mean-centring only.
    """
    groups = batch.need_groups("grpo")
    return _per_token(grpo_advantages(batch.scores(), groups, epsilon, std_normalize),
                      batch.mask)


def rloo(batch: AdvantageBatch) -> Advantages:
    """RLOO: each score minus the mean score of the *other* rollouts of its group,
    `r_i - (sum_g - r_i) / (n_g - 1)`, on every trained token. A group of one keeps its raw
    score (no baseline exists), as in verl/Trinity-RFT."""
    r = batch.scores()
    groups = _groups(batch.need_groups("rloo"))
    n = groups.count[groups.index]
    others = (groups.sum(r)[groups.index] - r) / (n - 1).clamp(min=1.0)
    return _per_token(torch.where(n > 1, r - others, r), batch.mask)


def remax(batch: AdvantageBatch) -> Advantages:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models", arXiv:2310.10505): each score minus
    the reward of the greedy response to the same prompt, `r_i - r(greedy)`, on every trained
    token; no normalisation. The explorer generates and scores the greedy response of each
    group when the algorithm is `remax` (`AdvantageBatch.baselines`)."""
    if batch.baselines is None:
        raise ValueError("the remax advantage needs baselines: the reward of the greedy "
                         "response to each record's prompt")
    return _per_token(batch.scores() - batch.baselines.detach().to(torch.float64), batch.mask)


def on_policy_distill(batch: AdvantageBatch, *, kl_coef: float = 1.0,
                      reward_weight: float = 0.0, epsilon: float = 1e-6) -> Advantages:
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes", arXiv:2306.13649; Gu et al. 2024,
    MiniLLM, arXiv:2306.08543; as Thinking Machines' "On-Policy Distillation", 2025, runs
    it): the student samples, a teacher scores each sampled token, and each trained token's
    advantage is the negative of its reverse-KL estimate, `kl_coef * (log p_teacher(x_t) -
    log p_student(x_t))`, its own (no discount, no baseline): tokens the teacher finds more
    likely than the student are pushed up, the others down. With `reward_weight` > 0, GRPO's
    advantage of the record's reward (`epsilon`) times it is added on every trained token.
    The student's log-probs are the rollout's (the policy that sampled)."""
    if batch.teacher_logprobs is None or batch.logprobs is None:
        raise ValueError("the on_policy_distill advantage needs the teacher's and the "
                         "rollout policy's log-prob of each token")
    mask = (batch.mask > 0).to(torch.float64)
    gap = batch.teacher_logprobs.detach().to(torch.float64) - \
        batch.logprobs.detach().to(torch.float64)
    adv = kl_coef * gap * mask
    if reward_weight:
        adv = adv + reward_weight * grpo(batch, epsilon=epsilon).advantages.to(torch.float64)
    adv = adv.to(torch.float32)
    return Advantages(adv, adv)


def opmd(batch: AdvantageBatch, *, opmd_baseline: Literal["mean", "logavgexp"] = "mean",
         tau: float = 1.0) -> Advantages:
    """OPMD (Trinity-RFT): each score minus its group's baseline, on every trained token.

    Baseline `mean`: the group's mean score; `logavgexp`: `tau * log(mean(exp(r / tau)))`, a
    soft maximum. A group of one gets baseline 0 (its raw score), as in Trinity-RFT.
    """
    r = batch.scores()
    groups = _groups(batch.need_groups("opmd"))
    if opmd_baseline == "mean":
        baseline = groups.sum(r) / groups.count
    elif opmd_baseline == "logavgexp":
        # logavgexp = log(sum exp(r/tau)) - log(n), via a per-group max for stability
        z = r / tau
        top = groups.sum(z, "amax")
        baseline = tau * ((groups.sum((z - top[groups.index]).exp())).log() + top
                          - groups.count.log())
    else:
        raise ValueError(f"unknown opmd_baseline {opmd_baseline!r}; use mean or logavgexp")
    baseline = torch.where(groups.count > 1, baseline, 0.0)
    return _per_token(r - baseline[groups.index], batch.mask)


def _reverse_scan(mask: torch.Tensor, step) -> None:
    """Call `step(t, trained)` for t = T-1 .. 0 with the [B] bool column `trained`."""
    for t in reversed(range(mask.shape[-1])):
        step(t, mask[:, t] > 0)


def reinforce_plus_plus(batch: AdvantageBatch, *, gamma: float = 1.0) -> Advantages:
    """REINFORCE++: discounted returns-to-go of the token rewards, whitened over the batch.

    `G_t = r_t + gamma * G_{t+1}` over the trained tokens of each record (untrained tokens are
    skipped: no reward, no discount); the advantages are the `G_t` whitened with the mean and
    unbiased std over all trained tokens of the batch (`masked_whiten`). Per-token KL in the
    reward enters through `batch.kl_penalty`. Returns: the `G_t`.
    """
    rewards = batch.token_rewards()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float64, device=rewards.device)

    def step(t: int, trained: torch.Tensor) -> None:
        nonlocal running
        running = torch.where(trained, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(trained, running, 0.0)

    _reverse_scan(batch.mask, step)
    adv = masked_whiten(returns, batch.mask)
    return Advantages(adv.to(torch.float32), returns.to(torch.float32))


def gae(batch: AdvantageBatch, *, gamma: float = 1.0, lam: float = 1.0,
        whiten: bool = True) -> Advantages:
    """Generalized advantage estimation with the critic's `batch.values` (PPO).

    Over the trained tokens t of a record, with t' the next trained token (none after the
    last: `V(t') = 0`): `delta_t = r_t + gamma * V(t') - V(t)`,
    `A_t = delta_t + gamma * lam * A_{t'}`; returns `R_t = A_t + V(t)` (the critic's targets).
    With `whiten` (verl's and Trinity-RFT's default) the advantages are then whitened over
    all trained tokens of the batch; the returns never are.
    """
    if batch.values is None:
        raise ValueError("the GAE (ppo) advantage needs the critic's values")
    rewards = batch.token_rewards()
    values = batch.values.detach().to(torch.float64)
    adv = torch.zeros_like(rewards)
    b = rewards.shape[0]
    next_value = torch.zeros(b, dtype=torch.float64, device=rewards.device)
    last_gae = torch.zeros_like(next_value)

    def step(t: int, trained: torch.Tensor) -> None:
        nonlocal next_value, last_gae
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(trained, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(trained, values[:, t], next_value)
        adv[:, t] = torch.where(trained, last_gae, 0.0)

    _reverse_scan(batch.mask, step)
    returns = torch.where(batch.mask > 0, adv + values, 0.0)
    if whiten:
        adv = masked_whiten(adv, batch.mask)
    return Advantages(adv.to(torch.float32), returns.to(torch.float32))
