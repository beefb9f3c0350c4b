"""Held-out evaluation per task set: each of `pipeline.tasksets` scored on its own eval split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rft_hpc.config import ExperimentConfig
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def taskset_eval_tasks(config: ExperimentConfig) -> dict[str, list[Task]]:
    """name -> eval split of each task set that has one (empty without `tasksets`)."""
    out = {}
    for ts in config.pipeline.tasksets:
        _, held_out = build_tasks(ts.tasks, config.run.seed)
        if held_out:
            out[ts.name] = held_out
    return out


def taskset_accuracy(trainer: Any, sets: Mapping[str, list[Task]],
                     weights: Any = None) -> dict[str, float]:
    """`taskset/<name>/eval_accuracy` (and the other `Trainer.evaluate` scores): each task
    set's held-out scores by its tasks' own rewards."""
    return {f"taskset/{name}/{key}": value for name, tasks in sets.items()
            for key, value in trainer.evaluate(tasks, weights).items()}
