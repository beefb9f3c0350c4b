"""The critic of full PPO: a scalar value head on a causal LM, and the clipped value loss."""

from __future__ import annotations

from pathlib import Path

import torch

from rft_hpc.algorithms.aggregation import LossAggMode, LossNorm, aggregate_loss, masked_mean
from rft_hpc.batch.tokens import TokenBatch


class ValueHeadModel(torch.nn.Module):
    """A causal LM's transformer trunk plus a linear head: one value per position.

    `forward` returns [B, L] values `V(s_j)`, the value of the state after tokens 0..j;
    `token_values` returns the [B, L-1] slice aligned with a `TokenBatch` (position j, the
    state from which token j+1 is predicted), as `AdvantageBatch.values` and `value_loss`
    expect. The LM head is never run. The head starts at zero output (weights and bias 0),
    so a fresh critic predicts 0 everywhere and the first GAE targets are the raw returns.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        # the trunk without the LM head (PreTrainedModel.base_model), when there is one
        trunk = getattr(model, "base_model", None)
        self.trunk = trunk if isinstance(trunk, torch.nn.Module) else model
        self._whole_lm = self.trunk is model
        hidden = int(model.config.hidden_size)  # type: ignore[union-attr]
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: object) -> ValueHeadModel:
        """Wrap the causal LM in folder `path` (loaded with `AutoModelForCausalLM`)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, **kwargs))

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values [B, L] (float32 or wider) from the trunk's last hidden state."""
        out = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         output_hidden_states=self._whole_lm)
        hidden = out.hidden_states[-1] if self._whole_lm else out.last_hidden_state
        head = self.value_head
        return head(hidden.to(head.weight.dtype)).squeeze(-1).to(
            torch.promote_types(head.weight.dtype, torch.float32))

    def token_values(self, batch: TokenBatch) -> torch.Tensor:
        """Values [B, L-1] aligned with the batch's shifted tensors (meaningless on padding)."""
        return self(batch.input_ids, batch.attention_mask)[:, :-1]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float | None = 0.5,
               loss_agg_mode: LossAggMode | str = "token-mean",
               norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: `0.5 * aggregate(max((V - R)^2, (V_clip - R)^2))`.

    `values` the critic's current predictions [B, T] (with gradient), `old_values` its
    predictions when the advantages were computed, `returns` the GAE returns;
    `V_clip = old_values + clip(V - old_values, -cliprange_value, +cliprange_value)`
    (verl's `cliprange_value`, default 0.5; None: no clipping). Metrics: `vf_clipfrac`
    (tokens where the clipped error is the larger), `vpred_mean`.
    """
    returns = returns.detach().to(values.dtype)
    old_values = old_values.detach().to(values.dtype)
    err = (values - returns) ** 2
    if cliprange_value is None:
        per_token, clipped_err = err, err
    else:
        clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped_err = (clipped - returns) ** 2
        per_token = torch.maximum(err, clipped_err)
    loss = 0.5 * aggregate_loss(per_token, mask, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped_err > err).float(), mask),
                   "vpred_mean": masked_mean(values, mask)}
    return loss, metrics
