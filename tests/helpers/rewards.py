"""Reward functions of the tests, imported by path: `helpers.rewards:NAME` in the pytest
process, `tests.helpers.rewards:NAME` in role processes started from the checkout (Slurm
jobs run in the submitting directory, which `python -m` puts on the path)."""

from __future__ import annotations

import time

from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.task import Task


def answered(task: Task, response: str) -> float:
    """1 for any non-empty response: a reward that exact match disagrees with."""
    return float(bool(response.strip()))


def fails_on_odd(task: Task, response: str) -> float:
    """Raises for tasks whose id ends in an odd digit, else 1."""
    if int(task.task_id[-1]) % 2:
        raise RuntimeError(f"no verdict for {task.task_id}")
    return 1.0


def slow_exact_match(task: Task, response: str, seconds: float = 0.1) -> float:
    """exact_match after `seconds` of sleep: an environment that makes the caller wait
    (a sandbox, a remote judge) without using a core. A run's wall time then follows the
    clock rather than the machine's speed, at little CPU."""
    time.sleep(seconds)
    return exact_match(task, response)
