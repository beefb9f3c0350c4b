"""Policy losses: PPO (clipped, optionally dual-clipped), OPMD, SFT, DPO and MIX.

Every loss takes a `PolicyLossInputs` and keyword parameters (Trinity-RFT's
`policy_loss_fn_args`) and returns `(loss, metrics)`: a 0-dim loss to minimise and detached
0-dim metric tensors. Per-token tensors are [B, T], T = L-1, the `TokenBatch` convention.

Micro-batching: pass the whole batch's divisors as `norm` (and `expert_norm` for MIX), built
once with `LossNorm.of` from the whole batch's mask; the losses of the micro-batches then sum
to the whole batch's loss, and so do their gradients (see `aggregation`). Metrics are the
micro-batch's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rft_hpc.algorithms.aggregation import (
    LossAggMode,
    LossNorm,
    aggregate_loss,
    masked_mean,
    masked_sum,
)

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss reads; a loss raises ValueError when a field it needs is None."""

    logp: torch.Tensor  # [B, T] log-probs under the policy being trained (with gradient)
    mask: torch.Tensor  # [B, T] 1 on trained tokens (TokenBatch.loss_mask)
    old_logp: torch.Tensor | None = None  # [B, T] π_old: rollout (or recomputed) log-probs
    advantages: torch.Tensor | None = None  # [B, T] per token, or [B] per sequence
    ref_logp: torch.Tensor | None = None  # [B, T] reference policy (DPO)
    is_expert: torch.Tensor | None = None  # [B] bool: expert (SFT) rows of a MIX batch
    norm: LossNorm | None = None  # whole-batch divisors (of the RL rows, for MIX)
    expert_norm: LossNorm | None = None  # MIX: whole-batch divisors of the expert rows
    weights: torch.Tensor | None = None  # [B, T] off-policy correction (`off_policy`), detached

    def need(self, name: str, *fields: str) -> list[torch.Tensor]:
        """The named fields, or a ValueError saying which one loss `name` is missing."""
        values = [getattr(self, f) for f in fields]
        for field, value in zip(fields, values, strict=True):
            if value is None:
                raise ValueError(f"the {name} loss needs {field}")
        return values

    def rows(self, keep: torch.Tensor, norm: LossNorm | None) -> PolicyLossInputs:
        """The rows where `keep` [B] is True, with `norm` as their divisors."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[keep]
        return PolicyLossInputs(logp=self.logp[keep], mask=self.mask[keep],
                                old_logp=pick(self.old_logp), advantages=pick(self.advantages),
                                ref_logp=pick(self.ref_logp), norm=norm,
                                weights=pick(self.weights))


def ppo_policy_loss(inputs: PolicyLossInputs, *, clip_range: float = 0.2,
                    clip_range_low: float | None = None, clip_range_high: float | None = None,
                    clip_ratio_c: float | None = 3.0,
                    loss_agg_mode: LossAggMode | str = "token-mean",
                    ) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate (GRPO, RLOO, REINFORCE++ and PPO all train with it).

    Per trained token, `ratio = exp(logp - old_logp)` (log-ratio clamped to [-20, 20]) and
    `l = max(-A * ratio, -A * clip(ratio, 1 - clip_range_low, 1 + clip_range_high))`; the
    clip bounds default to `clip_range`. Dual clip (`clip_ratio_c` > 1, Trinity-RFT's
    default 3; None turns it off): where `A < 0`, `l = min(l, -A * clip_ratio_c)`, which
    bounds the loss of a token whose ratio has grown huge. With `inputs.weights` (an
    off-policy correction, `algorithms.off_policy`) each token's `l` is multiplied by its
    weight. Aggregated by `loss_agg_mode`.

    Metrics: `clip_fraction` (tokens where the clipped term is taken, so their gradient is
    0), `clip_fraction_lower` (tokens capped by the dual clip), `ratio_mean`, `approx_kl`
    (k3 estimate of KL(old || new)), `pg_loss` (the loss, detached); token means.
    """
    logp, old_logp, adv = inputs.need("ppo", "logp", "old_logp", "advantages")
    mask = inputs.mask
    low = clip_range if clip_range_low is None else clip_range_low
    high = clip_range if clip_range_high is None else clip_range_high
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}")
    log_ratio = torch.where(mask > 0, logp - old_logp, 0.0).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = adv.detach().to(ratio.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: Metrics = {}
    if clip_ratio_c is not None:
        capped = torch.minimum(per_token, -adv * clip_ratio_c)
        with torch.no_grad():
            lower = (per_token > -adv * clip_ratio_c) & (adv < 0)
            metrics["clip_fraction_lower"] = masked_mean(lower.float(), mask)
        per_token = torch.where(adv < 0, capped, per_token)
    if inputs.weights is not None:
        per_token = per_token * inputs.weights.detach().to(per_token.dtype)
    loss = aggregate_loss(per_token, mask, loss_agg_mode, inputs.norm)
    with torch.no_grad():
        metrics.update(clip_fraction=masked_mean((clipped > unclipped).float(), mask),
                       ratio_mean=masked_mean(ratio, mask),
                       approx_kl=masked_mean(ratio - 1.0 - log_ratio, mask),
                       pg_loss=loss.detach())
    return loss, metrics


def opmd_policy_loss(inputs: PolicyLossInputs, *, tau: float = 1.0,
                     loss_agg_mode: LossAggMode | str = "token-mean",
                     ) -> tuple[torch.Tensor, Metrics]:
    """OPMD (Trinity-RFT's online policy mirror descent): `aggregate(-A * logp) / (1 + tau)`.

    No ratio and no clipping: π_old is not used, so off-policy data needs no correction.
    Metrics: `opmd_loss`.
    """
    logp, adv = inputs.need("opmd", "logp", "advantages")
    adv = adv.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    loss = aggregate_loss(-adv * logp, inputs.mask, loss_agg_mode, inputs.norm) / (1.0 + tau)
    return loss, {"opmd_loss": loss.detach()}


def sft_policy_loss(inputs: PolicyLossInputs, *, loss_agg_mode: LossAggMode | str = "token-mean",
                    use_token_level_loss: bool | None = None) -> tuple[torch.Tensor, Metrics]:
    """SFT: the negative log-likelihood of the trained tokens, `aggregate(-logp)`.

    `use_token_level_loss` is Trinity-RFT's switch: True is `token-mean`, False
    `seq-mean-token-mean`; when given it overrides `loss_agg_mode`. Metrics: `sft_loss`.
    """
    if use_token_level_loss is not None:
        loss_agg_mode = "token-mean" if use_token_level_loss else "seq-mean-token-mean"
    loss = aggregate_loss(-inputs.logp, inputs.mask, loss_agg_mode, inputs.norm)
    return loss, {"sft_loss": loss.detach()}


def dpo_sequence_logps(logp: torch.Tensor, mask: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each pair's chosen and rejected response ([B/2] each).

    Rows are interleaved pairs (see `batching.collate_dpo`): row 2i is pair i's chosen
    response, row 2i+1 its rejected one; only trained (response) tokens count.
    """
    if logp.shape[0] % 2:
        raise ValueError(f"a DPO batch holds pairs of rows; got {logp.shape[0]} rows")
    seq = masked_sum(logp, mask, dim=-1)
    return seq[0::2], seq[1::2]


def dpo_loss(inputs: PolicyLossInputs, *, beta: float = 0.1,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """DPO's sigmoid loss over the pairs of the batch (rows interleaved chosen, rejected).

    Per pair, with sequence log-prob sums `c`, `r` (policy) and `c0`, `r0` (reference):
    `z = beta * ((c - c0) - (r - r0))`,
    `loss = -(1 - label_smoothing) * logsigmoid(z) - label_smoothing * logsigmoid(-z)`;
    the mean over the pairs of the whole batch, `norm.num_seqs / 2` of them when `norm` is given.
    Metrics: `chosen_reward` and `rejected_reward` (mean of `beta * (c - c0)` and of
    `beta * (r - r0)`), `accuracy_mean` (share of pairs with `z > 0`), `dpo_loss`.
    """
    logp, ref_logp = inputs.need("dpo", "logp", "ref_logp")
    chosen, rejected = dpo_sequence_logps(logp, inputs.mask)
    ref_chosen, ref_rejected = dpo_sequence_logps(ref_logp.detach(), inputs.mask)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    losses = (-(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z))
    pairs = len(losses) if inputs.norm is None else inputs.norm.num_seqs / 2
    loss = losses.sum() / max(pairs, 1.0)
    with torch.no_grad():
        metrics = {"chosen_reward": beta * chosen_ratio.mean(),
                   "rejected_reward": beta * rejected_ratio.mean(),
                   "accuracy_mean": (z > 0).float().mean(), "dpo_loss": loss.detach()}
    return loss, metrics


def mix_policy_loss(inputs: PolicyLossInputs, *, mu: float = 0.1, clip_range: float = 0.2,
                    clip_range_low: float | None = None, clip_range_high: float | None = None,
                    clip_ratio_c: float | None = 3.0,
                    loss_agg_mode: LossAggMode | str = "token-mean",
                    sft_loss_agg_mode: LossAggMode | str = "token-mean",
                    use_token_level_loss_in_sft: bool | None = None,
                    ) -> tuple[torch.Tensor, Metrics]:
    """MIX (Trinity-RFT): `(1 - mu) * PPO loss of the rollouts + mu * SFT loss of the expert
    rows` of one batch, `inputs.is_expert` [B] telling them apart.

    Each part is normalised over its own rows of the whole batch: `inputs.norm` are the
    divisors of the rollout rows, `inputs.expert_norm` those of the expert rows (both default
    to this batch's own). A micro-batch without rows of a part adds 0 for it. This is what
    Trinity-RFT's per-micro-batch weights compute, without the batch sizes as knobs.
    Metrics: the PPO ones prefixed `usual/`, the SFT one `expert/sft_loss`.
    """
    (is_expert,) = inputs.need("mix", "is_expert")
    is_expert = is_expert.to(torch.bool)
    zero = inputs.logp.sum() * 0.0  # keeps the loss attached to the graph
    rl, sft = zero, zero
    metrics: Metrics = {}
    if bool((~is_expert).any()):
        rl, parts = ppo_policy_loss(inputs.rows(~is_expert, inputs.norm), clip_range=clip_range,
                                    clip_range_low=clip_range_low,
                                    clip_range_high=clip_range_high, clip_ratio_c=clip_ratio_c,
                                    loss_agg_mode=loss_agg_mode)
        metrics.update({f"usual/{k}": v for k, v in parts.items()})
    if bool(is_expert.any()):
        expert = PolicyLossInputs(logp=inputs.logp[is_expert], mask=inputs.mask[is_expert],
                                  norm=inputs.expert_norm)
        sft, parts = sft_policy_loss(expert, loss_agg_mode=sft_loss_agg_mode,
                                     use_token_level_loss=use_token_level_loss_in_sft)
        metrics.update({f"expert/{k}": v for k, v in parts.items()})
    return (1.0 - mu) * rl + mu * sft, metrics
