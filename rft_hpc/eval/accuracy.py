"""Held-out scores of a policy during training: `score_tasks` with the eval settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rft_hpc.config.schema import EvalConfig
from rft_hpc.engines.protocol import InferenceEngine
from rft_hpc.eval.bench_score import score_tasks
from rft_hpc.tasks.task import Task


def heldout_scores(engine: InferenceEngine, tasks: Sequence[Task], settings: EvalConfig, *,
                   temperature: float, seed: int,
                   answers: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """`eval_accuracy` (greedy answers whose task reward is at least 1), `eval_reward`
    (their mean reward) and, with `settings.k` samples per task at `temperature`,
    `eval_mean@k` and `eval_pass@k`; `eval_reward_errors` counts reward calls that raised.
    Every value is NaN for no tasks. Each task's greedy answer and its reward go into
    `answers` when given (`score_tasks`)."""
    keys = ["accuracy", "reward", "reward_errors"]
    keys += [f"mean@{settings.k}", f"pass@{settings.k}"] if settings.k else []
    if not tasks:
        return {f"eval_{key}": float("nan") for key in keys}
    scores = score_tasks(engine, tasks, k=settings.k, n=settings.k,
                         temperature=temperature or 1.0,
                         max_new_tokens=settings.max_new_tokens,
                         batch_size=settings.batch_size, seed=seed, answers=answers)
    scores.update(accuracy=scores["greedy_accuracy"], reward=scores["greedy_reward"])
    return {f"eval_{key}": float(scores[key]) for key in keys}
