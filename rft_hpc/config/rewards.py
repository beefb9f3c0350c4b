"""Configuration of reward functions: a name, or a name with keyword arguments.

A task source's `reward` is a plain name (`reward: math_verify`) or a mapping
(`reward: {name: math_verify, args: {answer_tag: answer}}`). The config checks only the
spelling here: a built-in name from `BUILTIN_REWARDS`, or the form `package.module:function`.
Whether the function imports and takes the arguments is checked before a run starts, by
`rft_hpc.tasks.reward_check` (imports have no place in the config layer).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from rft_hpc.core.config_section import ConfigSection

BUILTIN_REWARDS: dict[str, str] = {
    "exact_match": "rft_hpc.tasks.rewards:exact_match",
    "exact_match_with_format": "rft_hpc.tasks.rewards:exact_match_with_format",
    "math_verify": "rft_hpc.tasks.math_reward:math_verify",
    "think_answer_format": "rft_hpc.tasks.format_reward:think_answer_format",
}
"""The rewards a config may name without an import path, and where each function is (the
config checks names against this table without importing anything; docs/rewards.md)."""

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_reward_name(name: str) -> str:
    """`name` when it is a built-in reward or spelled `package.module:function`; else a
    `ValueError` listing the built-ins (pydantic reports it at the key, with its line)."""
    if name in BUILTIN_REWARDS or _IMPORT_PATH.fullmatch(name):
        return name
    if ":" in name:
        raise ValueError(f"reward {name!r} is not of the form package.module:function")
    raise ValueError(f"unknown reward {name!r}; built-in: {', '.join(BUILTIN_REWARDS)}, "
                     "or give package.module:function")


class RewardSpec(ConfigSection):
    """A reward function and the keyword arguments it is called with."""

    name: str
    """A built-in reward (`exact_match`, `exact_match_with_format`, `math_verify`,
    `think_answer_format`) or the user's `package.module:function`, called as
    `function(task, response, **args)` and returning a number (docs/rewards.md)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the reward function, besides the task and the response (each
    built-in's own are in docs/rewards.md); checked against its signature before a run
    starts."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_reward_name(name)


def _from_name(value: object) -> object:
    """A plain name is `{name: <it>}`, checked here so that its error is at the key itself."""
    if isinstance(value, str):
        return RewardSpec(name=check_reward_name(value))
    return value


RewardField = Annotated[RewardSpec, BeforeValidator(_from_name)]
"""A config's `reward`: a name (`math_verify`), or `{name, args}`."""


def default_reward() -> RewardSpec:
    """`exact_match`, without arguments."""
    return RewardSpec(name="exact_match")
