"""The long-tail environment of tools/bench/pipeline.py (d): a one-turn `async def`
environment that scores the answer by exact match, `delay` seconds late on one trajectory in
eight (an HTTP sandbox, a remote judge: the trajectory waits, no core is used).

A trajectory is slow when its seed is a multiple of 8. Imported by the explorer's host
process as `tools.bench.pipeline_env:DelayedAnswer`.
"""

from __future__ import annotations

import asyncio

from rft_hpc.envs.base import Environment, StepResult
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.task import Task

EVERY = 8


class DelayedAnswer(Environment):
    """The task's prompt; its answer scored by exact match, `delay` seconds late for one
    trajectory in eight."""

    def __init__(self, delay: float = 1.0) -> None:
        self.delay, self.task, self.slow = delay, None, False

    async def reset(self, task: Task, seed: int) -> str:  # type: ignore[override]
        self.task, self.slow = task, seed % EVERY == 0
        return task.prompt

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if self.slow:
            await asyncio.sleep(self.delay)
        assert self.task is not None
        return StepResult("", exact_match(self.task, action), True)
