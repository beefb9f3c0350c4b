"""The policy being trained: model, optimizer, loss; `Trainer.step` is one update.

With several ranks (`rft_hpc.trainer.distributed`) every rank holds a full replica and
`step` is a collective: rank 0 shards the batch (GRPO advantages over the whole batch), each
rank's loss is its tokens' share of the whole batch's token-mean, gradients are summed.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import torch

from rft_hpc.buffer.reader import Batch
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.eval.accuracy import exact_match_accuracy
from rft_hpc.explorer.role import load_start_weights
from rft_hpc.trainer.batching import TokenBatch, collate
from rft_hpc.trainer.distributed import (
    DistContext,
    Shard,
    all_reduce_gradients,
    all_reduce_sum,
    broadcast_parameters,
    scatter_objects,
    shard_batch,
)
from rft_hpc.trainer.losses import (
    grpo_advantages,
    kl_penalty,
    policy_loss,
    sft_loss,
    token_logprobs,
)


def config_hash(config: ExperimentConfig) -> str:
    """Hash of the settings a resumed trainer must share with the saved one."""
    keep = config.model_dump(mode="json", include={"model", "buffer", "trainer", "tasks"})
    for key in ("steps", "save_interval", "keep_checkpoints", "threads"):
        keep["trainer"].pop(key, None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    """Model, optimizer and loss of one stage; `step(batch)` is one policy update.

    With a `DistContext` of several ranks every rank holds a full replica on its device
    and `step` is a collective (see `step`); the replicas start from rank 0's weights.
    """

    def __init__(self, config: ExperimentConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext()
        tcfg = config.trainer
        self.tokenizer, self.model = load_policy(config.model.path, config.model.dtype)
        self.device = self.dist.device
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.engine = HFEngine(model=self.model, tokenizer=self.tokenizer,
                               device=str(self.device))
        load_start_weights(self.engine, config)
        broadcast_parameters(self.model, self.dist)
        self.model.train()
        self.reference = copy.deepcopy(self.model).eval() if tcfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tcfg.lr,
                                           weight_decay=tcfg.weight_decay)
        warmup = tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.pad_id = self.engine.pad_id

    def step(self, batch: Batch | None) -> dict[str, float]:
        """One optimizer step on `batch`; returns the step's metrics.

        With several ranks this is a collective that every rank calls: rank 0 with the
        whole batch, the others with None. Rank 0 sends each rank its shard (GRPO advantages
        computed over the whole batch); each rank's loss is its tokens' share of the whole
        batch's token-mean; the gradients are summed over the ranks; every rank takes the
        same optimizer step. The metrics, on every rank, are those of the whole batch.
        """
        if self.dist.distributed:
            return self._step_shard(self._receive_shard(batch))
        if batch is None:
            raise ValueError("a single-process trainer needs a batch")
        cfg = self.config.trainer
        tb = collate(batch.records, pad_id=self.pad_id)
        adv = None
        if cfg.algorithm != "sft":
            adv = grpo_advantages(tb.rewards, tb.group_ids)
            adv = adv * torch.tensor(batch.weights, dtype=adv.dtype)
        loss, values = self._loss(tb, adv)
        if adv is not None:
            values["reward_mean"] = float(tb.rewards.float().mean())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        values.update(self._optimizer_step())
        values.update(loss=float(loss), lr=self.scheduler.get_last_lr()[0],
                      tokens=float(tb.loss_mask.sum()), stale_dropped=batch.dropped_stale)
        return values

    def _loss(self, tb: TokenBatch, adv: torch.Tensor | None,
              num_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of `tb` (SFT, or GRPO with advantages `adv`) and its metrics.

        `num_tokens`: divisor of the token-mean (default: the tokens of `tb`)."""
        cfg = self.config.trainer
        values: dict[str, float] = {}
        if cfg.algorithm == "sft":
            return sft_loss(token_logprobs(self.model, tb), tb.loss_mask,
                            num_tokens=num_tokens), values
        temperature = self.config.explorer.temperature or 1.0
        new = token_logprobs(self.model, tb, temperature)
        old = tb.old_logprobs
        if tb.has_old_logprobs is not None and not bool(tb.has_old_logprobs.all()):
            # Imported records carry no rollout log-probs: treat them as on-policy.
            known = tb.has_old_logprobs.unsqueeze(1)
            old = torch.where(known, old, new.detach())
            values["unknown_logprob_records"] = float((~tb.has_old_logprobs).sum())
        assert adv is not None
        loss, parts = policy_loss(new, old, adv, tb.loss_mask, clip_low=cfg.clip_ratio,
                                  clip_high=cfg.clip_ratio, num_tokens=num_tokens)
        values.update({k: float(v) for k, v in parts.items()})
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, tb, temperature)
            kl = kl_penalty(new, ref, tb.loss_mask, num_tokens=num_tokens)
            loss = loss + cfg.kl_coef * kl
            values["kl_ref"] = float(kl)
        return loss, values

    def _optimizer_step(self) -> dict[str, float]:
        """Clip the gradients (when configured), step the optimizer and the schedule."""
        cfg = self.config.trainer
        values = {}
        if cfg.grad_clip > 0:
            values["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                       cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        return values

    def _receive_shard(self, batch: Batch | None) -> Shard:
        if self.dist.is_main:
            if batch is None:
                raise ValueError("rank 0 must pass the batch")
            shards = shard_batch(batch, self.dist.world_size,
                                 advantages=self.config.trainer.algorithm != "sft")
            return scatter_objects(shards, self.dist)
        return scatter_objects(None, self.dist)

    # Metrics summed over the ranks; token means travel as sums over each rank's tokens.
    _SUMS = ("loss", "unknown_logprob_records", "clip_fraction", "ratio_mean", "approx_kl",
             "kl_ref", "reward_sum")
    _PER_TOKEN = ("clip_fraction", "ratio_mean", "approx_kl")

    def _step_shard(self, shard: Shard) -> dict[str, float]:
        """This rank's part of a data-parallel step (see `step`)."""
        self.optimizer.zero_grad(set_to_none=True)
        local: dict[str, float] = {}
        if shard.records:
            tb = collate(shard.records, pad_id=self.pad_id)
            adv = shard.advantages
            if self.device.type != "cpu":
                tb = tb.to(self.device)
                adv = None if adv is None else adv.to(self.device)
            loss, local = self._loss(tb, adv, num_tokens=shard.num_tokens)
            loss.backward()
            mine = float(tb.loss_mask.sum())
            for key in self._PER_TOKEN:
                if key in local:
                    local[key] *= mine
            local["loss"] = float(loss)
            if tb.rewards is not None:
                local["reward_sum"] = float(tb.rewards.double().sum())
        sums = torch.tensor([local.get(k, 0.0) for k in self._SUMS], dtype=torch.float64,
                            device=self.device)
        total = dict(zip(self._SUMS, all_reduce_sum(sums, self.dist).tolist(), strict=True))
        all_reduce_gradients(self.model.parameters(), self.dist)
        values: dict[str, float] = {}
        grpo = self.config.trainer.algorithm != "sft"
        if grpo:
            if total["unknown_logprob_records"]:
                values["unknown_logprob_records"] = total["unknown_logprob_records"]
            for key in self._PER_TOKEN:
                values[key] = total[key] / max(shard.num_tokens, 1)
            if self.reference is not None:
                values["kl_ref"] = total["kl_ref"]
            values["reward_mean"] = total["reward_sum"] / max(shard.num_records, 1)
        values.update(self._optimizer_step())
        values.update(loss=total["loss"], lr=self.scheduler.get_last_lr()[0],
                      tokens=float(shard.num_tokens), stale_dropped=shard.dropped_stale)
        return values

    def accuracy(self, tasks: list[Any]) -> float:
        """Greedy exact-match accuracy of the current weights on `tasks`."""
        ecfg = self.config.eval
        return exact_match_accuracy(self.engine, tasks, max_new_tokens=ecfg.max_new_tokens,
                                    batch_size=ecfg.batch_size)
