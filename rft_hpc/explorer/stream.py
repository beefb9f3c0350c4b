"""Streaming single-turn exploration: the groups of several explorer steps in flight at
once, each step committed, in order, as soon as its last group is scored.

The explorer submits a step's groups to the engine (`engines.requests`) once its weights
are new enough for that step (`role.required_version`) and fewer than `window` steps are in
flight; each group that the engine returns goes to the reward workers at once
(`RewardPool.submit`), so a slow reward holds only its own group while the engine generates
the next steps. A step is handed back (`completed`) when every one of its groups is scored,
and only after every earlier step: the step stays the unit of commit and of restart, and a
restarted explorer redoes exactly the uncommitted steps, with the same tasks. With
`window` 1 (the default of a strictly on-policy run) this is the step barrier: one step
generated, scored and written at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rft_hpc.buffer.records import Experience
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.requests import Completion, GroupRequest
from rft_hpc.explorer.workflow import SamplingSettings, reward_calls, scored_experiences
from rft_hpc.tasks.reward_pool import RewardPool, Scoring
from rft_hpc.tasks.task import Task


def steps_in_flight(config: ExperimentConfig) -> int:
    """`explorer.steps_in_flight`, or as many steps as the weights rule lets an explorer
    run ahead (`sync.offset + 1`); 1 when tasks are selected by pass rate."""
    if config.explorer.steps_in_flight is not None:
        return config.explorer.steps_in_flight
    if config.pipeline.uses_pass_rates():
        return 1
    return config.sync.offset + 1


@dataclass
class _Step:
    """One submitted step: its tasks, and its groups as they come back and are scored."""

    step: int
    tasks: list[Task]
    prompts: list[list[int]]
    first_group_id: int
    version: int
    """The engine's weights version when the step was submitted."""
    groups: dict[int, list[Completion]] = field(default_factory=dict)
    scoring: dict[int, Scoring] = field(default_factory=dict)
    generated: float | None = None
    """When its last group came back from the engine (monotonic clock)."""

    @property
    def scored(self) -> bool:
        return len(self.scoring) == len(self.tasks) and all(s.done for s in
                                                            self.scoring.values())


@dataclass
class CompletedStep:
    """A step whose every group is scored: its records and metrics, ready to write."""

    step: int
    version: int
    """The weights version it was submitted with (its records' first tokens are no older)."""
    experiences: list[Experience]
    metrics: dict[str, float]


class StepStream:
    """Keeps up to `window` explorer steps in flight on `engine`; see the module doc."""

    def __init__(self, engine: Any, settings: SamplingSettings, rewards: RewardPool,
                 window: int) -> None:
        self.engine, self.settings, self.rewards = engine, settings, rewards
        self.window = window
        self._steps: dict[int, _Step] = {}
        self._engine_seconds = 0.0  # engine time since the last completed step

    def __len__(self) -> int:
        """Steps in flight (submitted, not yet handed back)."""
        return len(self._steps)

    @property
    def has_room(self) -> bool:
        """Whether another step may be submitted."""
        return len(self._steps) < self.window

    def submit(self, step: int, tasks: Sequence[Task], *, first_group_id: int,
               seed: int) -> None:
        """Submit every group of `step` (group ids `first_group_id + index`); group j samples
        with seed `seed + j * repeat`, as one `generate` call of the step would."""
        s = self.settings
        prompts = [self.engine.prompt_ids(t) for t in tasks]
        self._steps[step] = _Step(step, list(tasks), prompts, first_group_id,
                                  self.engine.version)
        self.engine.submit([GroupRequest((step, j), p, s.repeat, s.max_new_tokens,
                                         s.temperature, seed + j * s.repeat)
                            for j, p in enumerate(prompts)])

    def advance(self, wait: float = 0.02) -> None:
        """One engine step when there are requests to generate (each finished group goes to
        the reward workers), else wait up to `wait` s for reward results."""
        if self.engine.in_flight:
            t0 = time.monotonic()
            finished = self.engine.poll()
            self._engine_seconds += time.monotonic() - t0
            for group in finished:
                step_no, j = group.key
                st = self._steps[step_no]
                st.groups[j] = group.completions
                st.scoring[j] = self.rewards.submit(reward_calls([st.tasks[j]],
                                                                 [group.completions]))
                if len(st.groups) == len(st.tasks):
                    st.generated = time.monotonic()
            self.rewards.pump(0.0)
        else:
            self.rewards.pump(wait)

    def completed(self) -> Iterator[CompletedStep]:
        """The oldest steps whose groups are all scored, in step order, each once."""
        while self._steps:
            st = self._steps[min(self._steps)]
            if not st.scored:
                return
            del self._steps[st.step]
            order = range(len(st.tasks))
            outcomes = [o for j in order for o in st.scoring[j].result()]
            experiences, metrics = scored_experiences(
                st.tasks, st.prompts, [st.groups[j] for j in order], outcomes,
                first_group_id=st.first_group_id, step=st.step, version=st.version)
            assert st.generated is not None
            metrics.update(generate_seconds=self._engine_seconds,
                           reward_seconds=time.monotonic() - st.generated,
                           steps_in_flight=float(len(self._steps) + 1))
            self._engine_seconds = 0.0
            yield CompletedStep(st.step, st.version, experiences, metrics)
