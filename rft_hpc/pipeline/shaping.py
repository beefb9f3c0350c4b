"""Reward shaping: changes to each rollout's reward, applied in order by the explorer.

Each shaper reports `shaping/<name>/reward_change`: how much it moved the mean reward of the
step's rollouts. Shapers see the response text (`info["response"]`) and the response tokens
(the records' `response_mask`). Placeholder records (`info["placeholder"]`: a task that failed
or was dropped, with no response) are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.config.pipeline import FormatReward, LengthPenalty, ShaperConfig, operator_name


def response_tokens(e: Experience) -> int:
    """Tokens of the response (those the policy generated)."""
    assert e.response_mask is not None
    return int(e.response_mask.sum())


def shaping_delta(shaper: ShaperConfig, e: Experience) -> float:
    """What `shaper` adds to the reward of `e`."""
    if isinstance(shaper, FormatReward):
        text = str(e.info.get("response", ""))
        match = (re.fullmatch(shaper.pattern, text.strip()) if shaper.full_match
                 else re.search(shaper.pattern, text))
        return shaper.bonus if match else shaper.penalty
    if isinstance(shaper, LengthPenalty):
        return -shaper.coef * max(0, response_tokens(e) - shaper.max_tokens)
    raise AssertionError(f"unknown shaper {shaper!r}")


def shape_rewards(experiences: Sequence[Experience], chain: Sequence[ShaperConfig],
                  ) -> dict[str, float]:
    """Apply `chain` to the rewards of `experiences` (placeholders excepted) in place; the
    first shaping stores the reward before it as `info["raw_reward"]`. Returns the metrics."""
    metrics: dict[str, float] = {}
    experiences = [e for e in experiences if not e.info.get("placeholder")]
    if not chain or not experiences:
        return metrics
    for e in experiences:
        e.info.setdefault("raw_reward", e.reward)
    for shaper in chain:
        deltas = np.array([shaping_delta(shaper, e) for e in experiences], dtype=np.float64)
        for e, d in zip(experiences, deltas, strict=True):
            e.reward = float(e.reward + d)
        metrics[f"shaping/{operator_name(shaper)}/reward_change"] = float(deltas.mean())
    return metrics
