"""A trainer step's metrics, gathered from the ranks into those of the whole batch.

Each rank reports two kinds of numbers: parts of the loss already divided by whole-batch
divisors (they add up over the ranks: `loss`, `pg_loss`, `kl_ref`, ...) and means over its
own rows (`clip_fraction`, `ratio_mean`, DPO's `accuracy_mean`, ...), which are weighted by
the rank's tokens, rollout tokens (MIX's `usual/`) or pairs (DPO) and averaged. The result is
the same with any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUMMED = frozenset({"loss", "pg_loss", "sft_loss", "dpo_loss", "opmd_loss", "usual/pg_loss",
                    "expert/sft_loss", "kl_ref", "entropy", "value_loss",
                    "unknown_logprob_records", "simpo_loss", "orpo_loss", "orpo_nll",
                    "kto_loss"})
"""Metrics that add up over the ranks (whole-batch divisors, or counts)."""
PER_PAIR = frozenset({"chosen_reward", "rejected_reward", "accuracy_mean", "log_odds_ratio",
                      "kto_kl"})
"""The pair losses' means over pairs (DPO, SimPO, ORPO, KTO)."""


@dataclass
class LocalMetrics:
    """One rank's metrics of one step (see the module doc)."""

    tokens: float
    """Trained tokens of this rank's rows."""
    rows: float
    """Rows of this rank (two per DPO pair)."""
    rl_tokens: float | None = None
    """MIX: trained tokens of this rank's rollout rows."""
    sums: dict[str, float] = field(default_factory=dict)
    weighted: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name -> (value * weight, weight)."""

    def add_sum(self, name: str, value: float) -> None:
        """A number that adds up over the ranks."""
        self.sums[name] = self.sums.get(name, 0.0) + value

    def add_parts(self, parts: dict[str, torch.Tensor]) -> None:
        """A loss function's metrics, each classified by its name."""
        for name, value in parts.items():
            v = float(value)
            if name in SUMMED:
                self.add_sum(name, v)
                continue
            if name in PER_PAIR:
                weight = self.rows / 2
            elif name.startswith("usual/") and self.rl_tokens is not None:
                weight = self.rl_tokens
            else:
                weight = self.tokens
            self.weighted[name] = (v * weight, weight)


def merge_metrics(ranks: list[LocalMetrics]) -> dict[str, float]:
    """The whole batch's metrics from every rank's (in rank order), sorted by name."""
    sums: dict[str, float] = {}
    weighted: dict[str, list[float]] = {}
    for m in ranks:
        for name, v in m.sums.items():
            sums[name] = sums.get(name, 0.0) + v
        for name, (vw, w) in m.weighted.items():
            acc = weighted.setdefault(name, [0.0, 0.0])
            acc[0] += vw
            acc[1] += w
    out = {name: v for name, v in sums.items()
           if not (name == "unknown_logprob_records" and v == 0)}
    out.update({name: vw / w if w else 0.0 for name, (vw, w) in weighted.items()})
    return dict(sorted(out.items()))
