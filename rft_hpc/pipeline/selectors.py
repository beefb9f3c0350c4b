"""Task selectors: which tasks of one task set a step takes.

A stateless selector maps the set's `k`-th task slot (counted over all steps and explorers)
to a task, so any slot is found again after a restart. The `difficulty_based` selector reads
the pass rates this explorer saw in its committed steps (`rft_hpc.pipeline.task_stats`) and
draws with a generator seeded by (seed, set, step, explorer): also the same after a restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from rft_hpc.config.pipeline import (
    DifficultyBasedSelector,
    Easy2HardSelector,
    RandomSelector,
    SelectorConfig,
    SequentialSelector,
    ShuffleSelector,
)
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.task import Task

PassRates = Mapping[str, tuple[float, int]]
"""task_id -> (passed rollouts, rollouts) as one explorer saw them."""


class Selector(Protocol):
    """Picks task indices of one task set."""

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        """Indices (into the set's task list) of the set's slots `first .. first+count-1`,
        which explorer `explorer` fills at step `step`."""


class Sequential:
    """Slot k is task k mod n (file order)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        return [k % self.n for k in range(first, first + count)]


class Shuffle:
    """Slot k is entry k mod n of the permutation of epoch k // n, seeded by (seed, epoch)
    (plus the set's index when several sets are mixed): the task stream rft-hpc always had."""

    def __init__(self, n: int, seed: list[int]) -> None:
        self.n, self.seed = n, seed
        self._perm: tuple[int, np.ndarray] | None = None

    def _epoch(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:  # keep one epoch cached
            rng = np.random.default_rng([*self.seed[:1], epoch, *self.seed[1:]])
            self._perm = (epoch, rng.permutation(self.n))
        return self._perm[1]

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        return [int(self._epoch(k // self.n)[k % self.n]) for k in range(first, first + count)]


class Random:
    """Slot k is a uniform draw seeded by (seed, k): tasks may repeat at any time."""

    def __init__(self, n: int, seed: list[int]) -> None:
        self.n, self.seed = n, seed

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        return [int(np.random.default_rng([*self.seed, k]).integers(self.n))
                for k in range(first, first + count)]


class Easy2Hard:
    """Slot k is the (k mod n)-th easiest task (ties in file order)."""

    def __init__(self, tasks: Sequence[Task], key: str) -> None:
        difficulty = [task_difficulty(t, key) for t in tasks]
        self.order = sorted(range(len(tasks)), key=lambda i: (difficulty[i], i))

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        return [self.order[k % len(self.order)] for k in range(first, first + count)]


class DifficultyBased:
    """Draws `count` different tasks (fewer tasks than that: all, then again) with weight
    exp(-|pass rate - target| / temperature); unseen tasks count as at the target."""

    def __init__(self, tasks: Sequence[Task], config: DifficultyBasedSelector,
                 seed: list[int]) -> None:
        self.ids = [t.task_id for t in tasks]
        self.config, self.seed = config, seed

    def weights(self, pass_rates: PassRates) -> np.ndarray:
        """Normalized draw probability of each task."""
        gap = np.zeros(len(self.ids))
        for i, task_id in enumerate(self.ids):
            passed, seen = pass_rates.get(task_id, (0.0, 0))
            if seen:
                gap[i] = abs(passed / seen - self.config.target)
        w = np.exp(-(gap - gap.min()) / self.config.temperature)
        return w / w.sum()

    def pick(self, first: int, count: int, *, step: int, explorer: int,
             pass_rates: PassRates) -> list[int]:
        rng = np.random.default_rng([*self.seed, step, explorer])
        p = self.weights(pass_rates)
        out: list[int] = []
        while len(out) < count:
            take = min(count - len(out), len(self.ids))
            out.extend(int(i) for i in rng.choice(len(self.ids), take, replace=False, p=p))
        return out


def task_difficulty(task: Task, key: str) -> float:
    """The task's difficulty `info[key]`; a `UserError` naming the task when it has none."""
    value = task.info.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"task {task.task_id!r} (task set {task.taskset!r}) has no numeric "
                        f"info.{key}, which the offline_easy2hard selector sorts by")
    return float(value)


def build_selector(config: SelectorConfig, tasks: Sequence[Task], seed: list[int]) -> Selector:
    """The selector `config` describes over `tasks`, seeded by `seed`."""
    if isinstance(config, SequentialSelector):
        return Sequential(len(tasks))
    if isinstance(config, ShuffleSelector):
        return Shuffle(len(tasks), seed)
    if isinstance(config, RandomSelector):
        return Random(len(tasks), seed)
    if isinstance(config, Easy2HardSelector):
        return Easy2Hard(tasks, config.key)
    if isinstance(config, DifficultyBasedSelector):
        return DifficultyBased(tasks, config, seed)
    raise AssertionError(f"unknown selector {config!r}")
