"""KL to a reference policy (in the reward or in the loss) and the entropy bonus.

The per-token estimators of KL(π || π_ref) from tokens sampled by π, with
`logr = ref_logp - logp` (names as verl/Trinity-RFT `kl_penalty_fn` / `kl_loss_fn`):

- `k1`: `-logr` (unbiased, can be negative);
- `k2`: `logr**2 / 2` (biased, never negative);
- `k3`: `exp(logr) - 1 - logr` (unbiased, never negative, low variance);
- `low_var_kl`: k3 with `logr` clamped to [-20, 20] and the result to [-10, 10] (verl's guard
  against a token whose probabilities have drifted far apart);
- `abs`: `|logr|`.

Two places to use them: in the reward (`kl_reward_penalty`, Trinity's `kl_penalty_fn`), a
per-token penalty subtracted from the token rewards before advantages are computed, with
the rollout (old) log-probs and no gradient; or in the loss (`kl_loss`, `kl_loss_fn`), a
differentiable term added to the policy loss.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch.utils.checkpoint import checkpoint

from rft_hpc.algorithms.aggregation import LossAggMode, LossNorm, aggregate_loss
from rft_hpc.core.errors import UserError

KLKind = Literal["k1", "k2", "k3", "low_var_kl", "abs"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind | str = "k3",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token KL estimate `kind` [B, T] (see the module doc); 0 where `mask` is 0.

    Masked positions are zeroed before the exponential, so padding holding garbage
    log-probs gives neither inf nor NaN, in the value or in the gradient.
    """
    logr = ref_logp - logp
    if mask is not None:
        logr = torch.where(mask > 0, logr, 0.0)
    if kind == "k1":
        return -logr
    if kind == "k2":
        return 0.5 * logr**2
    if kind == "k3":
        return torch.exp(logr) - 1.0 - logr
    if kind == "low_var_kl":
        logr = logr.clamp(-20.0, 20.0)
        return (torch.exp(logr) - 1.0 - logr).clamp(-10.0, 10.0)
    if kind == "abs":
        return logr.abs()
    raise UserError(f"unknown KL estimator {kind!r}; use one of {', '.join(KL_KINDS)}")


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
            kind: KLKind | str = "k2", kl_coef: float = 0.001,
            loss_agg_mode: LossAggMode | str = "token-mean",
            norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the loss: `kl_coef * aggregate(kl_per_token(logp, ref_logp, kind))`.

    Add the returned loss to the policy loss. Defaults are Trinity-RFT's (`kl_loss_fn: k2`,
    `kl_coef: 0.001`). Metrics: `kl_loss` (the aggregated KL, before `kl_coef`, detached).
    """
    kl = aggregate_loss(kl_per_token(logp, ref_logp, kind, mask), mask, loss_agg_mode, norm)
    return kl_coef * kl, {"kl_loss": kl.detach()}


def kl_reward_penalty(old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                      kind: KLKind | str = "k1", kl_coef: float = 0.001) -> torch.Tensor:
    """KL in the reward: the per-token penalty [B, T] `kl_coef * kl * mask`, detached.

    Pass it as `AdvantageBatch.kl_penalty`: the token rewards become
    `reward_at_last_token - penalty`, so the advantages (GAE, REINFORCE++) see the KL of every
    token, and the outcome-based ones (GRPO, RLOO, OPMD) the sequence's summed penalty.
    `old_logp` are the rollout log-probs (the policy that sampled the tokens).
    """
    with torch.no_grad():
        return kl_coef * kl_per_token(old_logp, ref_logp, kind, mask) * mask


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, *,
                  chunk_size: int = 4096) -> torch.Tensor:
    """Entropy of the policy's next-token distribution at every predicting position [B, L-1].

    `logits` [B, L, V] as the model returns them; position j is the distribution that
    scored token j+1 (the `TokenBatch` convention), sampled at `temperature`. Computed in
    float32 over `chunk_size` rows at a time, each chunk recomputed in the backward pass, so
    no [B, L, V] float32 copy is kept for autograd.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    b, length, vocab = logits.shape
    rows = logits[:, :-1].reshape(-1, vocab)
    parts = [checkpoint(_entropy_rows, rows[start:start + chunk_size], temperature,
                        use_reentrant=False)
             for start in range(0, rows.shape[0], chunk_size)]
    out = torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.float32)
    return out.reshape(b, length - 1)


def _entropy_rows(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    x = rows.to(torch.promote_types(rows.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float = 0.0,
                  loss_agg_mode: LossAggMode | str = "token-mean",
                  norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The entropy term to add to the loss: `-entropy_coef * aggregate(entropy)`.

    Minimising it raises the policy's entropy (more exploration). Metrics: `entropy` (the
    aggregated entropy, detached).
    """
    value = aggregate_loss(entropy, mask, loss_agg_mode, norm)
    return -entropy_coef * value, {"entropy": value.detach()}
