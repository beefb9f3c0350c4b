"""The experiment configuration: one YAML file, validated by these pydantic models.

Every model forbids unknown keys, and every field carries a docstring: docs/config.md is
rendered from them (`rft_hpc.config.reference`), and `rft-hpc validate` names the fields in
its messages. Section and field names follow Trinity-RFT where it has one for the same knob.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rft_hpc.buffer.config import BufferConfig

Mode = Literal["both", "train", "explore", "bench"]

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class RunConfig(_Section):
    """Where the run directory lives and how the run is seeded."""

    name: str = "demo"
    """Name of the run: its folder under `root` (letters, digits, '.', '_' and '-')."""

    root: Path = Path("runs")
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


class ModelConfig(_Section):
    """The policy model that the explorers sample from and the trainer updates."""

    path: Path | None = None
    """Local Hugging Face model folder (config.json, tokenizer, safetensors); relative to the
    current directory. Must exist when set."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for inference and training (float32 on CPUs, bfloat16 on GPUs)."""


class ExplorerConfig(_Section):
    """The explorers: processes (Slurm array tasks) that turn tasks into scored rollouts."""

    count: int = Field(1, ge=1)
    """Number of explorer processes, one Slurm array task each, each writing its own buffer
    folder."""

    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine: `hf` (transformers, runs on CPUs) or `vllm` (GPUs)."""

    tasks_per_step: int = Field(8, ge=1)
    """Tasks each explorer takes from the task stream per explorer step."""

    repeat: int = Field(8, ge=1)
    """Rollouts generated per task (the group size of GRPO; Trinity-RFT's `repeat_times`)."""

    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 samples greedily."""

    max_new_tokens: int = Field(16, ge=1)
    """Longest response generated per rollout, in tokens."""

    steps: int = Field(100, ge=1)
    """Explorer steps each explorer runs before it stops."""


class TrainerConfig(_Section):
    """The trainer: reads experiences from the buffer, updates and publishes the policy."""

    algorithm: Literal["grpo", "ppo", "sft", "dpo"] = "grpo"
    """Training algorithm (Trinity-RFT's `algorithm_type`)."""

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


class SyncConfig(_Section):
    """How and how often new policy weights travel from the trainer to the explorers."""

    method: Literal["checkpoint", "nccl", "mpi"] = "checkpoint"
    """Transport: `checkpoint` (files on the shared filesystem, always works), `nccl`
    (torch.distributed broadcast, gloo on CPUs) or `mpi` (mpi4py broadcast)."""

    interval: int = Field(1, ge=1)
    """Trainer steps between weight publishes (Trinity-RFT's `sync_interval`)."""

    offset: int = Field(0, ge=0)
    """Steps an explorer may run ahead of the newest weights it holds: 0 is strictly
    on-policy, 1 one-step off-policy, large fully asynchronous (`sync_offset`)."""

    timeout: float = Field(600.0, gt=0.0)
    """Seconds a sync may take before the role falls back to `checkpoint` (`sync_timeout`)."""


class ExperimentConfig(_Section):
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

    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight synchronization from the trainer to the explorers (Trinity-RFT's
    `synchronizer`)."""

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """A section left empty in YAML (`trainer:` with nothing under it) takes its defaults."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in _SECTIONS)}


_SECTIONS = frozenset(
    name for name, field in ExperimentConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
)
"""Top-level keys that hold a section (a mapping of settings), rather than a single value."""
