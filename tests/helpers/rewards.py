"""Reward functions of the tests, imported by path: `helpers.rewards:NAME` in the pytest
process, `tests.helpers.rewards:NAME` in role processes started from the checkout (Slurm
jobs run in the submitting directory, which `python -m` puts on the path)."""

from __future__ import annotations

import time
import zlib

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


def half_flat(task: Task, response: str) -> float:
    """0 for every rollout of a flat task, else a number from the response's crc32 in
    [0, 1): the rollouts of any other task disagree unless their responses are equal. Flat:
    an id that starts with "flat", or (ids that start with neither "flat" nor "vary") one
    whose crc32 is even: about half of generated tasks, the groups with no signal."""
    flat = task.task_id.startswith("flat") or (
        not task.task_id.startswith("vary") and zlib.crc32(task.task_id.encode()) % 2 == 0)
    return 0.0 if flat else zlib.crc32(response.encode()) % 1000 / 1000
