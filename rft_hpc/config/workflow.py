"""Configuration of the explorer's workflow (single- or multi-turn) and of over-rollout.

Names follow Trinity-RFT where it has the same knob (`max_timeout`, `max_retry_times`,
over-rollout). docs/multi-turn.md explains the semantics.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from rft_hpc.core.config_section import ConfigSection


class SingleTurnWorkflow(ConfigSection):
    """One response per rollout, scored by the task's reward function (the default)."""

    type: Literal["single_turn"] = "single_turn"
    """Selects the single-turn workflow: prompt -> response -> reward."""


class MultiTurnWorkflow(ConfigSection):
    """Rollouts that talk with an environment: the policy's turns alternate with the
    environment's observations (which are in the sequence but never trained on)."""

    type: Literal["multi_turn"] = "multi_turn"
    """Selects the multi-turn workflow (Trinity-RFT's `MultiTurnWorkflow`)."""

    env: str = "guess"
    """Environment: a registered name (`guess`: a number-guessing game with `+`/`-`/`=`
    feedback) or `package.module:Class` with `reset(task, seed)` and `step(action)`."""

    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""

    max_turns: int = Field(4, ge=1)
    """Policy turns per trajectory at most; each turn generates up to
    `explorer.max_new_tokens` tokens."""

    max_timeout: float = Field(60.0, gt=0.0)
    """Seconds the environment calls (reset, step) of one task attempt may take together,
    model generation not counted; past it the task's worker process is killed and the
    attempt fails as a timeout. Starting the worker and building its environments has a
    budget of its own of the same length (at least 10 s)."""

    tool_timeout: float = Field(10.0, gt=0.0)
    """Seconds one tool call (`prompt.tools`) may take; past it the call is answered with
    an error and counted in `tool_timeouts`."""

    max_retry_times: int = Field(1, ge=0)
    """Attempts after the first for a task whose environment raised, died or timed out;
    a task that fails every attempt is given up (its records are placeholders that train
    nothing) and counted in the metrics."""

    @field_validator("env")
    @classmethod
    def _known_env(cls, name: str) -> str:
        if ":" not in name and name not in BUILTIN_ENVS:
            raise ValueError(f"unknown environment {name!r}; registered: "
                             f"{', '.join(sorted(BUILTIN_ENVS))}, or give package.module:Class")
        return name


BUILTIN_ENVS: dict[str, str] = {"guess": "rft_hpc.envs.guess:GuessEnv",
                                "answer": "rft_hpc.envs.answer:AnswerEnv"}
"""The environments `explorer.workflow.env` may name without an import path, and where each
is (the config checks names against this table without importing the environments)."""


WorkflowConfig = Annotated[SingleTurnWorkflow | MultiTurnWorkflow, Field(discriminator="type")]
"""How an explorer turns a task into scored rollouts."""


class OverRolloutConfig(ConfigSection):
    """Closing an explorer step before its slowest tasks are done (multi-turn workflows)."""

    ratio: float = Field(1.0, gt=0.0, le=1.0)
    """The step closes once `ceil(ratio x tasks_per_step)` tasks are done (its new tasks
    or stragglers carried into it); 1.0 waits for every task (over-rollout off)."""

    stragglers: Literal["drop", "carry"] = "drop"
    """Tasks still running when the step closes: `drop` cancels them (placeholder records
    that train nothing), `carry` lets them run on and writes their records in the step
    during which they finish (use it with sync.offset >= 1). Stragglers still running at
    the last step are dropped; those in flight when the explorer stops are lost (counted
    by the next process)."""
