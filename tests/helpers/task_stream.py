"""The task stream as it was before the data pipeline: the reference that the pipeline's
default (a `shuffle` selector over one task set, `rft_hpc.pipeline.task_stream`) reproduces bit
for bit, so that a seeded run takes the same tasks as it always did.

The stream is a sequence of seeded permutations of the training tasks (one per epoch).
Global step s gives `tasks_per_step` tasks to each of the E explorers, consecutive in the
stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rft_hpc.tasks.task import Task


class TaskStream:
    """Seeded, restart-safe assignment of tasks to (step, explorer)."""

    def __init__(self, tasks: Sequence[Task], *, seed: int, explorers: int,
                 tasks_per_step: int) -> None:
        if not tasks:
            raise ValueError("a task stream needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.explorers = explorers
        self.tasks_per_step = tasks_per_step
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch])
            self._perms = {epoch: rng.permutation(len(self.tasks))}  # keep one epoch cached
        return self._perms[epoch]

    def tasks_for(self, step: int, explorer: int) -> list[Task]:
        """The tasks explorer `explorer` works on at step `step` (always the same ones)."""
        n = len(self.tasks)
        first = (step * self.explorers + explorer) * self.tasks_per_step
        out = []
        for i in range(first, first + self.tasks_per_step):
            out.append(self.tasks[int(self._perm(i // n)[i % n])])
        return out
