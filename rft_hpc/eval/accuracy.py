"""Greedy exact-match accuracy of a policy on a list of tasks."""

from __future__ import annotations

from collections.abc import Sequence

from rft_hpc.engines.hf import HFEngine
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.task import Task


def exact_match_accuracy(engine: HFEngine, tasks: Sequence[Task], *, max_new_tokens: int,
                         batch_size: int = 512) -> float:
    """Fraction of `tasks` whose greedy answer equals the reference answer exactly."""
    if not tasks:
        return float("nan")
    correct = 0
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i:i + batch_size]
        outs = engine.generate([engine.encode(t.prompt) for t in chunk], n=1,
                               max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
        correct += sum(exact_match(t, o[0].text) == 1.0 for t, o in zip(chunk, outs,
                                                                       strict=True))
    return correct / len(tasks)
