"""Environments for the rollout loop's tests: an `async def` one that waits like a remote
sandbox, and a plain one whose trajectories answer at different speeds. They run in host
processes (rft_hpc.envs.host), so what they observe comes back in `StepResult.counts`."""

from __future__ import annotations

import asyncio
import itertools
import time

from rft_hpc.envs.base import Environment, StepResult
from rft_hpc.tasks.task import Task

_IN_FLIGHT = 0
_ORDER = itertools.count(1)


class RemoteWait(Environment):
    """`async def`: each step waits `seconds` (no CPU), reports how many steps of this
    process were waiting when it began (`in_flight`), and ends the episode."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds

    async def reset(self, task: Task, seed: int) -> str:  # type: ignore[override]
        return "0-9="

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        global _IN_FLIGHT
        _IN_FLIGHT += 1
        seen = _IN_FLIGHT
        try:
            await asyncio.sleep(self.seconds)
        finally:
            _IN_FLIGHT -= 1
        return StepResult("", 1.0, True, {"in_flight": seen})


class UnevenPace(Environment):
    """Plain: three turns; a trajectory whose seed is even sleeps `seconds` in each step, the
    others answer at once. Each step reports when it ended, in this process's order
    (`end_<turn>`)."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds, self.slow, self.turn = seconds, False, 0

    def reset(self, task: Task, seed: int) -> str:
        self.slow, self.turn = seed % 2 == 0, 0
        return "0-9="

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.slow:
            time.sleep(self.seconds)
        return StepResult("+", 0.0, self.turn == 3,
                          {f"end_{self.turn}": next(_ORDER), "slow": int(self.slow)})


class PacedByTask(Environment):
    """`async def`, one turn: a task whose answer is `slow` waits `seconds`, the others
    answer at once; each step reports when it ended, in this process's order (`end`)."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds, self.slow = seconds, False

    async def reset(self, task: Task, seed: int) -> str:  # type: ignore[override]
        self.slow = task.answer == "slow"
        return "0-9="

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if self.slow:
            await asyncio.sleep(self.seconds)
        return StepResult("", 1.0, True, {"end": next(_ORDER)})


class BlocksItsLoopOnce(Environment):
    """`async def` written wrong: the first step in this run (a marker file at `marker`
    says whether it happened) blocks its process's event loop for `seconds` with a
    synchronous sleep; the others answer at once and end the episode."""

    def __init__(self, marker: str, seconds: float = 600.0) -> None:
        self.marker, self.seconds = marker, seconds

    async def reset(self, task: Task, seed: int) -> str:  # type: ignore[override]
        return "0-9="

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        import os

        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(self.seconds)  # the whole host stops answering
        return StepResult("", 1.0, True)
