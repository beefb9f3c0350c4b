"""Off-policy correction: weights for the gap between the policy that sampled a rollout and
the policy the trainer computes it with.

An asynchronous explorer samples with weights the trainer has since moved past, and an
inference engine's numerics differ from the trainer's even for the same weights. Per
trained token t of a rollout: `b_t` is the engine's log-prob of the sampled token (recorded
with the rollout), `o_t` the trainer's log-prob of it under the weights the rollout was
generated for, `rho_t = exp(o_t - b_t)`. A correction is a detached weight `w_t` that
multiplies the policy loss's token terms, whose PPO ratio is then taken against `o_t`:

- `tis`, truncated importance sampling: `w = min(rho, cap)`; at `sequence` level rho is the
  row's `exp(sum_t (o_t - b_t))`, the same for all its tokens;
- `mis`, masked importance sampling: `w = rho` where `rho <= cap`, else 0 (token or sequence);
- `icepop`, token masking: `w_t = rho_t` where `low <= rho_t <= high`, else 0;
- `geo_mask`, a sequence mask: `w = 1` for rows whose geometric-mean ratio
  `exp(mean_t (o_t - b_t))` lies in `[low, high]`, else 0.

Metrics (token means over the trained tokens unless said): `correction/mismatch_kl` (k3
estimate of KL(engine || trainer), `rho - 1 - log rho`), `correction/ratio_p05`, `_p50`,
`_p95`, `_max` (quantiles of the token ratios), `correction/weight_mean`,
`correction/masked_fraction` (tokens whose weight is 0) and `correction/truncated_fraction`
(tokens whose weight the cap lowered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rft_hpc.algorithms.aggregation import masked_mean

CORRECTIONS = ("none", "tis", "mis", "icepop", "geo_mask")
DEFAULT_BOUNDS = {"icepop": (0.5, 5.0), "geo_mask": (0.99, 1.01)}
"""`(low, high)` when not given: IcePop's published bounds; a geometric mean within 1 %."""


@dataclass(frozen=True)
class Correction:
    """One correction with every bound filled in (`algorithm.correction`)."""

    type: str = "none"
    level: str = "token"
    cap: float = 2.0
    low: float = 0.0
    high: float = float("inf")

    @classmethod
    def of(cls, type: str, level: str = "token", cap: float = 2.0, low: float | None = None,
           high: float | None = None) -> Correction:
        """The correction `type` with `low` and `high` defaulting to `DEFAULT_BOUNDS`."""
        if type not in CORRECTIONS:
            raise ValueError(f"unknown correction {type!r}; known: {', '.join(CORRECTIONS)}")
        d_low, d_high = DEFAULT_BOUNDS.get(type, (0.0, float("inf")))
        return cls(type, level, cap, d_low if low is None else low,
                   d_high if high is None else high)

    @property
    def on(self) -> bool:
        """Whether the loss is corrected at all."""
        return self.type != "none"


def correction_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       mask: torch.Tensor, correction: Correction,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights [B, T] (0 off the mask) of `correction` for trainer log-probs `old_logp` and
    engine log-probs `behaviour_logp` of the same tokens, and the module doc's metrics."""
    on = mask > 0
    log_rho = torch.where(on, old_logp.double() - behaviour_logp.double(), 0.0)
    log_rho = log_rho.clamp(-20.0, 20.0)
    rho = torch.exp(log_rho)
    kind = correction.type
    if kind in ("tis", "mis") and correction.level == "sequence":
        seq = torch.exp(log_rho.sum(-1).clamp(-20.0, 20.0))[:, None].expand_as(rho)
    else:
        seq = rho
    truncated = torch.zeros_like(on)
    if kind == "none":
        weights = torch.ones_like(rho)
    elif kind == "tis":
        weights = seq.clamp(max=correction.cap)
        truncated = seq > correction.cap
    elif kind == "mis":
        weights = torch.where(seq <= correction.cap, seq, 0.0)
    elif kind == "icepop":
        weights = torch.where((rho >= correction.low) & (rho <= correction.high), rho, 0.0)
    else:  # geo_mask
        count = on.double().sum(-1).clamp(min=1.0)
        geo = torch.exp(log_rho.sum(-1) / count)[:, None].expand_as(rho)
        weights = ((geo >= correction.low) & (geo <= correction.high)).double()
    weights = torch.where(on, weights, 0.0)
    metrics = ratio_metrics(rho, log_rho, on)
    metrics.update({
        "correction/weight_mean": float(masked_mean(weights, mask)),
        "correction/masked_fraction": float(masked_mean(((weights == 0) & on).double(), mask)),
        "correction/truncated_fraction": float(masked_mean((truncated & on).double(), mask)),
    })
    return weights.to(old_logp.dtype), metrics


def ratio_metrics(rho: torch.Tensor, log_rho: torch.Tensor, on: torch.Tensor,
                  ) -> dict[str, float]:
    """Mismatch KL (k3) and quantiles of the token ratios `rho` where `on`."""
    values = rho[on]
    if values.numel() == 0:
        return {}
    q = torch.quantile(values, torch.tensor([0.05, 0.5, 0.95], dtype=values.dtype))
    return {"correction/mismatch_kl": float((values - 1.0 - log_rho[on]).mean()),
            "correction/ratio_p05": float(q[0]), "correction/ratio_p50": float(q[1]),
            "correction/ratio_p95": float(q[2]), "correction/ratio_max": float(values.max())}
