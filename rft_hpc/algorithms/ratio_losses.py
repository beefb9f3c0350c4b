"""Policy losses that reshape PPO's importance ratio: GSPO, CISPO, SAPO, Clip-Cov, KL-Cov.

Each is its paper's equation in the contract of `policy_losses` (a `PolicyLossInputs` and
keyword parameters in, `(loss, metrics)` out). With the ratio `r_t = π(y_t) / π_old(y_t)`
of each trained token (log-ratio clamped to [-20, 20]) and its advantage `A` (per token,
or per sequence and spread over its tokens), each computes a per-token loss `l_t`, which is
multiplied by the off-policy correction's weight when there is one (`inputs.weights`) and
aggregated by `loss_agg_mode` (`aggregation`). The presets of the same names
(`trainer.algorithm.PRESETS`) pair each with GRPO's advantages and the aggregation its paper
uses; docs/algorithms.md has the table of equations, sources and defaults.

Clip-Cov and KL-Cov pick tokens by their covariance `(A_t - mean A) (log π_t - mean log π)`
over the rows they are given: under micro-batching, over each micro-batch (as verl's).
"""

from __future__ import annotations

import torch

from rft_hpc.algorithms.aggregation import LossAggMode, aggregate_loss, masked_mean
from rft_hpc.algorithms.policy_losses import Metrics, PolicyLossInputs


def _ratio_parts(name: str, inputs: PolicyLossInputs,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logp, log_ratio, ratio, advantages [B, T])` of a ratio loss; masked tokens hold a
    log-ratio of 0."""
    logp, old_logp, adv = inputs.need(name, "logp", "old_logp", "advantages")
    log_ratio = torch.where(inputs.mask > 0, logp - old_logp, 0.0).clamp(-20.0, 20.0)
    adv = adv.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    return logp, log_ratio, torch.exp(log_ratio), adv


def _finish(per_token: torch.Tensor, inputs: PolicyLossInputs, loss_agg_mode: str,
            log_ratio: torch.Tensor, metrics: Metrics) -> tuple[torch.Tensor, Metrics]:
    """Weight (off-policy correction), aggregate, and add the shared metrics."""
    if inputs.weights is not None:
        per_token = per_token * inputs.weights.detach().to(per_token.dtype)
    loss = aggregate_loss(per_token, inputs.mask, loss_agg_mode, inputs.norm)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        metrics.update(ratio_mean=masked_mean(ratio, inputs.mask),
                       approx_kl=masked_mean(ratio - 1.0 - log_ratio, inputs.mask),
                       pg_loss=loss.detach())
    return loss, metrics


def gspo_policy_loss(inputs: PolicyLossInputs, *, clip_range_low: float = 3e-4,
                     clip_range_high: float = 4e-4,
                     loss_agg_mode: LossAggMode | str = "seq-mean-token-mean",
                     ) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clip on one
    ratio per sequence, `s_i = exp(mean_t log r_t)` over its trained tokens.

    In its token form (GSPO-token): `s_t = sg(s_i) * π(y_t) / sg(π(y_t))`, which equals
    `s_i` and, with one advantage per sequence, has GSPO's gradient; `l_t = max(-A s_t,
    -A clip(s_t, 1 - clip_range_low, 1 + clip_range_high))`. The paper's ranges are
    3e-4 and 4e-4 (a sequence's mean log-ratio moves far less than a token's), and its
    aggregation the mean over sequences of their token means (the `gspo` preset's).
    Metrics: `clip_fraction` (sequences clipped), `seq_ratio_mean`, and the shared ones.
    """
    logp, log_ratio, _, adv = _ratio_parts("gspo", inputs)
    mask = inputs.mask
    lengths = mask.sum(-1).clamp(min=1.0)
    seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]
    token_log = (torch.where(mask > 0, logp - logp.detach(), 0.0)
                 + seq_log_ratio.detach()[:, None])
    s = torch.exp(token_log.clamp(max=10.0))
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - clip_range_low, 1.0 + clip_range_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        rows = mask.sum(-1) > 0
        seq_clipped = ((clipped > unclipped) & (mask > 0)).any(-1)
        metrics: Metrics = {
            "clip_fraction": seq_clipped[rows].float().mean() if bool(rows.any())
            else torch.zeros(()),
            "seq_ratio_mean": torch.exp(seq_log_ratio[rows]).mean() if bool(rows.any())
            else torch.ones(())}
    return _finish(per_token, inputs, loss_agg_mode, log_ratio, metrics)


def cispo_policy_loss(inputs: PolicyLossInputs, *, clip_range_low: float | None = None,
                      clip_range_high: float = 4.0,
                      loss_agg_mode: LossAggMode | str = "token-mean",
                      ) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, 2025): the policy gradient of every token, weighted by its ratio
    clipped and detached: `l_t = -sg(clip(r_t, 1 - clip_range_low, 1 + clip_range_high))
    A log π(y_t)`. Unlike PPO's clip, a clipped token keeps its gradient (only its weight
    is capped). No lower bound by default (`clip_range_low` None: MiniMax-M1 sets it out of
    reach); the cap 1 + 4 is ScaleRL's (Khatri et al. 2025). Metrics: `clip_fraction`
    (tokens whose weight was capped), and the shared ones.
    """
    logp, log_ratio, ratio, adv = _ratio_parts("cispo", inputs)
    low = None if clip_range_low is None else 1.0 - clip_range_low
    weight = ratio.detach().clamp(min=low, max=1.0 + clip_range_high)
    per_token = -adv * weight * logp
    with torch.no_grad():
        capped = (weight != ratio).float()
        metrics: Metrics = {"clip_fraction": masked_mean(capped, inputs.mask)}
    return _finish(per_token, inputs, loss_agg_mode, log_ratio, metrics)


def sapo_policy_loss(inputs: PolicyLossInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05,
                     loss_agg_mode: LossAggMode | str = "seq-mean-token-mean",
                     ) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate in place
    of the clip, `l_t = -f(r_t) A` with `f(r) = (4 / tau) sigmoid(tau (r - 1))`, `tau =
    tau_pos` where `A > 0` and `tau_neg` elsewhere. At `r = 1` the gradient is the policy
    gradient's (`f'(1) = 1`); it fades smoothly as `r` leaves 1, faster for negative
    advantages (`tau_neg > tau_pos`). The paper's temperatures 1.0 and 1.05 and its
    aggregation (mean over sequences of their token means) are the defaults. Metrics:
    `gate_mean` (`f'(r)`, the gradient's scale per token) and the shared ones.
    """
    _, log_ratio, ratio, adv = _ratio_parts("sapo", inputs)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos and tau_neg > 0, got {tau_pos}, {tau_neg}")
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * adv
    with torch.no_grad():
        metrics: Metrics = {"gate_mean": masked_mean(4.0 * gate * (1.0 - gate), inputs.mask)}
    return _finish(per_token, inputs, loss_agg_mode, log_ratio, metrics)


def _covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's `(A - mean A)(log π - mean log π)`, means over the trained tokens."""
    lp = logp.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def clip_cov_policy_loss(inputs: PolicyLossInputs, *, clip_range: float = 0.2,
                         clip_range_low: float | None = None,
                         clip_range_high: float | None = None, clip_cov_ratio: float = 2e-4,
                         clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, seed: int = 0,
                         loss_agg_mode: LossAggMode | str = "token-mean",
                         ) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models"): PPO's clipped loss, with the gradient of a few
    entropy-collapsing tokens cut. Among the trained tokens PPO has not clipped whose
    covariance lies in `(clip_cov_lb, clip_cov_ub)`, `max(1, clip_cov_ratio * tokens)` drawn
    at random get `l_t = 0`. The draw is seeded by `seed` and the number of trained tokens,
    so a batch trained again (a resume) cuts the same ones. The paper's 2e-4, 1 and 5 are
    the defaults. Metrics: `cov_clip_fraction` (tokens cut), `clip_fraction` (PPO's).
    """
    _, log_ratio, ratio, adv = _ratio_parts("clip_cov", inputs)
    mask = inputs.mask
    low = clip_range if clip_range_low is None else clip_range_low
    high = clip_range if clip_range_high is None else clip_range_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    with torch.no_grad():
        by_ppo = (clipped > unclipped) & (mask > 0)
        cov = _covariance(inputs.logp, adv, mask)
        band = (cov > clip_cov_lb) & (cov < clip_cov_ub) & (mask > 0) & ~by_ppo
        candidates = band.nonzero()
        count = max(int(clip_cov_ratio * float(mask.sum())), 1)
        draw = torch.Generator().manual_seed(seed + int(mask.sum()))
        chosen = candidates[torch.randperm(len(candidates), generator=draw)[:count]]
        keep = torch.ones_like(ratio)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
        metrics: Metrics = {"cov_clip_fraction": masked_mean(1.0 - keep, mask),
                            "clip_fraction": masked_mean(by_ppo.float(), mask)}
    per_token = torch.maximum(unclipped, clipped) * keep
    return _finish(per_token, inputs, loss_agg_mode, log_ratio, metrics)


def kl_cov_policy_loss(inputs: PolicyLossInputs, *, kl_cov_ratio: float = 2e-4,
                       kl_coef: float = 1.0, loss_agg_mode: LossAggMode | str = "token-mean",
                       ) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, the same paper as Clip-Cov): the unclipped policy gradient
    loss `-A r_t`, plus a KL penalty `kl_coef * |log r_t|` on the `max(1, kl_cov_ratio *
    tokens)` trained tokens of the largest covariance. The paper's 2e-4 and 1 are the
    defaults. Metrics: `kl_cov_fraction` (tokens penalised), `kl_cov_abs_kl` (their mean
    `|log r|`), and the shared ones.
    """
    _, log_ratio, ratio, adv = _ratio_parts("kl_cov", inputs)
    mask = inputs.mask
    with torch.no_grad():
        cov = _covariance(inputs.logp, adv, mask).masked_fill(mask <= 0, -torch.inf)
        count = min(max(int(kl_cov_ratio * float(mask.sum())), 1), int(mask.sum()))
        chosen = torch.zeros_like(mask, dtype=torch.bool).flatten()
        chosen[cov.flatten().topk(count).indices] = True
        chosen = chosen.view_as(mask) & (mask > 0)
    penalty = kl_coef * log_ratio.abs() * chosen
    per_token = -adv * ratio + penalty
    with torch.no_grad():
        metrics: Metrics = {"kl_cov_fraction": masked_mean(chosen.float(), mask),
                            "kl_cov_abs_kl": masked_mean(log_ratio.abs(), chosen.float())}
    return _finish(per_token, inputs, loss_agg_mode, log_ratio, metrics)
