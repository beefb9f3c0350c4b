"""Turn a per-token loss [B, T] into one number: the loss aggregation modes of verl/Trinity-RFT.

`T` is the shifted length L-1 of a `TokenBatch`; `mask` is its `loss_mask` (1 on trained
tokens). The modes (`loss_agg_mode`):

- `token-mean`: sum over all trained tokens / number of trained tokens. Every token weighs
  the same, so long responses weigh more than short ones.
- `seq-mean-token-sum`: each sequence's sum over its tokens, averaged over sequences.
- `seq-mean-token-mean`: each sequence's mean over its tokens, averaged over sequences.
  Every sequence weighs the same, whatever its length (the original GRPO objective).
- `seq-mean-token-sum-norm`: each sequence's sum over its tokens divided by a constant
  `max_tokens` (Dr. GRPO: the longest response allowed), averaged over sequences. Unlike
  the others, the gradient does not depend on how long the batch's responses happen to be.
  (verl and Trinity-RFT divide the batch's token sum by the constant alone and let gradient
  accumulation divide by the number of micro-batches; here the average over sequences is
  explicit, so the result does not depend on the micro-batch size.)

"Sequences" are rows with at least one trained token: padding rows never count.

Micro-batching: the divisors are whole-batch quantities. Build `LossNorm.of(mask)` once from
the *whole* batch's mask (rows from every micro-batch and every data-parallel rank), pass
it to the aggregation of each micro-batch, and sum the micro-batches' losses (and their
gradients): the sum is then exactly the whole batch's loss. Every mode is a sum over tokens
or sequences of terms that depend only on their own sequence, divided by `LossNorm`, which is
why this works; a micro-batch must hold whole sequences (never split a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from rft_hpc.core.errors import UserError

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(frozen=True)
class LossNorm:
    """The whole batch's divisors, shared by all its micro-batches (see the module doc)."""

    num_tokens: float
    """Trained tokens (sum of the mask) of the whole batch."""
    num_seqs: float
    """Rows of the whole batch with at least one trained token."""
    max_tokens: float
    """The constant of `seq-mean-token-sum-norm` (Dr. GRPO: the longest response allowed)."""

    @classmethod
    def of(cls, mask: torch.Tensor, max_tokens: float | None = None) -> LossNorm:
        """The divisors of the batch whose (whole) mask is `mask` [B, T].

        `max_tokens` defaults to T, the padded length of `mask`; pass the configured
        longest response instead to keep the `seq-mean-token-sum-norm` scale fixed from one
        step to the next.
        """
        return cls(num_tokens=float(mask.sum()), num_seqs=float((mask.sum(-1) > 0).sum()),
                   max_tokens=float(mask.shape[-1] if max_tokens is None else max_tokens))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`sum(values * mask)` over `dim` (all dims when None); masked entries never contribute,
    even when they hold inf or NaN."""
    masked = torch.where(mask > 0, values * mask, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor,
                num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """`sum(values * mask) / max(num_tokens, 1)`; `num_tokens` defaults to `sum(mask)`.

    Masked-out entries never contribute, even when they hold inf or NaN.
    """
    total = masked_sum(values, mask)
    count = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=total.device)
    return total / count.to(total.dtype).clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(values - mean) / sqrt(var + eps)` with the mean and the unbiased (n-1) variance over
    the masked entries of the whole tensor, as verl's `masked_whiten`; 0 where mask is 0.

    With fewer than two masked entries the variance is taken as 0 (no division by n-1 = 0).
    """
    n = mask.sum()
    mean = masked_sum(values, mask) / n.clamp(min=1.0)
    var = masked_sum((values - mean) ** 2, mask) / (n - 1).clamp(min=1.0)
    return torch.where(mask > 0, (values - mean) * torch.rsqrt(var + eps), 0.0)


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor,
                   loss_agg_mode: LossAggMode | str = "token-mean",
                   norm: LossNorm | None = None) -> torch.Tensor:
    """Aggregate the per-token `values` [B, T] over the trained tokens of `mask` [B, T].

    `norm` holds the whole batch's divisors (default: those of `mask` itself, right when
    `values` is the whole batch); see the module doc for the modes and for micro-batching.
    An unknown mode raises `UserError`.
    """
    if norm is None:
        norm = LossNorm.of(mask)
    seqs = max(norm.num_seqs, 1.0)
    if loss_agg_mode == "token-mean":
        return masked_sum(values, mask) / max(norm.num_tokens, 1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(values, mask) / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(values, mask, dim=-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked_sum(values, mask) / (seqs * norm.max_tokens)
    raise UserError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of "
                    f"{', '.join(LOSS_AGG_MODES)}")
