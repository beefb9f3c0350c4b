"""Reward functions of the evaluation tests, imported by path (`helpers.rewards:NAME`)."""

from __future__ import annotations

from rft_hpc.tasks.task import Task


def answered(task: Task, response: str) -> float:
    """1 for any non-empty response: a reward that exact match disagrees with."""
    return float(bool(response.strip()))


def fails_on_odd(task: Task, response: str) -> float:
    """Raises for tasks whose id ends in an odd digit, else 1."""
    if int(task.task_id[-1]) % 2:
        raise RuntimeError(f"no verdict for {task.task_id}")
    return 1.0
