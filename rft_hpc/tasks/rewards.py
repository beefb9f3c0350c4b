"""Reward functions: the built-ins by name, the user's by import path, with arguments.

A reward function is called as `fn(task, response, **args)` and returns a number: the
task, the decoded response text and the keyword arguments of the config's
`reward: {name, args}`. `resolve_reward("exact_match")` finds a built-in (the table is
`rft_hpc.config.rewards.BUILTIN_REWARDS`); `resolve_reward("pkg.mod:fn")` imports a user's
function. Explorers call them through `rft_hpc.tasks.reward_pool` (time limit, errors
counted); `call_reward` is the plain call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from rft_hpc.config.rewards import BUILTIN_REWARDS
from rft_hpc.core.errors import UserError
from rft_hpc.core.plugins import import_callable
from rft_hpc.tasks.reward_terms import term_task, uses_models
from rft_hpc.tasks.task import Task

RewardFn = Callable[..., float]
"""`fn(task, response, **args) -> float`."""

_RESOLVED: dict[str, RewardFn] = {}


def resolve_reward(name: str) -> RewardFn:
    """The reward function called `name` (built-in, or `module:function`); a `UserError`
    when it is unknown, cannot be imported or is not callable."""
    if name not in _RESOLVED:
        if name in BUILTIN_REWARDS:
            _RESOLVED[name] = import_callable(BUILTIN_REWARDS[name], "reward function")
        elif ":" in name:
            _RESOLVED[name] = import_callable(name, "reward function")
        else:
            raise UserError(f"unknown reward function {name!r}; built-in: "
                            f"{', '.join(BUILTIN_REWARDS)}, or give package.module:function")
    return _RESOLVED[name]


def call_reward(task: Task, response: str) -> float:
    """The task's reward of `response`, with the task's reward arguments (a weighted sum of
    functions: their weighted sum). Raises what a function raises, `TypeError` when one
    returns something that is not a finite number, and `ValueError` for a reward with a
    reward model or judge term (those score through `tasks.reward_mix`)."""
    if task.reward_terms:
        if uses_models(task):
            raise ValueError(f"reward {task.reward} has a reward model or judge term: those "
                             "score through their model scorers (tasks.reward_mix), not here")
        return sum(t.weight * call_reward(term_task(task, t), response)
                   for t in task.reward_terms)
    value = resolve_reward(task.reward)(task, response, **task.reward_args)
    return as_score(value, task.reward)


# Any: what a user's reward function returned, whatever it is; float() decides
def as_score(value: Any, name: str) -> float:
    """`value` as a float; `TypeError` for a non-number (bool counts) or a NaN/infinity."""
    if isinstance(value, bool):
        return float(value)
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward {name} returned {type(value).__name__} {value!r:.60}, "
                        "not a number") from None
    if not math.isfinite(score):
        raise TypeError(f"reward {name} returned {score}")
    return score


def signature_problem(fn: RewardFn, args: Mapping[str, object]) -> str | None:
    """Why `fn(task, response, **args)` cannot be called, or None when it can (or when
    `fn` has no signature to check, as some C functions)."""
    import inspect

    try:
        inspect.signature(fn).bind(Task("check", "", ""), "", **args)
    except TypeError as exc:
        return f"cannot be called as fn(task, response{', **args' if args else ''}): {exc}"
    except ValueError:
        return None
    return None


def exact_match(task: Task, response: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == task.answer)


_NUMBER = re.compile(r"-?\d+")


def exact_match_with_format(task: Task, response: str) -> float:
    """exact_match, plus 0.1 for a response that is a bare number (the expected format)."""
    return exact_match(task, response) + 0.1 * bool(_NUMBER.fullmatch(response.strip()))
