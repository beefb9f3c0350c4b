"""Explorer steps of concurrent multi-turn tasks, closed early by over-rollout.

Each task runs as a coroutine of the explorer's rollout loop (`explorer.rollout_loop`: its
trajectories' turns batched for the engine, its environments in host processes), so a slow
task holds only itself, and the tasks of several steps run at once (`window`). The oldest
step closes once `ceil(ratio x its tasks)` tasks in flight (its own or carried into it) are
done; its tasks still running (stragglers) are dropped (cancelled, their environments
freed; placeholder records) or carried: they run on and their records go into the step
during which they finish. Records
are written in the order of the tasks' stream positions, so with ratio 1 a step's records
are the same after any restart. Carried stragglers live only in this process: an explorer
that restarts has none, and the tasks that were in flight are lost (docs/multi-turn.md).
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
from rft_hpc.core.rundir import read_json
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.envs.base import check_env, is_async_env
from rft_hpc.explorer.multiturn import (
    SerialEngine,
    TaskOutcome,
    TurnSettings,
    run_task,
    with_tools,
)
from rft_hpc.explorer.protocols import CompletedStep, StepTasks
from rft_hpc.explorer.rollout_loop import RolloutLoop
from rft_hpc.tasks.task import Task


@dataclass
class _Running:
    task: Task
    group_id: int
    started: int
    version: int = 0
    future: Future[TaskOutcome] | None = None
    cancelled: bool = False
    outcome: TaskOutcome | None = None

    def cancel(self) -> None:
        """Stop the task (its coroutine is cancelled, its environments freed)."""
        self.cancelled = True
        if self.future is not None:
            self.future.cancel()


@dataclass
class _OpenStep:
    """A submitted step: its tasks running, until it closes."""

    step: StepTasks
    running: list[_Running]
    need: int
    """Tasks done (its own or carried into it) that close it: ceil(ratio x its tasks)."""
    version: int
    """The weights version it was submitted with: its records' (`policy_version`)."""


ADVANCE_SECONDS = 0.05
"""The longest `advance` waits for a task to finish while steps may still be submitted."""


class MultiTurnExplorer:
    """Runs the tasks of `window` explorer steps concurrently; see the module docstring.

    As the multi-turn `explorer.protocols.Workflow` it keeps up to `window` steps in flight
    (their tasks all running at once; `explorer.steps_in_flight`, default `sync.offset + 1`),
    hands them back in order as each closes, and takes new weights while they run: a task
    keeps the version it started with as its records' `policy_version`.
    """

    def __init__(self, engine: StreamingEngine, workflow: MultiTurnWorkflow,
                 turn: TurnSettings, over_rollout: OverRolloutConfig,
                 heartbeat: Path | None = None, window: int = 1) -> None:
        """`heartbeat`: the explorer's heartbeat file as a previous process left it; the
        stragglers it had in flight (`in_flight`) are lost, reported as
        `over_rollout/lost_on_restart` at the first step."""
        self.engine = engine if isinstance(engine, SerialEngine) else SerialEngine(engine)
        """The engine the rollout loop shares (new weights go in through it)."""
        check_env(workflow.env, workflow.env_args)  # a bad name or env_args: UserError now
        self.workflow = with_tools(workflow, self.engine.prompt, self.engine.tokenizer)
        self.rollouts = RolloutLoop(self.engine, shared_host=is_async_env(self.workflow.env))
        """Where the tasks run: an event loop, the turn batcher and the env hosts."""
        self.turn = turn
        self.over_rollout = over_rollout
        self.window = window
        self._open: list[_OpenStep] = []
        self._carried: list[_Running] = []
        self._done: queue.Queue[_Running] = queue.Queue()
        self._closed: list[CompletedStep] = []
        self._handed_back: float | None = None
        self._lost = 0
        if heartbeat is not None:
            try:
                self._lost = int(read_json(heartbeat).get("in_flight", 0))
            except (OSError, ValueError, AttributeError):
                self._lost = 0

    @property
    def in_flight(self) -> int:
        """Tasks still running (carried stragglers and the open steps' tasks; after `close`,
        the tasks it cancelled)."""
        return sum(r.outcome is None or r.cancelled for r in self._running())

    def _running(self) -> list[_Running]:
        return self._carried + [r for o in self._open for r in o.running]

    def _start(self, running: _Running, step: int, seed: int) -> None:
        loop = self.rollouts
        running.future = loop.start(run_task(
            self.engine, loop.batcher, loop.hosts, running.task, self.workflow, self.turn,
            group_id=running.group_id, step=step, seed=seed, version=running.version))

        def done(future: Future[TaskOutcome]) -> None:
            if future.cancelled():
                running.outcome = TaskOutcome(status="cancelled")
            elif future.exception() is not None:  # the step reports it, not the loop
                running.outcome = TaskOutcome(status="crash", message=repr(future.exception()))
            else:
                running.outcome = future.result()
            self._done.put(running)

        running.future.add_done_callback(done)

    def __len__(self) -> int:
        """Steps submitted and not yet handed back."""
        return len(self._open) + len(self._closed)

    @property
    def has_room(self) -> bool:
        """Whether fewer than `window` steps are running."""
        return len(self._open) < self.window

    def submit(self, step: StepTasks) -> None:
        """Start the step's tasks."""
        if not self.has_room:
            raise RuntimeError(f"step {step.step} submitted with {self.window} in flight")
        if self._handed_back is None:
            self._handed_back = time.monotonic()
        running = [_Running(task, group_id, step.step, self.engine.version)
                   for task, group_id in zip(step.tasks, step.group_ids, strict=True)]
        for j, r in enumerate(running):
            self._start(r, step.step, step.seed + j)
        need = math.ceil(self.over_rollout.ratio * max(len(step.tasks), 1) - 1e-9)
        self._open.append(_OpenStep(step, running, need, self.engine.version))

    def advance(self) -> None:
        """Wait for a task to finish (at most `ADVANCE_SECONDS` while more steps may be
        submitted, else until one does) and close the steps it completes, in order."""
        wait = ADVANCE_SECONDS if self.has_room else None
        try:
            self._done.get(timeout=wait)
            while True:
                self._done.get_nowait()
        except queue.Empty:
            pass
        while self._open and self._close(self._open[0]):
            self._open.pop(0)

    def _close(self, o: _OpenStep) -> bool:
        """Close the oldest open step once enough tasks are done (its own and those carried
        into it: all of them if fewer are in flight); False while it is not."""
        candidates = o.running + self._carried
        done = [r for r in candidates if r.outcome is not None and not r.cancelled]
        if len(done) < min(o.need, len(candidates)):
            return False
        ids = {id(r) for r in done}
        stragglers = [r for r in candidates if id(r) not in ids]
        drop = self.over_rollout.stragglers == "drop" or o.step.last
        for r in stragglers if drop else []:
            r.cancel()
        self._carried = [] if drop else stragglers
        experiences, metrics = self._collect(done, o.step.step, o.version,
                                             dropped=stragglers if drop else [],
                                             carried=0 if drop else len(stragglers))
        now = time.monotonic()
        assert self._handed_back is not None
        seconds, self._handed_back = now - self._handed_back, now
        self._closed.append(CompletedStep(o.step.step, o.version, experiences, metrics,
                                          seconds))
        return True

    def completed(self) -> Iterator[CompletedStep]:
        """The steps closed since the last call, in order."""
        closed, self._closed = self._closed, []
        yield from closed

    def run_step(self, tasks: Sequence[Task], *, first_group_id: int, step: int, seed: int,
                 last: bool = False) -> tuple[list[Experience], dict[str, float]]:
        """Start `tasks` (group ids `first_group_id + index`), wait until
        `ceil(ratio x max(len(tasks), 1))` tasks in flight are done (all, if fewer are in
        flight), and return the finished tasks' records with the step's metrics.

        A task that crashed the explorer's own code (not its environment) raises here.
        """
        self.submit(StepTasks(step, list(tasks), range(first_group_id,
                                                       first_group_id + len(tasks)),
                              seed, last=last))
        while True:
            self.advance()
            for done in self.completed():
                if done.step == step:
                    return done.experiences, done.metrics

    def _placeholders(self, r: _Running, step: int, version: int,
                      reason: str) -> list[Experience]:
        """`repeat` records of a task that yielded none: its prompt with mask 0 (nothing to
        train on, reward 0, an all-equal group), so that the step keeps its record count and
        the trainer's batches stay aligned with explorer steps (no wait for records that
        will never come)."""
        prompt = np.asarray(self.engine.encode(r.task.prompt), np.int32)
        return [Experience(tokens=prompt, prompt_length=len(prompt),
                           response_mask=np.zeros(len(prompt), np.uint8),
                           logprobs=np.zeros(len(prompt), np.float32), reward=0.0,
                           task_id=r.task.task_id, group_id=r.group_id, taskset=r.task.taskset,
                           policy_version=version, step=step,
                           info={"placeholder": reason, "turns": 0, "done": False})
                for _ in range(self.turn.repeat)]

    def _collect(self, finished: list[_Running], step: int, version: int, *,
                 dropped: list[_Running],
                 carried: int) -> tuple[list[Experience], dict[str, float]]:
        finished.sort(key=lambda r: (r.started, r.group_id))
        crashed = [r for r in finished if r.outcome is not None and r.outcome.status == "crash"]
        if crashed:
            raise RuntimeError(f"task {crashed[0].task.task_id} crashed the explorer: "
                               f"{crashed[0].outcome.message}")  # type: ignore[union-attr]
        outcomes = [r.outcome for r in finished if r.outcome is not None]
        experiences: list[Experience] = []
        trained: list[Experience] = []  # the real rollouts, for the metrics
        pairs = [(r, r.outcome) for r in finished] + [
            (r, None) for r in sorted(dropped, key=lambda r: (r.started, r.group_id))]
        for r, outcome in pairs:
            if outcome is not None and outcome.status == "ok":
                records = outcome.experiences
                trained.extend(records)
            else:
                records = self._placeholders(r, step, version, "dropped" if outcome is None
                                             else outcome.status)
            for e in records:
                e.step = step
                if r.started != step:  # one version per explorer step (the ledger's, audited)
                    e.info.update(carried_from=r.started, first_version=e.policy_version)
                    e.policy_version = version
            experiences.extend(records)
        metrics: dict[str, float] = {
            "tasks_finished": float(sum(o.status == "ok" for o in outcomes)),
            "over_rollout/dropped": float(len(dropped)),
            "over_rollout/carried": float(carried),
            "over_rollout/carried_in": float(sum(r.started != step for r in finished)),
            "over_rollout/lost_on_restart": float(self._lost),
            "env/errors": float(sum(o.errors for o in outcomes)),
            "env/timeouts": float(sum(o.timeouts for o in outcomes)),
            "env/retries": float(sum(o.retries for o in outcomes)),
            "env/failed_tasks": float(sum(o.status in ("error", "timeout") for o in outcomes)),
        }
        self._lost = 0
        if trained:  # the metrics of real rollouts only
            rewards = np.array([e.reward for e in trained], dtype=np.float64)
            metrics.update(
                reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                response_length=float(np.mean([int(e.response_mask.sum()) for e in trained])),
                turns=float(np.mean([e.info["turns"] for e in trained])),
                finished=float(np.mean([e.info["done"] for e in trained])),
                **tool_metrics(trained))
        return experiences, metrics

    def close(self) -> None:
        """Cancel every task still running (their hosts are killed); they still count in
        `in_flight`, which the last heartbeat reports as lost."""
        for r in self._running():
            if r.outcome is None:
                r.cancel()
        self.rollouts.close()


TOOL_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls")
"""What `envs.tools.ToolEnv` counts in each trajectory's info."""


def tool_metrics(trajectories: list[Experience]) -> dict[str, float]:
    """A step's tool use: each count summed over its trajectories, and of the calls the
    share that succeeded and the share that was malformed; nothing when none called."""
    totals = {k: float(sum(e.info.get(k, 0) for e in trajectories)) for k in TOOL_COUNTS}
    calls = totals["tool_calls"]
    if not calls:
        return {}
    failed = totals["tool_errors"] + totals["tool_timeouts"] + totals["malformed_calls"]
    return {**{f"tools/{k}": v for k, v in totals.items()},
            "tools/success_rate": (calls - failed) / calls,
            "tools/malformed_rate": totals["malformed_calls"] / calls}
