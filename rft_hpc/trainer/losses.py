"""The losses the trainer minimises (per-token log-probs: `rft_hpc.batch.logprobs`).

Shapes: B sequences, L tokens, V vocabulary entries. Per-token tensors are the shifted
[B, L-1] tensors of a `TokenBatch` (position j scores token j+1). Every loss is a
"token-mean": the sum over trained tokens (mask 1) of the whole batch divided by their count,
so long and short responses weigh the same per token. When a batch is split into
micro-batches for gradient accumulation, pass the whole batch's count as `num_tokens` to each
call and sum the results: the gradient is then exactly that of the whole batch.

The trainer's GRPO step uses these; the general algorithm library (more advantages, losses,
aggregation modes, KL estimators) is `rft_hpc.algorithms`, on which they are built.
"""

from __future__ import annotations

from typing import Literal

import torch

from rft_hpc.algorithms.aggregation import LossNorm, masked_mean
from rft_hpc.algorithms.kl import kl_per_token
from rft_hpc.algorithms.policy_losses import PolicyLossInputs, ppo_policy_loss

__all__ = ["KLKind", "kl_penalty", "policy_loss", "sft_loss"]

KLKind = Literal["k1", "k2", "k3"]


def policy_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, *,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_kind: KLKind = "k3", num_tokens: torch.Tensor | float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate loss, token-mean, plus an optional KL penalty.

    Per trained token: `ratio = exp(new_logp - old_logp)`, `A` = the sequence's advantage,
    `l = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`;
    `loss = masked_mean(l) + kl_coef * kl_penalty(new_logp, ref_logp, kind=kl_kind)`.
    Metrics (detached 0-dim tensors over trained tokens): `clip_fraction` (share of tokens
    where the clipped term is the smaller one, so their gradient is 0), `ratio_mean`,
    `approx_kl` (k3 estimate of KL(old || new): `mean(ratio - 1 - log ratio)`), and `kl_ref`
    when a KL penalty is used.
    """
    norm = None
    if num_tokens is not None:
        norm = LossNorm(num_tokens=float(num_tokens), num_seqs=0.0, max_tokens=1.0)
    loss, parts = ppo_policy_loss(
        PolicyLossInputs(logp=new_logp, mask=loss_mask, old_logp=old_logp,
                         advantages=advantages, norm=norm),
        clip_range_low=clip_low, clip_range_high=clip_high, clip_ratio_c=None)
    metrics = {k: parts[k] for k in ("clip_fraction", "ratio_mean", "approx_kl")}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef is set but no ref_logp was given")
        kl = kl_penalty(new_logp, ref_logp, loss_mask, kl_kind, num_tokens=num_tokens)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    return loss, metrics


def kl_penalty(new_logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
               kind: KLKind = "k3", *,
               num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-mean estimate of KL(new || ref) from tokens sampled by the policy.

    With `d = ref_logp - new_logp` per token: k1 = `-d`; k2 = `d**2 / 2`;
    k3 = `exp(d) - 1 - d` (unbiased like k1, never negative like k2, lowest variance).
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")
    per_token = kl_per_token(new_logp, ref_logp, kind, loss_mask)
    return masked_mean(per_token, loss_mask, num_tokens)


def sft_loss(new_logp: torch.Tensor, loss_mask: torch.Tensor, *,
             num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood: `-sum(new_logp * mask) / sum(mask)`."""
    return masked_mean(-new_logp, loss_mask, num_tokens)
