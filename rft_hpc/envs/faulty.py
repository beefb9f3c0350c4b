"""The guessing game with injected faults and delays, for tests and benchmarks of the
explorer's isolation (timeouts, retries) and of over-rollout.

Which tasks misbehave is decided by a stable hash of the task id, so every run (and every
retry) picks the same ones: with `raise_every: k` a task raises when
`crc32(task_id) % k == 0`; `hang_every` and `slow_every` pick tasks the same way, each with
an offset of its own so that the three sets differ. Use it as
`env: rft_hpc.envs.faulty:FaultyGuess`.
"""

from __future__ import annotations

import os
import time
import zlib

from rft_hpc.envs.base import StepResult
from rft_hpc.envs.guess import GuessEnv
from rft_hpc.tasks.task import Task

_OFFSETS = {"raise": 0, "hang": 1, "slow": 2, "die": 3}


def is_bad(task_id: str, fault: str, every: int) -> bool:
    """True for the tasks that `fault` (raise, hang, slow, die) with this `every` hits
    (0: none)."""
    return every > 0 and (zlib.crc32(task_id.encode()) + _OFFSETS[fault]) % every == 0


class FaultyGuess(GuessEnv):
    """`GuessEnv` whose picked tasks raise in `reset`, hang in `reset` (`hang_seconds`),
    kill their process in `reset` (`os._exit`, like a segfault) or run slowly (every call
    sleeps `sleep * slow_factor` instead of `sleep`)."""

    def __init__(self, raise_every: int = 0, hang_every: int = 0, slow_every: int = 0,
                 die_every: int = 0,
                 sleep: float = 0.0, slow_factor: float = 10.0, hang_seconds: float = 3600.0,
                 low: int = 0, high: int = 9, turn_penalty: float = 0.2,
                 min_reward: float = 0.2) -> None:
        super().__init__(low, high, turn_penalty, min_reward)
        self.every = {"raise": raise_every, "hang": hang_every, "slow": slow_every,
                      "die": die_every}
        self.sleep, self.slow_factor, self.hang_seconds = sleep, slow_factor, hang_seconds
        self.slow = False

    def _pause(self) -> None:
        seconds = self.sleep * (self.slow_factor if self.slow else 1.0)
        if seconds > 0:
            time.sleep(seconds)

    def reset(self, task: Task, seed: int) -> str:
        """As `GuessEnv.reset`, after the task's fault and the delay."""
        if is_bad(task.task_id, "raise", self.every["raise"]):
            raise RuntimeError(f"injected fault on task {task.task_id}")
        if is_bad(task.task_id, "die", self.every["die"]):
            os._exit(3)
        if is_bad(task.task_id, "hang", self.every["hang"]):
            time.sleep(self.hang_seconds)
        self.slow = is_bad(task.task_id, "slow", self.every["slow"])
        self._pause()
        return super().reset(task, seed)

    def step(self, action: str) -> StepResult:
        """As `GuessEnv.step`, after the delay."""
        self._pause()
        return super().step(action)
