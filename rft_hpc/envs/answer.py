"""`answer`: one question, one answer. The first observation is the task's prompt; the
policy's answer is scored by the task's reward function and ends the episode. With tools
(`prompt.tools`) it is the environment the tools wrap: the policy may call them for as many
turns as it likes, and its first turn without a call is its answer (`rft_hpc.envs.tools`)."""

from __future__ import annotations

from rft_hpc.envs.base import Environment, StepResult
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.task import Task


class AnswerEnv(Environment):
    """A task's question, its answer scored by the task's reward (`tasks.reward`)."""

    def __init__(self) -> None:
        self.task: Task | None = None

    def reset(self, task: Task, seed: int) -> str:
        """The task's prompt."""
        self.task = task
        return task.prompt

    def step(self, action: str) -> StepResult:
        """The answer's reward; the episode is over."""
        if self.task is None:
            raise RuntimeError("step before reset")
        return StepResult("", call_reward(self.task, action), True)
