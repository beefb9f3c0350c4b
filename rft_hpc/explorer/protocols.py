"""The explorer's seams: a workflow (tasks in, scored records out) and the reward scorer a
workflow scores rollouts with.

The explorer's loop (`explorer.role`) drives any `Workflow` the same way: it asks whether
the workflow has room for another step, hands it a step's tasks (`StepTasks`) once the
engine holds weights new enough for that step, advances it, and writes each step it hands
back (`CompletedStep`), in step order. Single-turn streaming (`explorer.step_stream.StepStream`)
and multi-turn with over-rollout (`explorer.overrollout.MultiTurnExplorer`) are its two
implementations; agents with tool calls or rewards from models plug in as further ones,
without a change to the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rft_hpc.buffer.records import Experience
    from rft_hpc.engines.protocol import InferenceEngine
    from rft_hpc.tasks.reward_pool import RewardCall, Scoring
    from rft_hpc.tasks.task import Task


@dataclass(frozen=True)
class StepTasks:
    """One explorer step to submit: its tasks and how to sample them (the same after any
    restart)."""

    step: int
    tasks: Sequence[Task]
    group_ids: Sequence[int]
    """The group id of each task: its position in the task stream."""
    seed: int
    """The step's sampling seed (`role.step_seed`)."""
    reserve: Sequence[tuple[Task, int]] = field(default_factory=tuple)
    """Tasks (and their group ids) dynamic sampling may draw in place of uninformative ones;
    empty when it is off."""
    last: bool = False
    """Whether this is the run's last step (nothing may be carried past it)."""


@dataclass
class CompletedStep:
    """A step whose every group is scored: its records and metrics, ready to write."""

    step: int
    version: int
    """The weights version it was submitted with (its records' first tokens are no older)."""
    experiences: list[Experience]
    metrics: dict[str, float]
    seconds: float
    """The wall time the step cost the explorer: since the previous step was handed back
    (steps in flight overlap), or the step's own run (steps run one at a time)."""


@runtime_checkable
class Workflow(Protocol):
    """Turns explorer steps' tasks into scored records, up to a window of steps at a time.

    It promises: `completed` hands back every submitted step exactly once, in step order,
    with exactly the records the step's tasks produce under the given group ids and seed
    (what a restarted explorer redoes must be the same); a step is never handed back before
    every earlier one; `has_room` is False while `window` steps are in flight; new weights
    loaded into `engine` between calls are used from then on, and each record's
    `policy_version` says under which weights it was sampled. It raises only for faults of
    the explorer's own code or a broken reward (`RewardFailures`); an environment's or a
    reward's single fault costs its rollout only.
    """

    @property
    def engine(self) -> InferenceEngine:
        """The engine it samples with: new weights go into this one (it may serialize
        access to the engine the explorer built)."""
        ...

    @property
    def window(self) -> int:
        """The most steps it holds in flight at once."""
        ...

    @property
    def has_room(self) -> bool:
        """Whether another step may be submitted now."""
        ...

    @property
    def in_flight(self) -> int:
        """Tasks running beyond the steps in flight (carried stragglers), which a restart
        loses: the heartbeat's `in_flight`."""
        ...

    def __len__(self) -> int:
        """Steps submitted and not yet handed back: what a restart would redo."""
        ...

    def submit(self, step: StepTasks) -> None:
        """Take a step's tasks (only while `has_room`)."""
        ...

    def advance(self) -> None:
        """Move the steps in flight on: a bounded amount of work (an engine step, a short
        wait for rewards) or, for a workflow that runs a step at a time, the whole step."""
        ...

    def completed(self) -> Iterator[CompletedStep]:
        """The steps now complete that follow the last one handed back, in step order."""
        ...

    def close(self) -> None:
        """Stop what it runs (reward workers, rollout coroutines, environment hosts)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Scores rollouts with their tasks' rewards, without blocking the caller: the reward
    function pool (`tasks.reward_pool.RewardPool`), reward models
    (`tasks.model_reward.ModelScorer`; `tasks.remote_reward.RemoteModelScorer` when a
    reward job scores them), LLM judges (`tasks.judge_reward.JudgeScorer`) and the sum of a
    task's weighted terms over all of them (`tasks.reward_mix.RewardMix`, the explorer's,
    which routes each kind of term to the scorer of that kind: another scorer of a kind
    plugs in through `RewardMix(pool, scorers={kind: scorer})`).

    It promises: every call submitted gets one `RewardOutcome` in its `Scoring`, in call
    order; a reward that raises, dies or overruns scores its rollout 0 and says why
    (`RewardOutcome.error`, `timed_out`) instead of raising; results arrive only while
    `pump` runs.
    """

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` and return their `Scoring` at once."""
        ...

    def pump(self, timeout: float | None = 0.0) -> None:
        """Move the queued calls on and take in results, waiting up to `timeout` seconds
        (None: until something happens) for one."""
        ...

    @property
    def size(self) -> int:
        """Workers it scores with now (processes, replicas): the step metrics'
        `reward_workers`."""
        ...

    def close(self) -> None:
        """Stop scoring and free what it holds (worker processes, models)."""
        ...
