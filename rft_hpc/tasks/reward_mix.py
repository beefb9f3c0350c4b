"""The explorer's reward scorer over every kind of reward term: each call goes to the
scorer of each of its terms' kinds (functions to the reward function pool, reward models
and LLM judges to their scorers), and its reward is the weighted sum of its terms' scores
once all of them are in.

A batch whose tasks all have one function for a reward (no `reward_terms`) goes to the pool
as it always did, its outcomes untouched. A task with terms has each term scored as a call
of its own (`reward_terms.term_task`) by the scorer of its kind (`term.kind`): function
terms in the pool's worker processes, the others by `RewardMix.scorers`, by default
`local_scorers` (reward models in batched forwards, judges in batched generations, in the
explorer: `tasks.model_reward`, `tasks.judge_reward`); another scorer of a kind (one that
scores elsewhere) plugs in there. A term that fails (raises, dies, times out, a judge's
answer that does not parse) fails the whole call: it scores 0 and says which term failed
and why, as a raising reward function does. Reward shaping (`pipeline.reward_shaping`)
applies to the sum, in the explorer, as to any reward.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rft_hpc.config.rewards import AnyRewardSpec
from rft_hpc.tasks.judge_reward import JudgeLoader, JudgeScorer
from rft_hpc.tasks.model_reward import ModelScorer
from rft_hpc.tasks.reward_pool import MESSAGE_CHARS, RewardCall, RewardOutcome, RewardPool, Scoring
from rft_hpc.tasks.reward_terms import term_label, term_task
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    import torch


class KindScorer(Protocol):
    """What scores one kind of term: the `Scorer` protocol (`explorer.protocols`: one
    outcome per call, in call order, failures scored 0 with their reason, results only
    while `pump` runs), and `busy` while it holds calls without outcomes."""

    @property
    def busy(self) -> bool:
        """Whether calls wait for their outcomes."""
        ...

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` and return their `Scoring` at once."""
        ...

    def pump(self, timeout: float | None = 0.0) -> None:
        """Move the queued calls on, waiting up to `timeout` seconds for a result."""
        ...

    def close(self) -> None:
        """Stop scoring and free what it holds."""
        ...


def local_scorers(device: str = "cpu", dtype: torch.dtype | None = None,
                  judge_loaders: Mapping[str, JudgeLoader] | None = None,
                  ) -> dict[str, KindScorer]:
    """The scorers of the model kinds in this process, on `device`: `model` (reward
    models) and `judge` (LLM judges; with transformers, and the engines of
    `judge_loaders`), each loading its models on first use."""
    return {"model": ModelScorer(device, dtype),
            "judge": JudgeScorer(device, dtype, judge_loaders)}


@dataclass
class _Parts:
    """One submitted batch with terms: its outer `Scoring`, and where each term's call went
    (its kind's batch, the index there) with the outer call, the weight and the term's
    label."""

    outer: Scoring
    kinds: dict[str, Scoring] = field(default_factory=dict)
    """Each kind's batch of this batch's calls."""
    routes: list[tuple[str, int, int, float, str]] = field(default_factory=list)
    """(the term's kind, index in that kind's batch, outer index, weight, label)."""

    @property
    def ready(self) -> bool:
        """Whether every term's call has its outcome."""
        return all(s.done for s in self.kinds.values())

    def combine(self) -> None:
        """Put each outer call's weighted sum (or its first failed term's reason)."""
        total = [0.0] * len(self.outer.calls)
        failed: dict[int, RewardOutcome] = {}
        requests: dict[int, str | None] = {}  # the reward job request of its model terms
        for kind, index, outer, weight, label in self.routes:
            outcome = self.kinds[kind].outcomes[index]
            assert outcome is not None
            if outcome.failed and outer not in failed:
                failed[outer] = RewardOutcome(error=f"{label}: {outcome.error}"[:MESSAGE_CHARS],
                                              timed_out=outcome.timed_out,
                                              unparseable=outcome.unparseable,
                                              request=outcome.request)
            total[outer] += weight * outcome.score
            if outcome.request is not None:
                requests.setdefault(outer, outcome.request)
        for i, score in enumerate(total):
            self.outer.put(i, failed.get(i, RewardOutcome(score, request=requests.get(i))))


class RewardMix:
    """A reward scorer that scores each call with its task's reward, whatever its terms:
    functions in `functions` (the worker pool), every other kind of term in the scorer of
    its kind (`scorers`, by default `local_scorers()`: on the CPU); it keeps the `Scorer`
    promise (`explorer.protocols`): one outcome per call, in call order, a failure scored 0
    with its reason."""

    def __init__(self, functions: RewardPool,
                 scorers: Mapping[str, KindScorer] | None = None) -> None:
        self.functions = functions
        self.scorers: dict[str, KindScorer] = {**local_scorers(), **(scorers or {})}
        """The scorer of each kind of term but `function` (`model`, `judge`)."""
        self._pending: list[_Parts] = []

    @property
    def size(self) -> int:
        """Reward worker processes (the step metrics' `reward_workers`)."""
        return self.functions.size

    def _scorer(self, kind: str) -> KindScorer:
        return self.functions if kind == "function" else self.scorers[kind]

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` and return their `Scoring` at once."""
        if not any(task.reward_terms for task, _ in calls):
            return self.functions.submit(calls)
        parts = _Parts(Scoring(calls))
        queues: dict[str, list[RewardCall]] = {}
        for outer, (task, response) in enumerate(calls):
            if not task.reward_terms:
                queue = queues.setdefault("function", [])
                parts.routes.append(("function", len(queue), outer, 1.0, task.reward))
                queue.append((task, response))
                continue
            for term in task.reward_terms:
                queue = queues.setdefault(term.kind, [])
                parts.routes.append((term.kind, len(queue), outer, term.weight,
                                     term_label(term)))
                queue.append((term_task(task, term), response))
        for kind, queue in queues.items():
            parts.kinds[kind] = self._scorer(kind).submit(queue)
        self._pending.append(parts)
        self._settle()
        return parts.outer

    def pump(self, timeout: float | None = 0.0) -> None:
        """Move every kind's scorer on (the model kinds score what they hold, without
        waiting), then the function pool (waiting up to `timeout` only when no other kind
        had work here; a kind scored elsewhere, by a reward job, waits for what is left of
        it), then complete the batches whose terms are all in."""
        scorers = self._distinct()
        had_work = any(s.busy for s in scorers)
        for scorer in scorers:
            scorer.pump(0.0)
        start = time.monotonic()
        self.functions.pump(0.0 if had_work else timeout)
        if self._pending and not had_work:  # terms scored elsewhere: wait here
            for scorer in scorers:
                spent = time.monotonic() - start
                scorer.pump(None if timeout is None else max(0.0, timeout - spent))
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
        """Stop the pool's workers and every kind's scorer (dropping their models)."""
        self.functions.close()
        for scorer in self._distinct():
            scorer.close()

    def _distinct(self) -> list[KindScorer]:
        """The scorers, each once (one scorer may score several kinds: a reward job's)."""
        return list({id(s): s for s in self.scorers.values()}.values())

    def __enter__(self) -> RewardMix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_in_process(task: Task, response: str,
                     scorers: Mapping[str, KindScorer] | None = None) -> float:
    """`task`'s reward of `response` computed here (`scores_in_process` of one call). Raises
    what a function raises, and `RuntimeError` with the reason when another term cannot
    score (a judge's unparseable answer included)."""
    (outcome,) = scores_in_process([(task, response)], scorers)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def scores_in_process(calls: Sequence[RewardCall],
                      scorers: Mapping[str, KindScorer] | None = None,
                      ) -> list[float | Exception]:
    """Each call's reward computed here, without workers or time limit (held-out
    evaluation), in call order: function terms called in this process, the other kinds
    submitted to their scorer in `scorers` (default `local_scorers()`, on the CPU) all
    together, so that a reward model or judge scores them in batched forwards; reward
    models unnormalised (a z-score of held-out answers would hide what moved), weighted and
    summed. A call whose function raises gets that exception in its place, one whose other
    term cannot score a `RuntimeError` with the reason (a judge's unparseable answer
    included)."""
    scorers = scorers if scorers is not None else local_scorers()
    totals: list[float | Exception] = [0.0] * len(calls)
    queued: dict[str, list[tuple[int, AnyRewardSpec, RewardCall]]] = {}
    for i, (task, response) in enumerate(calls):
        for term in task.reward_terms or (None,):
            if term is not None and term.kind != "function":
                raw = term.model_copy(update={"normalize": "none"}) \
                    if term.kind == "model" else term
                queued.setdefault(term.kind, []).append((i, term,
                                                         (term_task(task, raw), response)))
                continue
            try:
                score = (call_reward(task, response) if term is None else
                         term.weight * call_reward(term_task(task, term), response))
            except Exception as exc:  # this call's reward is that failure
                totals[i] = exc
                continue
            _add(totals, i, score)
    for kind, items in queued.items():
        scorer = scorers[kind]
        scoring = scorer.submit([call for _, _, call in items])
        while not scoring.done:
            scorer.pump(None)
        for (i, term, _), outcome in zip(items, scoring.result(), strict=True):
            _add(totals, i, RuntimeError(f"{term_label(term)}: {outcome.error}")
                 if outcome.failed else term.weight * outcome.score)
    return totals


def _add(totals: list[float | Exception], i: int, part: float | Exception) -> None:
    """Add `part` to call `i`'s total; its first failure stays its outcome."""
    total = totals[i]
    if not isinstance(total, Exception):
        totals[i] = part if isinstance(part, Exception) else total + part
