"""The learning-rate schedule: linear warm-up from 0, then constant, linear or cosine decay
to a floor over the rest of the trainer's steps (`trainer.lr_schedule`)."""

from __future__ import annotations

import math
from typing import get_args

import torch

from rft_hpc.config.schema import LRSchedule

SCHEDULES: tuple[str, ...] = get_args(LRSchedule)


def lr_factor(step: int, total: int, warmup: int = 0, schedule: str = "constant",
              min_ratio: float = 0.0) -> float:
    """The multiple of the base learning rate used by optimizer step `step` (0-based) of a
    run of `total` steps: (step + 1) / `warmup` during the warm-up, then 1.0 (`constant`),
    or a decay that starts at 1.0 right after the warm-up and would reach `min_ratio` at
    step `total` (`linear`, `cosine`; as transformers' schedules do, so that no step of the
    run has a zero rate)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}: one of {SCHEDULES}")
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = total - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else 0.0
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, total: int, warmup: int = 0,
                    schedule: str = "constant",
                    min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that sets `optimizer`'s learning rate to its base rate times `lr_factor`
    at each step; its state (the step count) goes into trainer checkpoints, so a resumed run
    continues the same curve."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, warmup, schedule, min_ratio))
