"""The explorer's reward scorer over every kind of reward term: each call goes to the reward
function pool and/or the reward model scorer, and its reward is the weighted sum of its
terms' scores once all of them are in.

A batch whose tasks all have one function for a reward (no `reward_terms`) goes to the pool
as it always did, its outcomes untouched. A task with terms has each term scored as a call
of its own (`reward_terms.term_task`): function terms in the pool's worker processes, model
terms in batched forwards in the explorer (`tasks.model_reward`). A term that fails
(raises, dies, times out) fails the whole call: it scores 0 and says which term failed and
why, as a raising reward function does. Reward shaping (`pipeline.reward_shaping`) applies
to the sum, in the explorer, as to any reward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rft_hpc.config.rewards import RewardModelSpec
from rft_hpc.tasks.model_reward import ModelScorer
from rft_hpc.tasks.reward_pool import MESSAGE_CHARS, RewardCall, RewardOutcome, RewardPool, Scoring
from rft_hpc.tasks.reward_terms import term_label, term_task
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.task import Task


@dataclass
class _Parts:
    """One submitted batch with terms: its outer `Scoring`, and where each term's call went
    (its batch, the index there) with the outer call, the weight and the term's label."""

    outer: Scoring
    functions: Scoring | None = None
    models: Scoring | None = None
    routes: list[tuple[bool, int, int, float, str]] = field(default_factory=list)
    """(a model term, index in that scorer's batch, outer index, weight, label)."""

    @property
    def ready(self) -> bool:
        """Whether every term's call has its outcome."""
        return all(s is None or s.done for s in (self.functions, self.models))

    def combine(self) -> None:
        """Put each outer call's weighted sum (or its first failed term's reason)."""
        total = [0.0] * len(self.outer.calls)
        failed: dict[int, RewardOutcome] = {}
        requests: dict[int, str | None] = {}  # the reward job request of its model terms
        for is_model, index, outer, weight, label in self.routes:
            part = self.models if is_model else self.functions
            assert part is not None
            outcome = part.outcomes[index]
            assert outcome is not None
            if outcome.failed and outer not in failed:
                failed[outer] = RewardOutcome(error=f"{label}: {outcome.error}"[:MESSAGE_CHARS],
                                              timed_out=outcome.timed_out,
                                              request=outcome.request)
            total[outer] += weight * outcome.score
            if outcome.request is not None:
                requests.setdefault(outer, outcome.request)
        for i, score in enumerate(total):
            self.outer.put(i, failed.get(i, RewardOutcome(score, request=requests.get(i))))


class ModelTermScorer(Protocol):
    """What scores the model terms: `tasks.model_reward.ModelScorer` in this process, or
    `tasks.remote_reward.RemoteModelScorer` in a reward job (a `Scorer` that says whether it
    has work to do here)."""

    @property
    def busy(self) -> bool:
        """Whether calls wait for work in this process."""
        ...

    @property
    def size(self) -> int:
        """Reward models it holds."""
        ...

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` and return their `Scoring` at once."""
        ...

    def pump(self, timeout: float | None = 0.0) -> None:
        """Move the queued calls on, waiting up to `timeout` for results."""
        ...

    def close(self) -> None:
        """Free what it holds."""
        ...


class RewardMix:
    """A reward scorer that scores each call with its task's reward, whatever its terms:
    functions in `functions` (the worker pool), reward models in `models` (in this process,
or a `RemoteModelScorer` for a reward job); it keeps the
    `Scorer` promise (`explorer.protocols`): one outcome per call, in call order, a failure
    scored 0 with its reason."""

    def __init__(self, functions: RewardPool, models: ModelTermScorer | None = None) -> None:
        self.functions = functions
        self.models = models or ModelScorer()
        self._pending: list[_Parts] = []

    @property
    def size(self) -> int:
        """Reward worker processes (the step metrics' `reward_workers`)."""
        return self.functions.size

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` and return their `Scoring` at once."""
        if not any(task.reward_terms for task, _ in calls):
            return self.functions.submit(calls)
        parts = _Parts(Scoring(calls))
        function_calls: list[RewardCall] = []
        model_calls: list[RewardCall] = []
        for outer, (task, response) in enumerate(calls):
            if not task.reward_terms:
                parts.routes.append((False, len(function_calls), outer, 1.0, task.reward))
                function_calls.append((task, response))
                continue
            for term in task.reward_terms:
                is_model = isinstance(term, RewardModelSpec)
                queue = model_calls if is_model else function_calls
                parts.routes.append((is_model, len(queue), outer, term.weight,
                                     term_label(term)))
                queue.append((term_task(task, term), response))
        if function_calls:
            parts.functions = self.functions.submit(function_calls)
        if model_calls:
            parts.models = self.models.submit(model_calls)
        self._pending.append(parts)
        self._settle()
        return parts.outer

    def pump(self, timeout: float | None = 0.0) -> None:
        """Score queued model calls, move the function pool on (waiting up to `timeout`
        only when no model work is left here; a model scorer whose terms are scored
        elsewhere, a reward job, waits for what is left of it), then complete the batches
        whose terms are all in."""
        had_models = self.models.busy
        self.models.pump()
        start = time.monotonic()
        self.functions.pump(0.0 if had_models else timeout)
        if self._pending and not had_models:  # model terms scored elsewhere: wait here
            spent = time.monotonic() - start
            self.models.pump(None if timeout is None else max(0.0, timeout - spent))
        self._settle()

    def _settle(self) -> None:
        ready = [p for p in self._pending if p.ready]
        for parts in ready:
            parts.combine()
        self._pending = [p for p in self._pending if p not in ready]

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Each call's outcome, in the order of `calls` (waits for them)."""
        scoring = self.submit(calls)
        while not scoring.done:
            self.pump(timeout=None)
        return scoring.result()

    def close(self) -> None:
        """Stop the pool's workers and drop the reward models."""
        self.functions.close()
        self.models.close()

    def __enter__(self) -> RewardMix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_in_process(task: Task, response: str, models: ModelScorer) -> float:
    """`task`'s reward of `response` computed here, without workers or time limit (held-out
    evaluation): function terms called in this process, model terms scored by `models`
    unnormalised (a z-score of one answer means nothing), weighted and summed. Raises what
    a function raises, and `RuntimeError` with the reason when a model cannot score."""
    if not task.reward_terms:
        return call_reward(task, response)
    total = 0.0
    for term in task.reward_terms:
        if isinstance(term, RewardModelSpec):
            raw = term.model_copy(update={"normalize": "none"})
            (outcome,) = models.score([(term_task(task, raw), response)])
            if outcome.failed:
                raise RuntimeError(f"{term_label(term)}: {outcome.error}")
            total += term.weight * outcome.score
        else:
            total += term.weight * call_reward(term_task(task, term), response)
    return total

