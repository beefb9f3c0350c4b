"""The reward model's loss: Bradley-Terry on preference pairs, with a margin where the data
has one (Llama 2's form: the chosen response must win by at least the margin)."""

from __future__ import annotations

import torch


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """`-log sigmoid(r_chosen - r_rejected - margin)` summed over the pairs (the caller
    divides by the whole batch's pairs, so that ranks' shares add up), and the pairs'
    sums: `correct` (pairs whose chosen response scores higher) and `reward_gap`
    (r_chosen - r_rejected). `chosen`, `rejected` and `margin` are [pairs] scores."""
    gap = chosen.float() - rejected.float()
    shifted = gap if margin is None else gap - margin.to(gap.dtype)
    loss = -torch.nn.functional.logsigmoid(shifted).sum()
    return loss, {"correct": float((gap > 0).sum()), "reward_gap": float(gap.detach().sum())}
