"""The task stream of a run: several task sets mixed by weight, each with its own selector.

Global slot p = (step x explorers + explorer) x tasks_per_step + j is the j-th task of
explorer `explorer` at `step`. Slots are dealt to the task sets in a fixed round of R slots
(R = the weights as small integers, summed), spread evenly by smooth weighted round robin;
the set's own slot index k follows from p in O(1), so any step's tasks are found again after
a restart without replaying earlier steps. With one task set R = 1 and k = p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.pipeline import SelectorConfig
from rft_hpc.core.errors import UserError
from rft_hpc.pipeline.selectors import PassRates, Selector, build_selector
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task

MAX_ROUND = 100_000
"""Longest round of slots; finer weight ratios are refused."""


@dataclass(frozen=True)
class TaskSet:
    """One task set of the stream: its tasks, its weight and its selector's config."""

    name: str
    weight: float
    tasks: list[Task]
    selector: SelectorConfig


def round_pattern(weights: Sequence[float]) -> list[int]:
    """The task set of each slot of one round: set i appears in proportion to weights[i],
    spread evenly (smooth weighted round robin; ties to the lower index)."""
    fracs = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fracs))
    quota = [int(f * scale) for f in fracs]
    g = math.gcd(*quota)
    quota = [q // g for q in quota]
    total = sum(quota)
    if total > MAX_ROUND:
        raise UserError(f"pipeline.tasksets: weights {list(weights)} need a round of {total} "
                        f"slots (at most {MAX_ROUND}); use simpler ratios")
    current = [0] * len(quota)
    pattern = []
    for _ in range(total):
        current = [c + q for c, q in zip(current, quota, strict=True)]
        best = max(range(len(quota)), key=lambda i: (current[i], -i))
        current[best] -= total
        pattern.append(best)
    return pattern


class MixedTaskStream:
    """Seeded, restart-safe assignment of tasks to (step, explorer) from weighted task sets."""

    def __init__(self, sets: Sequence[TaskSet], *, seed: int, explorers: int,
                 tasks_per_step: int) -> None:
        if not sets:
            raise ValueError("a task stream needs at least one task set")
        for s in sets:
            if not s.tasks:
                raise UserError(f"task set {s.name!r} holds no training tasks")
        self.sets = list(sets)
        self.explorers, self.tasks_per_step = explorers, tasks_per_step
        single = len(sets) == 1
        self.selectors: list[Selector] = [
            build_selector(s.selector, s.tasks, [seed] if single else [seed, i + 1])
            for i, s in enumerate(sets)]
        self.pattern = np.asarray(round_pattern([s.weight for s in sets]), dtype=np.int64)
        counts = np.zeros((len(self.pattern) + 1, len(sets)), dtype=np.int64)
        for o, j in enumerate(self.pattern):
            counts[o + 1] = counts[o]
            counts[o + 1, j] += 1
        self.before = counts  # before[o, j]: slots of set j in pattern[:o]

    def slot(self, p: int) -> tuple[int, int]:
        """(task set, the set's own slot index) of global slot `p`."""
        rounds, o = divmod(p, len(self.pattern))
        j = int(self.pattern[o])
        return j, int(rounds * self.before[-1, j] + self.before[o, j])

    def tasks_for(self, step: int, explorer: int, pass_rates: PassRates | None = None,
                  ) -> list[Task]:
        """The tasks explorer `explorer` works on at step `step` (the same ones after any
        restart, given the pass rates of the steps before `step`)."""
        first = (step * self.explorers + explorer) * self.tasks_per_step
        slots = [self.slot(p) for p in range(first, first + self.tasks_per_step)]
        out: list[Task | None] = [None] * len(slots)
        for j, tset in enumerate(self.sets):
            mine = [(pos, k) for pos, (sj, k) in enumerate(slots) if sj == j]
            if not mine:
                continue
            picked = self.selectors[j].pick(mine[0][1], len(mine), step=step,
                                            explorer=explorer, pass_rates=pass_rates or {})
            for (pos, _), i in zip(mine, picked, strict=True):
                out[pos] = tset.tasks[i]
        return [t for t in out if t is not None]


def task_sets(config: ExperimentConfig) -> list[TaskSet]:
    """The explorers' training task sets: `pipeline.tasksets`, or `tasks` alone."""
    pipe, seed = config.pipeline, config.run.seed
    if not pipe.tasksets:
        train, _ = build_tasks(config.tasks, seed)
        return [TaskSet("tasks", 1.0, train, pipe.task_selector)]
    out = []
    for ts in pipe.tasksets:
        train, _ = build_tasks(ts.tasks, seed)
        out.append(TaskSet(ts.name, ts.weight, [replace(t, taskset=ts.name) for t in train],
                           ts.task_selector))
    return out


RESERVE_SEED = 0x5EED
"""Mixed into the run's seed for the reserve stream of dynamic sampling."""


def build_task_stream(config: ExperimentConfig, *, reserve: bool = False,
                      sets: Sequence[TaskSet] | None = None) -> MixedTaskStream:
    """The task stream every explorer of `config` shares; `reserve`: the stream of the tasks
    dynamic sampling draws when it drops a group (`pipeline.dynamic_sampling`), seeded apart
    from the main stream, `max_groups - tasks_per_step` slots per explorer step."""
    per_step = config.explorer.tasks_per_step
    seed = config.run.seed
    if reserve:
        per_step = max(1, config.pipeline.dynamic_sampling.budget(per_step) - per_step)
        seed = int(np.random.SeedSequence([seed, RESERVE_SEED]).generate_state(1)[0])
    return MixedTaskStream(task_sets(config) if sets is None else sets, seed=seed,
                           explorers=config.explorer.count, tasks_per_step=per_step)
