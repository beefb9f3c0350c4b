"""What the trainer loop and role ask of a stage's trainer: the policy trainer
(`trainer.trainer.Trainer`) and the reward model's (`trainer.reward_model`) both offer it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from rft_hpc.buffer.reader import Batch
from rft_hpc.config import ExperimentConfig
from rft_hpc.trainer.backend import TrainerBackend
from rft_hpc.trainer.distributed import DistContext


class StageTrainer(Protocol):
    """One stage's model, optimizer and loss on one rank."""

    config: ExperimentConfig
    dist: DistContext
    backend: TrainerBackend
    device: torch.device
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def sharded(self) -> bool:
        """True when the full weights exist only when gathered from every rank."""
        ...

    def step(self, batch: Batch | None, version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (rank 0; None on the others: a collective);
        the whole batch's metrics."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights with their Hugging Face names (what is published)."""
        ...

    def checkpoint_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `save_trainer_state` takes them."""
        ...

    def restore_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `load_trainer_state` takes them."""
        ...

    def checkpoint_modules(self) -> dict[str, Any]:
        """Parts saved with a checkpoint besides the model, optimizer and schedule."""
        ...
