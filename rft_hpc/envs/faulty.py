"""The guessing game with injected faults and delays, for tests and benchmarks of the
explorer's isolation (timeouts, retries) and of over-rollout.

Which tasks misbehave is decided by a stable hash of the task id, so every run (and every
retry) picks the same ones: a task is "bad" when `crc32(task_id) % every == 0`.
Use it as `env: rft_hpc.envs.faulty:FaultyGuess`.
"""

from __future__ import annotations

import time
import zlib
from typing import Literal

from rft_hpc.envs.base import StepResult
from rft_hpc.envs.guess import GuessEnv
from rft_hpc.tasks.task import Task


def is_bad(task_id: str, every: int) -> bool:
    """True for the tasks a `FaultyGuess` with this `every` misbehaves on (0: none)."""
    return every > 0 and zlib.crc32(task_id.encode()) % every == 0


class FaultyGuess(GuessEnv):
    """`GuessEnv` whose bad tasks raise, hang or run slowly; every call sleeps `sleep` s.

    fault `raise`: `reset` raises RuntimeError; `hang`: `reset` sleeps `hang_seconds`;
    `slow`: every call sleeps `sleep * slow_factor` instead of `sleep`.
    """

    def __init__(self, fault: Literal["raise", "hang", "slow"] | None = None, every: int = 0,
                 sleep: float = 0.0, slow_factor: float = 10.0, hang_seconds: float = 3600.0,
                 **guess_args: float) -> None:
        super().__init__(**guess_args)  # type: ignore[arg-type]
        self.fault, self.every = fault, every
        self.sleep, self.slow_factor, self.hang_seconds = sleep, slow_factor, hang_seconds
        self.bad = False

    def _pause(self) -> None:
        seconds = self.sleep * (self.slow_factor if self.bad and self.fault == "slow" else 1)
        if seconds > 0:
            time.sleep(seconds)

    def reset(self, task: Task, seed: int) -> str:
        """As `GuessEnv.reset`, after the fault of a bad task and the delay."""
        self.bad = is_bad(task.task_id, self.every)
        if self.bad and self.fault == "raise":
            raise RuntimeError(f"injected fault on task {task.task_id}")
        if self.bad and self.fault == "hang":
            time.sleep(self.hang_seconds)
        self._pause()
        return super().reset(task, seed)

    def step(self, action: str) -> StepResult:
        """As `GuessEnv.step`, after the delay."""
        self._pause()
        return super().step(action)
