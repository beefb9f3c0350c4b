"""A number-guessing game with feedback, in the tiny model's vocabulary (`0-9 + - * = ,`).

The prompt `0-9=` asks for a number in 0..9; after each guess the environment answers `+`
(the secret is larger), `-` (smaller), `=` (right: the episode ends) or `*` (not a number).
The reward is 1 for a right guess on the first turn, `turn_penalty` less for each later turn
(never below `min_reward`), 0 when the turns run out.
"""

from __future__ import annotations

import zlib

from rft_hpc.envs.base import Environment, StepResult
from rft_hpc.tasks.task import Task


def secret_of(task: Task, seed: int, low: int, high: int) -> int:
    """The task's secret in `low..high`: its answer modulo the range when the answer is a
    number (so generated arithmetic tasks serve as a task source), else drawn from the
    task id and `seed`."""
    span = high - low + 1
    if task.answer.strip().lstrip("-").isdigit():
        return low + int(task.answer) % span
    return low + zlib.crc32(f"{task.task_id}:{seed}".encode()) % span


class GuessEnv(Environment):
    """Guess the secret number in `low..high`; feedback `+`, `-`, `=` or `*`."""

    def __init__(self, low: int = 0, high: int = 9, turn_penalty: float = 0.2,
                 min_reward: float = 0.2) -> None:
        if not 0 <= low <= high:
            raise TypeError(f"need 0 <= low <= high, got low={low} high={high}")
        self.low, self.high = low, high
        self.turn_penalty, self.min_reward = turn_penalty, min_reward
        self.secret = low
        self.turns = 0

    def reset(self, task: Task, seed: int) -> str:
        """The prompt `<low>-<high>=`; the secret comes from the task (see `secret_of`)."""
        self.secret = secret_of(task, seed, self.low, self.high)
        self.turns = 0
        return f"{self.low}-{self.high}="

    def step(self, action: str) -> StepResult:
        """Compare the guess with the secret: `=` ends the episode with the reward."""
        self.turns += 1
        guess = action.strip()
        if not guess.isdigit():
            return StepResult("*", 0.0, False)
        value = int(guess)
        if value == self.secret:
            reward = max(self.min_reward, 1.0 - self.turn_penalty * (self.turns - 1))
            return StepResult("=", reward, True)
        return StepResult("+" if self.secret > value else "-", 0.0, False)
