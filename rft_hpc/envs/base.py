"""The environment interface of multi-turn workflows, and the lookup of environments by name.

An environment is a plain class: `reset(task, seed)` returns the first observation (the
prompt the policy sees), `step(action)` takes the policy's response text and returns the next
observation, the reward of that turn and whether the episode is over. Observations are text
(or chat messages); the explorer tokenizes them and never trains on them (action mask 0).
For I/O-bound work (an HTTP sandbox, a remote judge) both may be coroutines (`async def
reset / step`): then many trajectories wait at once in one process.

`explorer.workflow.env` names one: a registered name (`guess`) or `package.module:Class`.
Environments run in host processes (`rft_hpc.envs.host`), so a class and its `env_args`
must be importable and picklable there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from rft_hpc.core.plugins import import_callable, resolve
from rft_hpc.tasks.task import Task

Message = dict[str, str]
"""A chat message: `{"role": ..., "content": ...}`."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action."""

    observation: str | list[Message]
    """Text appended to the conversation after the action (feedback; may be empty): in chat
    format the user's next message. Or chat messages (tool results: role `tool`)."""
    reward: float
    """Reward of this turn; a trajectory's reward is the sum over its turns."""
    done: bool
    """True when the episode is over (no more turns)."""
    counts: dict[str, int] = field(default_factory=dict)
    """What happened in this turn, counted (tool calls, errors, timeouts ...): summed over
    the trajectory into its record's info and over the step into the metrics."""


class Environment(ABC):
    """One episode at a time: `reset` starts it, `step` plays one turn."""

    @abstractmethod
    def reset(self, task: Task, seed: int) -> str:
        """Start an episode for `task`; returns the first observation (the prompt)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's response `action`; returns feedback, reward and done."""


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
"""Registered environment classes by name."""


def build_env(name: str, args: dict[str, object]) -> Environment:
    """An environment instance of `name` (registered or `package.module:Class`) with `args`.

    An unknown name or a class refusing `args` raises `UserError` naming
    `explorer.workflow.env`.
    """
    from rft_hpc.core.errors import UserError

    _register_builtins()
    factory = resolve(name, ENVIRONMENTS, "explorer.workflow.env")
    try:
        env = factory(**args)
    except TypeError as exc:
        raise UserError(f"explorer.workflow.env {name!r} refuses env_args {args}: {exc}") \
            from exc
    if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
        raise UserError(f"explorer.workflow.env {name!r} has no reset/step methods")
    return env


def check_env(name: str, args: dict[str, object]) -> None:
    """Raise `UserError` when `name` cannot be resolved or its constructor does not take
    `args`, without building an environment (a constructor may be slow or hang)."""
    import inspect

    from rft_hpc.core.errors import UserError

    _register_builtins()
    factory = resolve(name, ENVIRONMENTS, "explorer.workflow.env")
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise UserError(f"explorer.workflow.env {name!r} refuses env_args {args}: {exc}") \
            from exc
    except ValueError:  # no signature to check (a builtin): the workers will tell
        pass


def is_async_env(name: str) -> bool:
    """Whether environment `name`'s `step` is a coroutine function (`async def`): such
    environments share one host process per explorer (`envs.host`)."""
    import inspect

    _register_builtins()
    factory = resolve(name, ENVIRONMENTS, "explorer.workflow.env")
    return inspect.iscoroutinefunction(getattr(factory, "step", None))


def _register_builtins() -> None:
    from rft_hpc.config.workflow import BUILTIN_ENVS

    for name, path in BUILTIN_ENVS.items():
        if name not in ENVIRONMENTS:
            ENVIRONMENTS[name] = import_callable(path, "explorer.workflow.env")
