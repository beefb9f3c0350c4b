"""Configuration of the data pipeline: task selection, task-set mixing, experience filters and
reward shaping (docs/pipeline.md).

Type names follow Trinity-RFT where it has the same thing: task selectors `sequential`,
`shuffle`, `random`, `offline_easy2hard`, `difficulty_based`; the `reward_std_filter`
experience operator.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rft_hpc.config.tasks import TasksConfig
from rft_hpc.core.config_section import ConfigSection


class SequentialSelector(ConfigSection):
    """Tasks in the order of the task source, over and over."""

    type: Literal["sequential"] = "sequential"
    """Selects file order."""


class ShuffleSelector(ConfigSection):
    """A new seeded permutation of the tasks for every pass over them (epoch)."""

    type: Literal["shuffle"] = "shuffle"
    """Selects seeded epoch permutations (the default)."""


class RandomSelector(ConfigSection):
    """Each task drawn independently and uniformly (with replacement), seeded by position."""

    type: Literal["random"] = "random"
    """Selects uniform draws with replacement."""


class Easy2HardSelector(ConfigSection):
    """A curriculum: tasks sorted by a difficulty given in the task data, easiest first;
    after the hardest task it starts again from the easiest."""

    type: Literal["offline_easy2hard"] = "offline_easy2hard"
    """Selects the easy-to-hard curriculum."""

    key: str = "difficulty"
    """Field of each task's `info` that holds its difficulty (a number; larger is harder).
    Generated arithmetic tasks carry `difficulty`: the number of carries (`+`), borrows
    (`-`) or the answer's digits (`*`)."""


class DifficultyBasedSelector(ConfigSection):
    """Priority by pass rate: each step draws tasks with weight
    exp(-|pass_rate - target| / temperature), so tasks the policy solves about `target` of
    the time come most often. Pass rates are what this explorer itself saw in its committed
    steps; a task never seen counts as exactly at the target."""

    type: Literal["difficulty_based"] = "difficulty_based"
    """Selects pass-rate priority."""

    target: float = Field(0.5, ge=0.0, le=1.0)
    """Pass rate that is most wanted (0.5: tasks that are solved half the time)."""

    temperature: float = Field(0.1, gt=0.0)
    """Sharpness of the preference: small values pick almost only the tasks nearest the
    target, large values almost uniformly."""


SelectorConfig = Annotated[
    SequentialSelector | ShuffleSelector | RandomSelector | Easy2HardSelector
    | DifficultyBasedSelector,
    Field(discriminator="type")]


class TaskSetConfig(ConfigSection):
    """One task set of a mixture: its own source, selector and share of the tasks."""

    name: str = Field(min_length=1)
    """Name of the task set: its records carry it as `taskset`, and its metrics are
    `taskset/<name>/...`."""

    weight: float = Field(1.0, gt=0.0)
    """Relative share of this set's tasks among all tasks of a step."""

    tasks: TasksConfig
    """Where this set's tasks come from (the same forms as the top-level `tasks`)."""

    task_selector: SelectorConfig = Field(default_factory=ShuffleSelector)
    """The order in which this set's tasks are taken."""


class RewardStdFilter(ConfigSection):
    """Drops whole groups (records of one task at one step) whose rewards hardly vary: they
    carry no learning signal for group-relative advantages (DAPO's dynamic sampling)."""

    type: Literal["reward_std_filter"] = "reward_std_filter"
    """Selects the reward-variance filter."""

    name: str | None = None
    """Name in the metrics (`filter/<name>/dropped`); default: the type."""

    min_std: float = Field(0.0, ge=0.0)
    """Groups whose reward standard deviation is at most this are dropped (0: only groups
    whose rewards are all equal)."""


class ResponseLengthFilter(ConfigSection):
    """Drops rollouts whose response is shorter or longer than the limits (in tokens)."""

    type: Literal["response_length_filter"] = "response_length_filter"
    """Selects the length filter."""

    name: str | None = None
    """Name in the metrics (`filter/<name>/dropped`); default: the type."""

    min_tokens: int = Field(0, ge=0)
    """Shortest kept response."""

    max_tokens: int | None = Field(None, ge=1)
    """Longest kept response; null: no upper limit."""


class DuplicateFilter(ConfigSection):
    """Drops rollouts whose response tokens equal an earlier rollout's of the same group."""

    type: Literal["duplicate_filter"] = "duplicate_filter"
    """Selects the duplicate filter."""

    name: str | None = None
    """Name in the metrics (`filter/<name>/dropped`); default: the type."""


FilterConfig = Annotated[RewardStdFilter | ResponseLengthFilter | DuplicateFilter,
                         Field(discriminator="type")]


class FormatReward(ConfigSection):
    """Adds `bonus` to the reward of a response that matches `pattern`, `penalty` to one
    that does not."""

    type: Literal["format_reward"] = "format_reward"
    """Selects the format reward."""

    name: str | None = None
    """Name in the metrics (`shaping/<name>/reward_change`); default: the type."""

    pattern: str
    """Regular expression (Python syntax) the response text should match."""

    full_match: bool = True
    """Match the whole response (stripped of surrounding whitespace); false: anywhere."""

    bonus: float = 0.0
    """Added to the reward of a matching response."""

    penalty: float = 0.0
    """Added to the reward of a response that does not match (give a negative number)."""


class LengthPenalty(ConfigSection):
    """Subtracts `coef` per response token beyond `max_tokens`."""

    type: Literal["length_penalty"] = "length_penalty"
    """Selects the length penalty."""

    name: str | None = None
    """Name in the metrics (`shaping/<name>/reward_change`); default: the type."""

    max_tokens: int = Field(ge=0)
    """Response tokens that cost nothing."""

    coef: float = Field(ge=0.0)
    """Reward taken off per token beyond `max_tokens`."""


ShaperConfig = Annotated[FormatReward | LengthPenalty, Field(discriminator="type")]


class DynamicSampling(ConfigSection):
    """DAPO-style dynamic sampling by the explorers (docs/pipeline.md#dynamic-sampling): a
    group whose rewards hardly vary is dropped and the step draws another task in its place
    (under the same weights), until the step holds `explorer.tasks_per_step` informative
    groups or has drawn `max_groups`; a step that runs out fills up with dropped groups, so
    every step still holds the same number of records and no run waits for more."""

    enabled: bool = False
    """Turn dynamic sampling on (single-turn workflow)."""

    min_std: float = Field(0.0, ge=0.0)
    """Groups whose reward standard deviation (before shaping) is at most this are dropped
    (0: only groups whose rewards are all equal)."""

    max_groups: int | None = Field(None, ge=1)
    """Groups one explorer step may draw in all, the first `tasks_per_step` included;
    null: 4 x `explorer.tasks_per_step`."""

    def budget(self, tasks_per_step: int) -> int:
        """Groups a step may draw in all (at least its `tasks_per_step`)."""
        return max(tasks_per_step, self.max_groups or 4 * tasks_per_step)


def operator_name(op: RewardStdFilter | ResponseLengthFilter | DuplicateFilter
                  | FormatReward | LengthPenalty) -> str:
    """The name a filter or shaper reports its metrics under."""
    return op.name or op.type


class PipelineConfig(ConfigSection):
    """The data pipeline (docs/pipeline.md): which tasks each explorer step takes, how
    rewards are shaped before records enter the buffer, and which records the trainer drops
    before a step. KL shaping of the reward is `algorithm.kl_penalty_fn` (the reference model
    lives in the trainer)."""

    task_selector: SelectorConfig = Field(default_factory=ShuffleSelector)
    """The order in which the tasks of `tasks` are taken (when `tasksets` is empty)."""

    tasksets: list[TaskSetConfig] = Field(default_factory=list)
    """Task sets mixed by weight for the explorers (Trinity-RFT's `tasksets`); empty: the
    top-level `tasks` alone. Held-out evaluation stays on `tasks`' eval split. Each entry:
    `name`, `weight`, `tasks`, `task_selector` (docs/pipeline.md)."""

    pass_threshold: float = 1.0
    """A rollout passes when its reward (before shaping) is at least this: pass rates of the
    `difficulty_based` selector and of the `taskset/<name>/pass_rate` metrics."""

    reward_shaping: list[ShaperConfig] = Field(default_factory=list)
    """Changes to each rollout's reward, applied in order by the explorer before it writes
    the records (the reward before shaping stays in the record's info as `raw_reward`).
    Types `format_reward`, `length_penalty`; their keys: docs/pipeline.md."""

    experience_filters: list[FilterConfig] = Field(default_factory=list)
    """Records the trainer drops from each batch before its step, in order (dropped records
    count as consumed). Types `reward_std_filter`, `response_length_filter`,
    `duplicate_filter`; their keys: docs/pipeline.md."""

    dynamic_sampling: DynamicSampling = Field(default_factory=DynamicSampling)
    """Explorers replace groups whose rewards are all equal by fresh ones (DAPO's dynamic
    sampling); keys `enabled`, `min_std`, `max_groups` (docs/pipeline.md)."""

    @model_validator(mode="after")
    def _unique_names(self) -> PipelineConfig:
        sets = [t.name for t in self.tasksets]
        if len(set(sets)) != len(sets):
            raise ValueError(f"tasksets: names must differ (got {sets})")
        for key, chain in (("reward_shaping", self.reward_shaping),
                           ("experience_filters", self.experience_filters)):
            names = [operator_name(op) for op in chain]
            if len(set(names)) != len(names):
                raise ValueError(f"{key}: give operators of the same type different `name`s "
                                 f"(got {names})")
        return self

    def uses_pass_rates(self) -> bool:
        """Whether a selector needs this explorer's pass rates."""
        selectors = [t.task_selector for t in self.tasksets] or [self.task_selector]
        return any(isinstance(s, DifficultyBasedSelector) for s in selectors)
