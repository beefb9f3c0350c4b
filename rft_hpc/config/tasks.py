"""Configuration of the task source: generated arithmetic or the user's data files (JSONL,
Parquet or a Hugging Face `datasets` folder), and the key mapping that reads them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from rft_hpc.config.paths import ConfigPath
from rft_hpc.config.rewards import RewardField, RewardSpec, default_reward
from rft_hpc.core.config_section import ConfigSection


class ArithmeticTasks(ConfigSection):
    """Generated problems `a<op>b=` with an exact-match answer reward."""

    type: Literal["arithmetic"] = "arithmetic"
    """Selects generated arithmetic tasks."""

    digits: int = Field(2, ge=1, le=3)
    """Digits of each operand (2: 10..99)."""

    ops: str = Field("+", pattern=r"^[+\-*]+$")
    """Operators to generate problems for, e.g. `+` or `+-`."""

    eval_size: int = Field(500, ge=1)
    """Problems held out for evaluation (never trained on)."""

    reward: RewardField = Field(default_factory=default_reward)
    """Reward function: a built-in name or `package.module:function`, or `{name, args}` to
    give it keyword arguments; a reward model `{model, normalize}`; or a list of those,
    whose weighted sum is the reward (docs/rewards.md)."""


class _ToolTaskSplits(ConfigSection):
    """The splits and reward of a generated tool task."""

    train_size: int = Field(5000, ge=1)
    """Training tasks, drawn at random (seeded by `run.seed`)."""

    eval_size: int = Field(500, ge=1)
    """Tasks held out for evaluation (never trained on)."""

    reward: RewardField = Field(default_factory=default_reward)
    """Reward of the final answer (the turn without a tool call): a built-in name or
    `package.module:function`, or `{name, args}`, or a weighted list of functions
    (docs/rewards.md; reward models score single-turn rollouts only)."""

    call_share: float = Field(1.0, ge=0.0, le=1.0)
    """Share of the training tasks whose demonstration (`data: {source: tasks}`) calls the
    tool; the others answer at once, as in a corpus written partly without the tool. A
    warm-up on them calls the tool on about this share of its samples, and reinforcement
    learns where the call pays (docs/agents.md)."""


class ProductsTasks(_ToolTaskSplits):
    """Generated products `What is a*b?` of `digits`-digit numbers, answered with the
    `multiply` tool (`rft_hpc.envs.calculator:multiply` in `prompt.tools`; docs/agents.md).
    Each task carries the call that solves it, from which `data: {source: tasks}` builds
    demonstrations of tool use."""

    type: Literal["products"] = "products"
    """Selects generated products."""

    digits: int = Field(3, ge=1, le=6)
    """Digits of each factor (3: 100..999; products a tiny model cannot work out alone)."""


class LookupTasks(_ToolTaskSplits):
    """Generated lookups `What is the code of account n?`, answered with the `lookup` tool
    (`rft_hpc.envs.codebook:lookup` in `prompt.tools`; docs/agents.md). Each task carries
    the call that solves it, from which `data: {source: tasks}` builds demonstrations of
    tool use."""

    type: Literal["lookup"] = "lookup"
    """Selects generated lookups."""

    digits: int = Field(4, ge=2, le=8)
    """Digits of each account number."""


GOLD_REWARD = "rft_hpc.tasks.preferences:gold_reward"
"""The hidden gold rule of the generated preference data (docs/reward-models.md)."""


class DescribeTasks(ConfigSection):
    """Generated prompts `Describe the <topic>.`, scored by default with the hidden gold
    rule of the generated preference data (`rft_hpc.tasks.preferences:gold_reward`,
    docs/reward-models.md). The evaluation tasks ask about topics the training tasks never
    name; each task's answer is its topic."""

    type: Literal["describe"] = "describe"
    """Selects generated descriptions."""

    train_size: int = Field(5000, ge=1)
    """Training tasks, their topics drawn at random (seeded by `run.seed`) from the
    training topics."""

    eval_size: int = Field(500, ge=1)
    """Tasks held out for evaluation, on the held-out topics (never trained on)."""

    reward: RewardField = Field(default_factory=lambda: RewardSpec(name=GOLD_REWARD))
    """Reward function: the gold rule by default; a built-in name or
    `package.module:function` (e.g. a learned reward model), or `{name, args}`
    (docs/rewards.md)."""


class DataKeys(ConfigSection):
    """Which column of a data source holds what (docs/data.md). Every other column goes
    into the task's (or record's) `info`, for rewards and workflows."""

    prompt: str = "prompt"
    """Column of the prompt text (GSM8K: `question`, MATH: `problem`)."""

    messages: str | None = None
    """Column of a chat prompt: a list of `{role, content}` (for offline SFT data the whole
    conversation, its last message the assistant's response); when set, always used (in
    place of the prompt column); unset, a `messages` column is used when the source has no
    prompt column. (Unset rather than a default name, so that a frozen config that writes
    every key out means the same.)"""

    answer: str = "answer"
    """Column of the reference answer of a task (MATH: `solution`); text, or an integer."""

    response: str = "response"
    """Column of the response trained on, for offline SFT data."""

    chosen: str = "chosen"
    """Column of the preferred response, for offline DPO data."""

    rejected: str = "rejected"
    """Column of the other response, for offline DPO data."""

    task_id: str = "task_id"
    """Column of each row's id, where the source has one (else `<file stem>-<row>`)."""

    margin: str | None = None
    """Column of each DPO pair's margin (a number: how much better the chosen response is),
    kept in the record's `info["margin"]`; unset, pairs carry no margin. Layout `pairs`
    only: layout `webgpt` takes the score difference."""

    question: str = "question"
    """Column of the question, for offline DPO data in layout `webgpt`: text, or a mapping
    whose `full_text` is the text (as in WebGPT's comparisons)."""

    answer_0: str = "answer_0"
    """Column of the first answer, for offline DPO data in layout `webgpt`."""

    answer_1: str = "answer_1"
    """Column of the second answer, for offline DPO data in layout `webgpt`."""

    score_0: str = "score_0"
    """Column of the first answer's score (a number), for offline DPO data in layout
    `webgpt`; the higher-scored answer is the one chosen."""

    score_1: str = "score_1"
    """Column of the second answer's score (a number), for offline DPO data in layout
    `webgpt`."""


def check_rows(rows: tuple[int, int] | None) -> tuple[int, int] | None:
    """A row range `[start, stop)` with 0 <= start < stop, as `rows` settings take."""
    if rows is not None and not 0 <= rows[0] < rows[1]:
        raise ValueError(f"must be [start, stop) with 0 <= start < stop, got {list(rows)}")
    return rows


RowRange = Annotated[tuple[int, int], AfterValidator(check_rows)]
"""Rows `[start, stop)` of a source, written `[0, 1000]`."""


class DataSourceFields(ConfigSection):
    """Where rows come from: a file or folder, a split of it and a range of its rows."""

    path: ConfigPath
    """A `.jsonl` file, a `.parquet` file, or a folder written by `datasets`' `save_to_disk`
    (read locally, never from a hub). `${VAR}` and `~` are expanded."""

    split: str | None = None
    """Split of a `datasets` folder that holds several (e.g. `train`); a folder with one
    split needs none."""

    rows: RowRange | None = None
    """Rows `[start, stop)` to take (0-based, in file order; a stop past the end takes the
    rows there are); null takes all."""

    keys: DataKeys = Field(default_factory=DataKeys)
    """Which columns hold the prompt, answer, messages, ... (defaults: those names)."""


class HeldOutFields(DataSourceFields):
    """A data source with rows held out of training, for evaluation."""

    eval_path: ConfigPath | None = None
    """Held-out rows (same forms as `path`, same `keys`): evaluation tasks, or a reward
    model's held-out pairs; none, and no `eval_split` or `eval_rows` either, means none."""

    eval_split: str | None = None
    """Split of the held-out source (of `path` itself when `eval_path` is not set)."""

    eval_rows: RowRange | None = None
    """Rows `[start, stop)` of the held-out source (of `path` when `eval_path` is not set:
    then they must not overlap `rows`)."""

    @model_validator(mode="after")
    def _held_out_apart(self) -> HeldOutFields:
        if self.eval_path is None and self.eval_split is None and self.eval_rows is not None:
            start, stop = self.rows if self.rows is not None else (0, None)
            e0, e1 = self.eval_rows
            if stop is None or (e0 < stop and start < e1):
                raise ValueError("eval_rows overlap the training rows of the same source: "
                                 "set rows and eval_rows apart (or an eval_path / eval_split)")
        return self

    def eval_source(self) -> DataSourceFields | None:
        """The held-out source: `eval_path` (or `path`) with `eval_split` and `eval_rows`;
        None when none of them is set."""
        if self.eval_path is None and self.eval_split is None and self.eval_rows is None:
            return None
        return DataSourceFields(path=self.eval_path or self.path,
                                split=self.eval_split if self.eval_path or self.eval_split
                                else self.split,
                                rows=self.eval_rows, keys=self.keys)


class FileTasks(HeldOutFields):
    """Tasks from a data file or `datasets` folder: a prompt (or messages) and an answer per
    row, the other columns in the task's `info`."""

    type: Literal["file", "jsonl"] = "file"
    """Selects tasks from data files (`jsonl` is the same, its earlier name)."""

    reward: RewardField | None = None
    """Reward of every task, a name or `{name, args}`, a reward model `{model, normalize}`,
    or a list of those whose weighted sum is the reward (docs/rewards.md); it wins over a
    row's own `reward` column. Null: each row's `reward` column, else `exact_match`."""


JsonlTasks = FileTasks
"""The earlier name of `FileTasks` (it read JSONL only)."""

TasksConfig = Annotated[ArithmeticTasks | ProductsTasks | LookupTasks | DescribeTasks
                        | FileTasks, Field(discriminator="type")]
