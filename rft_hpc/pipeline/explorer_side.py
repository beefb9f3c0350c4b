"""The explorer's part of the data pipeline, behind two calls of the explorer loop:
`tasks_for(step)` (task selection and mixing) and `process(step, experiences)` (pass-rate
bookkeeping, per-task-set metrics, reward shaping) before the step's records are written.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.pipeline.shaping import shape_rewards
from rft_hpc.pipeline.task_stats import TaskStats
from rft_hpc.pipeline.task_stream import build_task_stream, task_sets
from rft_hpc.tasks.task import Task

RESERVE_GROUPS = 1 << 40
"""Group ids of dynamic sampling's reserve tasks start here."""


def real(experiences: Sequence[Experience]) -> list[Experience]:
    """The rollouts that are not placeholders of a failed or dropped task."""
    return [e for e in experiences if not e.info.get("placeholder")]


def taskset_metrics(experiences: Sequence[Experience], pass_threshold: float,
                    ) -> dict[str, float]:
    """`taskset/<name>/{count,reward_mean,pass_rate}` of the rollouts of each task set
    (placeholders of failed or dropped tasks left out)."""
    by_set: dict[str, list[float]] = defaultdict(list)
    for e in real(experiences):
        by_set[e.taskset].append(e.reward)
    out: dict[str, float] = {}
    for name, rewards in sorted(by_set.items()):
        r = np.asarray(rewards, dtype=np.float64)
        out[f"taskset/{name}/count"] = float(len(r))
        out[f"taskset/{name}/reward_mean"] = float(r.mean())
        out[f"taskset/{name}/pass_rate"] = float(np.mean(r >= pass_threshold))
    return out


def pass_counts(experiences: Sequence[Experience], pass_threshold: float,
                ) -> dict[str, tuple[float, int]]:
    """task_id -> (passed rollouts, rollouts) of one step (placeholders left out)."""
    counts: dict[str, tuple[float, int]] = {}
    for e in real(experiences):
        passed, seen = counts.get(e.task_id, (0.0, 0))
        counts[e.task_id] = (passed + float(e.reward >= pass_threshold), seen + 1)
    return counts


class ExplorerPipeline:
    """Task selection and experience processing of explorer `index`."""

    def __init__(self, config: ExperimentConfig, run: RunDir, index: int,
                 committed_step: int) -> None:
        self.config, self.index = config, index
        self.pipe = config.pipeline
        sets = task_sets(config)
        self.stream = build_task_stream(config, sets=sets)
        self.reserve = (build_task_stream(config, reserve=True, sets=sets)
                        if self.pipe.dynamic_sampling.enabled else None)
        self.stats = (TaskStats(run.pipeline_stats(f"explorer-{index}"),
                                committed_step, durable=config.buffer.fsync)
                      if self.pipe.uses_pass_rates() else None)

    def tasks_for(self, step: int) -> list[Task]:
        """This explorer's tasks of `step` (the same after any restart)."""
        rates = self.stats.rates if self.stats is not None else None
        return self.stream.tasks_for(step, self.index, rates)

    def reserve_tasks_for(self, step: int) -> list[tuple[Task, int]]:
        """The tasks dynamic sampling may draw at `step`, in the order it draws them, with
        their group ids (the same after any restart); [] when it is off. Reserve group ids
        are `RESERVE_GROUPS` plus the task's position in the reserve stream: apart from the
        main stream's ids (its positions) and unique across explorers and steps."""
        if self.reserve is None:
            return []
        rates = self.stats.rates if self.stats is not None else None
        tasks = self.reserve.tasks_for(step, self.index, rates)
        first = RESERVE_GROUPS + (step * self.reserve.explorers + self.index) * \
            self.reserve.tasks_per_step
        return [(t, first + r) for r, t in enumerate(tasks)]

    def process(self, step: int, experiences: Sequence[Experience]) -> dict[str, float]:
        """Record the step's pass rates, shape the rewards in place; returns the metrics.
        Call it once per step, before the step's records are written."""
        threshold = self.pipe.pass_threshold
        metrics = taskset_metrics(experiences, threshold)
        if self.stats is not None:
            self.stats.record(step, pass_counts(experiences, threshold))
        metrics.update(shape_rewards(experiences, self.pipe.reward_shaping))
        return metrics

    def close(self) -> None:
        """Close the pass-rate file."""
        if self.stats is not None:
            self.stats.close()
