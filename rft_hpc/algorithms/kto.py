"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
arXiv:2402.01306): each response judged on its own, desirable or not, against a reference
point, rather than one response against another as DPO does.

With `r = log pi(y|x) - log pi_ref(y|x)` (summed over the response's trained tokens) and
`z0` the reference point, an estimate of `KL(pi(.|x) || pi_ref(.|x))`:

    loss = lambda_D (1 - sigmoid(beta (r - z0)))   for a desirable response,
           lambda_U (1 - sigmoid(beta (z0 - r)))   for an undesirable one,

averaged over the batch's responses. As the paper and TRL estimate it, `z0` is the mean of
`r` over mismatched responses (each prompt with another example's response), clamped at 0
and without gradient. Here a preference pair gives one desirable response (the chosen)
and one undesirable (the rejected), as the paper's comparisons with DPO split pairs; its
mismatched response is the next pair's chosen one, in the same micro-batch
(`batch.tokens.collate_kto`: three rows per pair, chosen, rejected, mismatched).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rft_hpc.algorithms.aggregation import masked_sum
from rft_hpc.algorithms.policy_losses import Metrics, PolicyLossInputs
from rft_hpc.batch.tokens import KTO_ROWS_PER_PAIR as ROWS_PER_PAIR


def kto_loss(inputs: PolicyLossInputs, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, Metrics]:
    """KTO's loss (module doc) over the rows `collate_kto` lays out, averaged over the
    desirable and undesirable responses of the whole batch (`norm.num_seqs / 3` pairs when
    `norm` is given), `z0` over the mismatched rows of these rows. Defaults: the paper's
    (beta 0.1, lambda_D = lambda_U = 1). Metrics: `kto_loss`, `kto_kl` (z0), DPO's
    `chosen_reward` and `rejected_reward` (`beta r`), `accuracy_mean` (pairs whose chosen
    `r` exceeds the rejected's)."""
    logp, ref_logp = inputs.need("kto", "logp", "ref_logp")
    if logp.shape[0] % ROWS_PER_PAIR:
        raise ValueError(f"a KTO batch holds three rows per pair; got {logp.shape[0]} rows")
    ratio = masked_sum(logp, inputs.mask, dim=-1) - \
        masked_sum(ref_logp.detach(), inputs.mask, dim=-1)
    chosen, rejected, mismatched = (ratio[k::ROWS_PER_PAIR] for k in range(ROWS_PER_PAIR))
    z0 = mismatched.detach().mean().clamp(min=0.0)
    losses = (desirable_weight * (1.0 - F.sigmoid(beta * (chosen - z0))),
              undesirable_weight * (1.0 - F.sigmoid(beta * (z0 - rejected))))
    pairs = len(chosen) if inputs.norm is None else inputs.norm.num_seqs / ROWS_PER_PAIR
    loss = (losses[0].sum() + losses[1].sum()) / max(2.0 * pairs, 1.0)
    with torch.no_grad():
        metrics = {"chosen_reward": beta * chosen.mean(), "rejected_reward": beta * rejected.mean(),
                   "accuracy_mean": (chosen > rejected).float().mean(), "kto_kl": z0,
                   "kto_loss": loss.detach()}
    return loss, metrics
