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

Dynamic sampling (`pipeline.dynamic_sampling`): a scored group whose rewards hardly vary is
set aside and the step draws the next of its reserve tasks in its place, under the weights
the engine holds, so that the groups still out plus the informative ones scored make the
step's size; once they do, or its reserve is spent, the step is complete and holds
informative groups first, then set-aside ones to fill it (counted as `dynamic/*`). A step's
size never changes, so the weights rule (`role.required_version`) never waits for records
that will not come (docs/pipeline.md#dynamic-sampling).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.pipeline import DynamicSampling
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.requests import Completion, GroupRequest
from rft_hpc.engines.teacher import TeacherScorer, reverse_kl
from rft_hpc.explorer.protocols import CompletedStep, Scorer, StepTasks
from rft_hpc.explorer.workflow import (
    RewardFailures,
    SamplingSettings,
    reward_calls,
    scored_experiences,
)
from rft_hpc.tasks.reward_pool import Scoring
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
    size: int
    """Groups the step writes (its own tasks; dynamic sampling draws more, keeps this many)."""
    tasks: list[Task]
    """Tasks drawn so far: the step's own, then reserve tasks in the order drawn."""
    prompts: list[list[int]]
    group_ids: list[int]
    seed: int
    version: int
    """The engine's weights version when the step was submitted."""
    reserve: list[tuple[Task, int]] = field(default_factory=list)
    """Reserve tasks (and their group ids) dynamic sampling may still draw."""
    groups: dict[int, list[Completion]] = field(default_factory=dict)
    scoring: dict[int, Scoring] = field(default_factory=dict)
    baselines: dict[int, Scoring] = field(default_factory=dict)
    """ReMax: the scoring of each group's greedy response (`StepStream.greedy_baseline`)."""
    informative: dict[int, bool] = field(default_factory=dict)
    """Scored groups: whether their rewards vary (always True without dynamic sampling)."""
    generated: float | None = None
    """When its last group came back from the engine (monotonic clock)."""

    @property
    def good(self) -> int:
        """Scored groups that are informative."""
        return sum(self.informative.values())

    @property
    def out(self) -> int:
        """Groups drawn and not yet scored."""
        return len(self.tasks) - len(self.informative)

    @property
    def scored(self) -> bool:
        """Whether the step is complete: every drawn group scored, and enough of them
        informative or no reserve left to draw."""
        return not self.out and (self.good >= self.size or not self.reserve)

    def kept(self) -> list[int]:
        """Indices of the groups the step writes, in draw order: the informative ones, then
        set-aside ones (first drawn first) up to the step's size."""
        good = [j for j in range(len(self.tasks)) if self.informative[j]][:self.size]
        rest = [j for j in range(len(self.tasks)) if not self.informative[j]]
        return sorted(good + rest[:self.size - len(good)])


class StepStream:
    """The single-turn `explorer.protocols.Workflow`: keeps up to `window` explorer steps
    in flight on `engine`, scoring with `rewards`; see the module doc."""

    def __init__(self, engine: StreamingEngine, settings: SamplingSettings, rewards: Scorer,
                 window: int, dynamic: DynamicSampling | None = None,
                 failures: RewardFailures | None = None, greedy_baseline: bool = False,
                 teacher: TeacherScorer | None = None) -> None:
        """`failures`: counts each completed step's reward calls and raises once too many
        failed (before the step is handed back, so a restart redoes it); None: not
        counted. `greedy_baseline` (ReMax): each group also gets one greedy response,
        scored, its reward in every record's `info["greedy_reward"]` (the group's mean
        reward, with `info["greedy_reward_failed"]`, when its call failed). `teacher`
        (on-policy distillation): scores each completed step's records token by token. The
        stream owns `rewards` and `teacher` from now on (`close` stops them)."""
        self.engine, self.settings, self.rewards = engine, settings, rewards
        self.teacher = teacher
        self.greedy_baseline = greedy_baseline
        self.window = window
        self.dynamic = dynamic if dynamic is not None and dynamic.enabled else None
        self.failures = failures
        self._steps: dict[int, _Step] = {}
        self._engine_seconds = 0.0  # engine time since the last completed step
        self._reward_wait_seconds = 0.0  # scorer time since the last completed step
        self._handed_back: float | None = None  # when the last step was handed back

    def __len__(self) -> int:
        """Steps in flight (submitted, not yet handed back)."""
        return len(self._steps)

    @property
    def has_room(self) -> bool:
        """Whether another step may be submitted."""
        return len(self._steps) < self.window

    @property
    def in_flight(self) -> int:
        """0: no task outlives its step here."""
        return 0

    def submit(self, step: StepTasks) -> None:
        """Submit every group of `step` (with its group ids); the j-th group drawn samples
        with seed `step.seed + j * repeat`, as one `generate` call of the step would. Its
        `reserve`: the tasks and group ids dynamic sampling draws from, in order."""
        if self._handed_back is None:
            self._handed_back = time.monotonic()
        st = _Step(step.step, len(step.tasks), [], [], [], step.seed, self.engine.version,
                   reserve=list(step.reserve) if self.dynamic is not None else [])
        self._steps[step.step] = st
        self._draw(st, list(zip(step.tasks, step.group_ids, strict=True)))

    def _draw(self, st: _Step, tasks: Sequence[tuple[Task, int]]) -> None:
        """Submit groups for `tasks` (with their group ids) as the step's next ones."""
        s = self.settings
        requests, greedy = [], []  # the greedy ones after: an engine batches alike requests
        for task, group_id in tasks:
            j = len(st.tasks)
            st.tasks.append(task)
            st.group_ids.append(group_id)
            st.prompts.append(self.engine.prompt_ids(task))
            requests.append(GroupRequest((st.step, j), st.prompts[j], s.repeat,
                                         s.max_new_tokens, s.temperature,
                                         st.seed + j * s.repeat))
            if self.greedy_baseline:  # ReMax's baseline: the greedy response's reward
                greedy.append(GroupRequest((st.step, j, GREEDY), st.prompts[j], 1,
                                           s.max_new_tokens, 0.0, st.seed + j * s.repeat))
        st.generated = None
        self.engine.submit(requests + greedy)

    def advance(self, wait: float = 0.02) -> None:
        """One engine step when there are requests to generate (each finished group goes to
        the reward workers), else wait up to `wait` s for reward results; then draw the
        replacements dynamic sampling asks for."""
        if self.engine.in_flight:
            t0 = time.monotonic()
            finished = self.engine.poll()
            self._engine_seconds += time.monotonic() - t0
            t0 = time.monotonic()
            for group in finished:
                step_no, j = group.key[:2]
                st = self._steps[step_no]
                if len(group.key) == 3:  # a greedy response (ReMax's baseline)
                    st.baselines[j] = self.rewards.submit(reward_calls([st.tasks[j]],
                                                                       [group.completions]))
                    continue
                st.groups[j] = group.completions
                st.scoring[j] = self.rewards.submit(reward_calls([st.tasks[j]],
                                                                 [group.completions]))
                if len(st.groups) == len(st.tasks):
                    st.generated = time.monotonic()
            self.rewards.pump(0.0)
        else:
            t0 = time.monotonic()
            self.rewards.pump(wait)
        # the loop is one thread: time in the scorer (reward models' forwards, waits for
        # results with nothing left to generate) is time the engine does not generate
        self._reward_wait_seconds += time.monotonic() - t0
        for st in self._steps.values():
            self._judge(st)

    def _judge(self, st: _Step) -> None:
        """Mark the step's newly scored groups informative or not, and draw as many reserve
        tasks as the step now lacks."""
        for j, scoring in st.scoring.items():
            if self.greedy_baseline and not (j in st.baselines and st.baselines[j].done):
                continue  # scored once its greedy response is too
            if j not in st.informative and scoring.done:
                rewards = [o.score for o in scoring.result()]
                st.informative[j] = (self.dynamic is None
                                     or float(np.std(rewards)) > self.dynamic.min_std)
        lacking = st.size - st.good - st.out
        if lacking > 0 and st.reserve:
            # each group samples from its own seed (`GroupRequest.seed`): the records do not
            # depend on which draws the scoring's timing put together
            self._draw(st, st.reserve[:lacking])
            del st.reserve[:lacking]

    def completed(self) -> Iterator[CompletedStep]:
        """The oldest steps whose groups are all scored, in step order, each once; each
        step's `seconds` run from the previous one's hand-back (or the first submission)."""
        while self._steps:
            st = self._steps[min(self._steps)]
            if not st.scored:
                return
            del self._steps[st.step]
            kept = st.kept()
            outcomes = [o for j in kept for o in st.scoring[j].result()]
            experiences, metrics = scored_experiences(
                [st.tasks[j] for j in kept], [st.prompts[j] for j in kept],
                [st.groups[j] for j in kept], outcomes,
                group_ids=[st.group_ids[j] for j in kept], step=st.step, version=st.version)
            if self.greedy_baseline:
                _attach_baselines(st, kept, experiences)
            if self.teacher is not None:
                t0 = time.monotonic()
                self.teacher.score(experiences)
                metrics.update(teacher_seconds=time.monotonic() - t0,
                               teacher_reverse_kl=reverse_kl(experiences))
            assert st.generated is not None
            metrics.update(generate_seconds=self._engine_seconds,
                           reward_wait_seconds=self._reward_wait_seconds,
                           reward_seconds=time.monotonic() - st.generated,
                           steps_in_flight=float(len(self._steps) + 1),
                           reward_workers=float(self.rewards.size))
            if self.dynamic is not None:
                metrics.update(dynamic_metrics(st))
            self._engine_seconds = self._reward_wait_seconds = 0.0
            if self.failures is not None:  # before the write: a restart redoes this step
                self.failures.add(len(experiences), metrics)
            now = time.monotonic()
            assert self._handed_back is not None
            seconds, self._handed_back = now - self._handed_back, now
            yield CompletedStep(st.step, st.version, experiences, metrics, seconds)

    def close(self) -> None:
        """Stop the reward scorer and free the teacher; the requests still in the engine
        are left to it."""
        self.rewards.close()
        if self.teacher is not None:
            self.teacher.close()


GREEDY = "greedy"
"""The third part of a greedy response's request key, `(step, group, GREEDY)`."""


def _attach_baselines(st: _Step, kept: list[int], experiences: list) -> None:
    """Each record's `info["greedy_reward"]`: the reward of its group's greedy response, or
    the group's mean reward when that call failed (`info["greedy_reward_failed"]`)."""
    records = iter(experiences)
    for j in kept:
        (outcome,) = st.baselines[j].result()
        group = [next(records) for _ in st.groups[j]]
        failed = outcome.failed
        value = float(np.mean([e.reward for e in group])) if failed else outcome.score
        for e in group:
            e.info["greedy_reward"] = value
            if failed:
                e.info["greedy_reward_failed"] = True


def dynamic_metrics(st: _Step) -> dict[str, float]:
    """`dynamic/*` of a completed step: groups drawn, dropped (drawn and not written), kept
    although their rewards are all equal (the reserve ran out), and the mean reward of every
    drawn group (the step's `reward_mean` is of the kept ones only)."""
    drawn = [o.score for j in range(len(st.tasks)) for o in st.scoring[j].result()]
    return {"dynamic/drawn_groups": float(len(st.tasks)),
            "dynamic/dropped_groups": float(len(st.tasks) - st.size),
            "dynamic/kept_equal_groups": float(max(0, st.size - st.good)),
            "dynamic/drawn_reward_mean": float(np.mean(drawn))}
