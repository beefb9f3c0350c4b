"""Configuration of a task source's reward: a reward function (a name, or a name with
keyword arguments), a reward model folder, or a weighted sum of such terms.

`reward: math_verify`, `reward: {name: math_verify, args: {answer_tag: answer}}`,
`reward: {model: /models/rm, normalize: batch}` and
`reward: [{name: exact_match, weight: 0.5}, {model: /models/rm}]`. Each term is told apart
by its key (`name`: a function, `model`: a reward model), so that a further kind of term
(an LLM judge, `{judge: ...}`) is one more tagged member of `RewardTerm`. The config checks
only spelling here: a built-in name from `BUILTIN_REWARDS`, or the form
`package.module:function`. Whether the function imports and takes the arguments, and
whether a model folder holds a one-label sequence classifier, is checked before a run
starts, by `rft_hpc.tasks.reward_check` (imports have no place in the config layer).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator

from rft_hpc.config.paths import ConfigPath
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
    """A reward function and the keyword arguments it is called with (alone, or as an entry
    of a list of rewards)."""

    name: str
    """A built-in reward (`exact_match`, `exact_match_with_format`, `math_verify`,
    `think_answer_format`) or the user's `package.module:function`, called as
    `function(task, response, **args)` and returning a number (docs/rewards.md)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the reward function, besides the task and the response (each
    built-in's own are in docs/rewards.md); checked against its signature before a run
    starts."""

    weight: float = 1.0
    """Factor of this function's score in the reward: in a list of rewards, its weight in
    the weighted sum (docs/rewards.md)."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_reward_name(name)


class RewardModelSpec(ConfigSection):
    """A reward model (alone, or as an entry of a list of rewards): a local Hugging Face
    sequence-classification folder with one label, scoring prompt and response together in
    the explorer (docs/rewards.md)."""

    model: ConfigPath | None = None
    """The reward model's folder (config.json with a `...ForSequenceClassification`
    architecture and `num_labels` 1, its tokenizer, weights), read locally, never from a
    hub. `${VAR}` and `~` are expanded. Null with `stage`."""

    stage: str | None = None
    """Instead of `model`: the name of a reward-model stage of this run (`algorithm_type:
    reward_model`); the stages after it score with its final weights, which it exports when
    it finishes (`<its stage folder>/reward_model`, docs/reward-models.md). Only
    reward-model stages may come before it."""

    normalize: Literal["none", "batch", "running"] = "none"
    """How its scores are normalised: `none` (the model's output), `batch` (z-score over
    the calls scored in one forward batch), `running` (z-score by the running mean and
    standard deviation of every score this explorer got from it so far)."""

    weight: float = 1.0
    """Factor of this model's (normalised) score in the reward: in a list of rewards, its
    weight in the weighted sum."""

    batch_size: int = Field(32, ge=1)
    """Most rollouts scored in one forward pass (the explorer scores what is queued, in
    batches of up to this many)."""

    @model_validator(mode="after")
    def _model_or_stage(self) -> RewardModelSpec:
        if (self.model is None) == (self.stage is None):
            raise ValueError("give a reward model as `model` (its folder) or `stage` (a "
                             "reward-model stage of this run), one of the two")
        return self


def _term_kind(value: object) -> str:
    """The tag of a reward term: `model` for a reward model, `function` otherwise."""
    if isinstance(value, dict):
        return "model" if "model" in value or "stage" in value else "function"
    return "model" if isinstance(value, RewardModelSpec) else "function"


RewardTerm = Annotated[Annotated[RewardSpec, Tag("function")]
                       | Annotated[RewardModelSpec, Tag("model")],
                       Discriminator(_term_kind)]
"""One term of a reward: a function (`{name, args}`) or a reward model (`{model}`)."""

AnyRewardSpec = RewardSpec | RewardModelSpec
"""A validated reward term, of whatever kind."""


def _one_or_sum(value: object) -> str:
    return "sum" if isinstance(value, list | tuple) else "one"


def _from_name(value: object) -> object:
    """A plain name is `{name: <it>}` (also as an entry of a list), checked so that its
    error is at the key itself (the entry's `name` in a list)."""
    if isinstance(value, str):
        return RewardSpec(name=check_reward_name(value))
    if isinstance(value, list):
        return [{"name": v} if isinstance(v, str) else v for v in value]
    return value


RewardField = Annotated[Annotated[RewardTerm, Tag("one")]
                        | Annotated[list[RewardTerm], MinLen(1), Tag("sum")],
                        Discriminator(_one_or_sum), BeforeValidator(_from_name)]
"""A config's `reward`: a name (`math_verify`), `{name, args}`, a reward model
`{model, normalize}`, or a list of those, whose weighted sum is the reward."""


def reward_terms(reward: AnyRewardSpec | list[AnyRewardSpec]) -> list[AnyRewardSpec]:
    """The terms of a `reward` setting, as a list (one term for a single reward)."""
    return list(reward) if isinstance(reward, list) else [reward]


def default_reward() -> RewardSpec:
    """`exact_match`, without arguments."""
    return RewardSpec(name="exact_match")


def _spec_from_name(value: object) -> object:
    return RewardSpec(name=check_reward_name(value)) if isinstance(value, str) else value


GoldReward = Annotated[RewardSpec, BeforeValidator(_spec_from_name)]
"""A reward function alone, a name or `{name, args}` (`eval.gold`)."""


REWARD_MODEL_FOLDER = "reward_model"
"""Where a finished reward-model stage exports its final weights, in its stage folder (the
model of the rewards that name the stage)."""


def resolved_rewards(tasks: dict[str, Any], exported: dict[str, Path]) -> dict[str, Any]:
    """`tasks` (dumped) with each reward term that names a stage of `exported` given that
    stage's exported folder as its `model`; terms naming later stages are left as they are."""
    reward = tasks.get("reward")
    terms = reward if isinstance(reward, list) else [reward]

    def resolved(term: Any) -> Any:
        if isinstance(term, dict) and term.get("stage") in exported:
            return {**term, "model": str(exported[term["stage"]]), "stage": None}
        return term

    new = [resolved(t) for t in terms]
    return {**tasks, "reward": new if isinstance(reward, list) else new[0]}
