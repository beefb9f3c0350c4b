"""What the scorers of model terms share: calls queued with their term, scored in batches of
calls whose terms can share one batched pass, each loaded model kept (or why it failed).

`BatchedScorer` is a reward `Scorer` (`explorer.protocols`) whose subclass says which term
class it scores (`term_class`), which terms may share a batch (`batch_key`), how a model
loads (`load`) and how a batch is scored (`score_batch`); reward models
(`tasks.model_reward.ModelScorer`) and LLM judges (`tasks.judge_reward.JudgeScorer`) are
its two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from rft_hpc.config.rewards import JudgeSpec, RewardModelSpec
from rft_hpc.tasks.reward_pool import MESSAGE_CHARS, RewardCall, RewardOutcome, Scoring
from rft_hpc.tasks.reward_terms import sole_term

Term = TypeVar("Term", RewardModelSpec, JudgeSpec)

Queued = tuple[Scoring, int, Any]
"""A queued call: its `Scoring`, its index there, its term."""


class BatchedScorer(Generic[Term]):
    """Scores calls with the model of each call's term, in batches of up to the term's
    `batch_size` calls that share a `batch_key`, models loaded on first use and kept."""

    term_class: ClassVar[type]
    """The term class it scores (`RewardModelSpec`, `JudgeSpec`)."""

    def __init__(self) -> None:
        self._loaded: dict[Hashable, Any] = {}
        """Each model's loaded form (`load`), or why it failed to load (a str)."""
        self._todo: deque[Queued] = deque()

    def batch_key(self, term: Term) -> Hashable:
        """What the calls of one batch share (their model, and what changes the pass)."""
        raise NotImplementedError

    def load(self, term: Term) -> Any:
        """The model `term` names, loaded (raises why it cannot be)."""
        raise NotImplementedError

    def score_batch(self, model: Any, batch: list[Queued]) -> None:
        """Put each call's outcome of `batch` (terms of one batch key), scored by `model`;
        raise to fail them all with the error."""
        raise NotImplementedError

    def model_key(self, term: Term) -> Hashable:
        """Which loaded model scores `term` (default: its batch key's first part)."""
        key = self.batch_key(term)
        return key[0] if isinstance(key, tuple) else key

    @property
    def size(self) -> int:
        """Models loaded."""
        return sum(not isinstance(m, str) for m in self._loaded.values())

    @property
    def busy(self) -> bool:
        """Whether calls are queued."""
        return bool(self._todo)

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` (each task scored by one term of `term_class` alone) and return
        their `Scoring` at once; a call whose task has no such term scores 0 with why."""
        scoring = Scoring(calls)
        for index, (task, _) in enumerate(scoring.calls):
            try:
                self._todo.append((scoring, index, sole_term(task, self.term_class)))
            except ValueError as exc:
                scoring.put(index, RewardOutcome(error=f"ValueError: {exc}"[:MESSAGE_CHARS]))
        return scoring

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Each call's outcome, in the order of `calls`."""
        scoring = self.submit(calls)
        self.pump()
        return scoring.result()

    def pump(self, timeout: float | None = 0.0) -> None:
        """Score every queued call, in batches of up to the first queued term's
        `batch_size` calls of its batch key (a pass is not interrupted: `timeout` is not
        waited for)."""
        while self._todo:
            first = self._todo[0][2]
            key = self.batch_key(first)
            batch: list[Queued] = []
            rest: deque[Queued] = deque()
            for item in self._todo:
                (batch if len(batch) < first.batch_size and self.batch_key(item[2]) == key
                 else rest).append(item)
            self._todo = rest
            self._score(first, batch)

    def _score(self, first: Term, batch: list[Queued]) -> None:
        model = self._model(first)
        try:
            if isinstance(model, str):
                raise RuntimeError(model)
            self.score_batch(model, batch)
        except Exception as exc:  # the batch's calls score 0 and say why; the next go on
            error = (str(exc) if isinstance(model, str)
                     else f"{type(exc).__name__}: {exc}")[:MESSAGE_CHARS]
            for scoring, index, _ in batch:
                if scoring.outcomes[index] is None:
                    scoring.put(index, RewardOutcome(error=error))

    def _model(self, term: Term) -> Any:
        key = self.model_key(term)
        if key not in self._loaded:
            try:
                self._loaded[key] = self.load(term)
            except Exception as exc:  # every call of it then fails with this reason
                self._loaded[key] = str(exc)[:MESSAGE_CHARS]
        return self._loaded[key]

    def close(self) -> None:
        """Stop the models that run engines of their own and drop them all."""
        for model in self._loaded.values():
            close = getattr(model, "close", None)
            if close is not None:
                close()
        self._loaded.clear()
