"""The trainer of a reward model (`algorithm_type: reward_model`): a scalar head on the
model, trained on preference pairs with the Bradley-Terry loss.

It offers the trainer loop what `Trainer` does (`step`, the weights, the checkpoint parts),
so the loop, checkpoints, restarts, publishing and the ledger are the policy trainer's. The
model is a Hugging Face sequence-classification model (`rft_hpc.models.reward_model`); its
published weights carry its names (the trunk's and `score.weight`), so `rft-hpc export`
writes a folder that transformers loads as it is. One whole replica per rank (the torch
backend, ddp): rank 0 splits each batch's pairs over the ranks, each rank's loss is its
pairs' share of the batch's, and the gradients are summed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rft_hpc.algorithms.reward_model import bradley_terry_loss
from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import DPOPair
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.models.reward_model import HEAD, load_reward_model, sequence_scores
from rft_hpc.sync.weight_files import load_weights
from rft_hpc.trainer.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_gradients,
    scatter_objects,
)
from rft_hpc.trainer.lr_schedule import build_scheduler
from rft_hpc.trainer.torch_backend import TorchBackend


class _Holder:
    """What `TorchBackend.build` takes the model from (the policy trainer's engine)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class RewardModelTrainer:
    """Model, optimizer and loss of a reward-model stage; `step(batch)` is one update."""

    def __init__(self, config: ExperimentConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext()
        self.backend = TorchBackend(config, self.dist)
        self.device = self.backend.device
        self.tokenizer, model = load_reward_model(config.model.path)
        _load_start_trunk(model, config)
        self.pad_id = int(model.config.pad_token_id)
        self.backend.place(model)
        self.backend.build(_Holder(model), reference=False)  # type: ignore[arg-type]
        tcfg = config.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tcfg.lr,
                                           weight_decay=tcfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, tcfg.steps, tcfg.warmup_steps,
                                         tcfg.lr_schedule, tcfg.min_lr_ratio)

    @property
    def model(self) -> torch.nn.Module:
        """The reward model being trained (a whole replica on every rank)."""
        return self.backend.model

    sharded = False
    """Every rank holds the whole model: gathering its weights is no collective."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in."""
        return self.backend.compute_dtype

    def checkpoint_modules(self) -> dict[str, Any]:
        """Parts saved with a checkpoint besides the model, optimizer and schedule: none."""
        return {}

    def step(self, batch: Batch | None, version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch`'s pairs (rank 0 passes the batch, the other ranks
        None: a collective); returns the whole batch's metrics on every rank: `loss` (the
        mean Bradley-Terry loss), `accuracy` (pairs whose chosen response scored higher),
        `reward_gap` (mean r_chosen - r_rejected), `pairs`, `tokens`, `lr`, `grad_norm`.
        `version` is the policy trainer's argument, unused here."""
        del version
        if self.dist.is_main:
            if batch is None:
                raise ValueError("rank 0 (or a single-process trainer) needs a batch")
            pairs = _pairs(batch)
            shards = [pairs[r::self.dist.world_size] for r in range(self.dist.world_size)]
            mine = scatter_objects([(s, len(pairs)) for s in shards], self.dist)
        else:
            mine = scatter_objects(None, self.dist)
        shard, pairs_in_batch = mine
        total = max(pairs_in_batch, 1)  # an empty batch steps nothing and logs zeros
        self.optimizer.zero_grad(set_to_none=True)
        part = {"loss": 0.0, "correct": 0.0, "reward_gap": 0.0, "tokens": 0.0}
        if shard:
            loss, sums = self._loss(shard)
            (loss / total).backward()
            part.update(sums, loss=float(loss.detach()),
                        tokens=float(sum(len(p.chosen_tokens) + len(p.rejected_tokens)
                                         for p in shard)))
        merged = {k: sum(m[k] for m in all_gather_objects(part, self.dist)) for k in part}
        all_reduce_gradients(self.model.parameters(), self.dist)
        values = {"loss": merged["loss"] / total, "accuracy": merged["correct"] / total,
                  "reward_gap": merged["reward_gap"] / total, "pairs": float(pairs_in_batch),
                  "tokens": merged["tokens"], "stale_dropped": 0}
        cfg = self.config.trainer
        if cfg.grad_clip > 0:
            values["grad_norm"] = self.backend.clip_gradients(cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        values["lr"] = self.scheduler.get_last_lr()[0]
        return values

    def _loss(self, pairs: list[DPOPair]) -> tuple[torch.Tensor, dict[str, float]]:
        rows = [p.chosen_tokens.tolist() for p in pairs] + \
            [p.rejected_tokens.tolist() for p in pairs]
        with self.backend.autocast():
            scores = sequence_scores(self.model, rows, self.pad_id, self.device)
        margins = [p.info.get("margin") for p in pairs]
        margin = None if all(m is None for m in margins) else torch.tensor(
            [float(m or 0.0) for m in margins], device=scores.device)
        n = len(pairs)
        return bradley_terry_loss(scores[:n], scores[n:], margin)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reward model's full weights with its Hugging Face names."""
        return self.backend.full_state()

    def checkpoint_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `save_trainer_state` takes them."""
        return self.backend.checkpoint_parts(self.optimizer)

    def restore_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `load_trainer_state` takes them."""
        return self.backend.restore_parts(self.optimizer)


def _pairs(batch: Batch) -> list[DPOPair]:
    if not all(isinstance(r, DPOPair) for r in batch.records):
        raise UserError("reward_model trains on preference pairs; the buffer holds other "
                        "records (import pairs with data.kind dpo)")
    return list(batch.records)  # type: ignore[arg-type]


def _load_start_trunk(model: torch.nn.Module, config: ExperimentConfig) -> None:
    """A later stage's start (`model.start_weights`): a policy's weights give the trunk (the
    head starts as it is), a reward model's give the head too."""
    start = config.model.start_weights
    if start is None:
        return
    folder = Path(start)
    state = load_weights(folder.parent, int(folder.name[1:]))
    own = model.state_dict()
    taken = {k: v for k, v in state.items() if k in own}
    missing = [k for k in own if k not in taken and not k.startswith(f"{HEAD}.")]
    if missing:
        raise UserError(f"model.start_weights {folder} lacks {len(missing)} of the reward "
                        f"model's weights (e.g. {missing[0]}): not this model's")
    model.load_state_dict(taken, strict=False)
