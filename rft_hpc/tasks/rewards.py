"""Reward functions: a registry by name, extended by users through import paths.

A reward function takes the task and the decoded response text and returns a float.
`resolve_reward("exact_match")` finds a registered one; `resolve_reward("pkg.mod:fn")`
imports a user's function.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rft_hpc.core.plugins import register, resolve
from rft_hpc.tasks.task import Task

RewardFn = Callable[[Task, str], float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` available as reward `name`."""
    return register(_REGISTRY, name)


def resolve_reward(name: str) -> RewardFn:
    """The reward function called `name` (registered, or `module:function`)."""
    return resolve(name, _REGISTRY, "reward function")


@register_reward("exact_match")
def exact_match(task: Task, response: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == task.answer)


_NUMBER = re.compile(r"-?\d+")


@register_reward("exact_match_with_format")
def exact_match_with_format(task: Task, response: str) -> float:
    """exact_match, plus 0.1 for a response that is a bare number (the expected format)."""
    return exact_match(task, response) + 0.1 * bool(_NUMBER.fullmatch(response.strip()))
