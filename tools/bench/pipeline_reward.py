"""The long-tail reward of tools/bench/pipeline.py: exact match, after an environment delay
for one task in eight.

A task is slow when crc32 of its id is a multiple of 8; each of its rollouts' reward calls
then sleeps `delay` seconds (a sandbox, a remote judge: the caller waits, no core is used).
Imported by the explorers' reward workers as `tools.bench.pipeline_reward:delayed`.
"""

from __future__ import annotations

import time
import zlib

from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.task import Task

EVERY = 8


def is_slow(task_id: str) -> bool:
    """Whether the task with this id is one of the slow one in eight."""
    return zlib.crc32(task_id.encode()) % EVERY == 0


def delayed(task: Task, response: str, delay: float = 1.0) -> float:
    """exact_match, `delay` seconds late for the slow tasks."""
    if is_slow(task.task_id):
        time.sleep(delay)
    return exact_match(task, response)
