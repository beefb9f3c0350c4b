"""The policy being trained: model, optimizer, loss; `Trainer.step` is one update.

One loop for every training engine: what differs between them (how the model is held over
the ranks, its forward, the gradient reduction and clipping, the gathered states) is the
`TrainerBackend` that `build_backend` picks (`rft_hpc.trainer.backend`, docs/trainer.md).

The algorithm comes from the config (`AlgorithmPlan`): advantages, policy loss, KL in the
reward or the loss against a frozen copy of the starting policy, entropy bonus, and for PPO
a critic with its own optimizer. Every step, rank 0 computes what needs the whole batch
(advantages, critic values, loss divisors: `BatchPreparer`) and hands each rank its shard;
with one process that is the whole batch. Each rank's loss is its rows' share of the whole
batch's loss, the gradients are summed over the ranks, so any number of ranks takes the same
step.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from typing import Any

import torch

from rft_hpc.algorithms import (
    PolicyLossInputs,
    ValueHeadModel,
    compute_policy_loss,
    entropy_bonus,
    kl_loss,
    token_entropy,
    value_loss,
)
from rft_hpc.algorithms.registry import REFERENCE_LOSSES
from rft_hpc.batch.logprobs import target_logprobs
from rft_hpc.batch.shared_prompts import attention_kind, pack_shared_prompts
from rft_hpc.buffer.reader import Batch
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.sync.weight_files import load_start_weights
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.backend import build_backend
from rft_hpc.trainer.distributed import (
    DistContext,
    Shard,
    all_gather_objects,
    all_reduce_gradients,
    broadcast_parameters,
    scatter_objects,
)
from rft_hpc.trainer.lora import trainable
from rft_hpc.trainer.lr_schedule import build_scheduler
from rft_hpc.trainer.micro import drop_oversized, pack, sub_shard
from rft_hpc.trainer.prepare import (
    BatchPreparer,
    collate_for,
    expert_rows,
    old_logprobs,
    pair_layout,
)
from rft_hpc.trainer.step_metrics import LocalMetrics, merge_metrics

log = logging.getLogger(__name__)


def config_hash(config: ExperimentConfig) -> str:
    """Hash of the settings a resumed trainer must share with the saved one.

    Settings left at their defaults do not count, so a checkpoint stays resumable by an
    rft-hpc that has since gained settings (a job requeued after an upgrade).
    """
    keep = config.model_dump(mode="json", include={"model", "buffer", "trainer", "algorithm",
                                                   "tasks", "prompt"}, exclude_defaults=True)
    # how the work is split (ranks, micro-batches, recomputation) may change on a resume
    for key in ("steps", "save_interval", "keep_checkpoints", "threads",
                "micro_batch_tokens", "share_prompts", "activation_checkpointing"):
        keep.get("trainer", {}).pop(key, None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    """Model, optimizer and loss of one stage; `step(batch)` is one policy update.

    With a `DistContext` of several ranks `step` is a collective (see `step`). How the
    ranks hold the policy is `backend`'s (`trainer.backend`, `trainer.parallel`): a whole
    replica on every rank (ddp), its FSDP shard, or its megatron-core shard (`model` is then
    a `MegatronPolicy`, a GPTModel shard with an HF-style forward); either way the ranks
    start from the same weights.
    """

    def __init__(self, config: ExperimentConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext()
        self.plan = AlgorithmPlan.of(config)
        _, self.pair_rows = pair_layout(self.plan)
        """Rows a preference pair collates to (`collate_for`), for the micro-batch budget."""
        tcfg = config.trainer
        self.backend = build_backend(config, self.dist)
        self.device = self.backend.device
        self.tokenizer, hf_model = load_policy(config.model.path, config.model.dtype)
        self.backend.place(hf_model)
        self.attention = (attention_kind(hf_model) if tcfg.share_prompts
                          and self.backend.packs_prompts else None)
        """The policy's attention implementation when rows may share their prompt's pass."""
        self.hidden_size = int(getattr(hf_model.config, "hidden_size", 0))
        self.engine = HFEngine(model=hf_model, tokenizer=self.tokenizer,
                               device=str(self.device), prompt=config.prompt,
                               lora=config.model.lora)
        load_start_weights(self.engine, config)
        self.reference = self.backend.build(self.engine, self.plan.needs_reference)
        self.critic: ValueHeadModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if self.plan.critic_lr is not None:
            self.critic = ValueHeadModel(copy.deepcopy(self.model)).train()
            broadcast_parameters(self.critic, self.dist)
            self.critic_optimizer = torch.optim.AdamW(
                [p for p in self.critic.parameters() if p.requires_grad],
                lr=self.plan.critic_lr, weight_decay=tcfg.weight_decay)
        self.backend.distribute()  # after the critic's copy: it stays a whole replica
        # with a LoRA adapter only its parameters train: the frozen base gets no state
        self.optimizer = torch.optim.AdamW(trainable(self.model), lr=tcfg.lr,
                                           weight_decay=tcfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, tcfg.steps, tcfg.warmup_steps,
                                         tcfg.lr_schedule, tcfg.min_lr_ratio)
        self.pad_id = self.engine.pad_id
        rl = self.plan.is_rl
        self.temperature = (self.config.explorer.temperature or 1.0) if rl else 1.0
        self.preparer = BatchPreparer(self.plan,
                                      self.model if self.backend.rank0_forward else None,
                                      self.reference, self.critic, self.temperature,
                                      self.pad_id, self.device)

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained (this rank's shard of it when `sharded`)."""
        return self.backend.model

    @property
    def sharded(self) -> bool:
        """True when the full weights exist only when gathered from every rank: then
        `full_state_dict` and `checkpoint_parts` are collectives (`TrainerBackend.sharded`)."""
        return self.backend.sharded

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in."""
        return self.backend.compute_dtype

    def checkpoint_modules(self) -> dict[str, Any]:
        """Parts saved with a checkpoint besides the policy, optimizer and schedule."""
        if self.critic is None:
            return {}
        return {"critic": self.critic, "critic_optimizer": self.critic_optimizer}

    def step(self, batch: Batch | None, version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch`; returns the step's metrics.

        With several ranks this is a collective that every rank calls: rank 0 with the
        whole batch, the others with None. Rank 0 computes what needs the whole batch
        (advantages, critic values, loss divisors) and sends each rank its shard; each
        rank's loss is its rows' share of the whole batch's loss; the gradients are summed
        over the ranks; every rank takes the same optimizer step. The metrics, on every
        rank, are those of the whole batch. With `trainer.micro_batch_tokens`, records that
        alone exceed it are left out of the step (a warning, `skipped_sequences`).
        `version` (rank 0): the version of the weights before this step, the trainer's steps
        so far; it gives the staleness metrics and the off-policy correction's versions.
        """
        if self.dist.is_main:
            if batch is None:
                raise ValueError("rank 0 (or a single-process trainer) needs a batch")
            return self._step_shard(scatter_objects(self._shards(batch, version), self.dist))
        return self._step_shard(scatter_objects(None, self.dist))

    def _shards(self, batch: Batch, version: int | None) -> list[Shard]:
        """Rank 0: the batch, without records over the micro-batch budget, in shards."""
        budget = self.config.trainer.micro_batch_tokens
        batch, skipped = drop_oversized(batch, budget, self.pair_rows)
        if skipped:
            log.warning("skipped %d sequence(s) longer than trainer.micro_batch_tokens = %d "
                        "padded tokens", skipped, budget)
        world = self.dist.world_size
        group = self.backend.model_parallel  # ranks that share one shard (a TP group)
        if batch.records:
            shards = self.preparer.shards(batch, world // group, version)
        else:
            shards = [Shard(records=[], advantages=None, num_tokens=0, num_records=0,
                            dropped_stale=batch.dropped_stale) for _ in range(world // group)]
        if budget > 0:
            for shard in shards:
                shard.metrics["skipped_sequences"] = float(skipped)
        return [shards[rank // group] for rank in range(world)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights with HF names (what is published and checkpointed).
        When `sharded` a collective of every rank, complete on rank 0 only (empty
        elsewhere)."""
        return self.backend.full_state()

    def checkpoint_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `save_trainer_state` takes them. When `sharded` a
        collective of every rank that gathers both full states (complete on rank 0, which
        saves)."""
        return self.backend.checkpoint_parts(self.optimizer)

    def restore_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `load_trainer_state` takes them: when `sharded` views that
        load a saved full state into this rank's shards (every rank loads together)."""
        return self.backend.restore_parts(self.optimizer)

    def _loss(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor | None, LocalMetrics]:
        """This shard's share of the policy loss and of the critic's value loss (None
        without a critic), and its metrics."""
        plan = self.plan
        tb = collate_for(plan, shard.records, self.pad_id)
        width = tb.loss_mask.shape[1]
        rows = {k: v[:, :width] for k, v in shard.rows.items()}
        adv = None if shard.advantages is None else shard.advantages[:, :width]
        # planned on the host batch, before it moves: the plan reads every token
        packed = (pack_shared_prompts(tb, self.hidden_size, self.pad_id)
                  if self.attention else None)
        if self.device.type != "cpu":
            tb = tb.to(self.device)
            rows = {k: v.to(self.device) for k, v in rows.items()}
            adv = None if adv is None else adv.to(self.device)
            packed = None if packed is None else packed.to(self.device)
        mask = tb.loss_mask
        if packed is not None:
            inputs = packed.model_inputs(self.attention, self.compute_dtype)
            logits = packed.unpack(self.backend.logits(**inputs))
        else:
            inputs = {"input_ids": tb.input_ids, "attention_mask": tb.attention_mask}
            logits = self.backend.logits(**inputs)
        logp = target_logprobs(logits, tb.targets, self.temperature)
        out = LocalMetrics(tokens=float(mask.sum()), rows=float(mask.shape[0]))
        is_expert = old = ref = None
        rl_mask = mask
        if plan.is_rl:
            old = old_logprobs(tb, logp)
            if tb.has_old_logprobs is not None:
                out.add_sum("unknown_logprob_records", float((~tb.has_old_logprobs).sum()))
            if plan.type == "mix":
                is_expert = expert_rows(shard.records).to(mask.device)
                rl_mask = mask * (~is_expert).unsqueeze(1).to(mask.dtype)
                out.rl_tokens = float(rl_mask.sum())
        if self.reference is not None and (plan.kl_loss
                                           or plan.policy_loss_fn in REFERENCE_LOSSES):
            with torch.no_grad():
                ref_logits = self.reference(**inputs, use_cache=False).logits
                if packed is not None:
                    ref_logits = packed.unpack(ref_logits)
                ref = target_logprobs(ref_logits, tb.targets, self.temperature)
        weights = rows.get("correction_weights")
        if weights is not None:  # the ratio to the trainer's own log-probs of that version
            old = rows["correction_old_logp"]
        inputs = PolicyLossInputs(logp=logp, mask=mask, old_logp=old, advantages=adv,
                                  ref_logp=ref, is_expert=is_expert, norm=shard.norm,
                                  expert_norm=shard.expert_norm, weights=weights)
        loss, parts = compute_policy_loss(plan.policy_loss_fn, inputs, **plan.policy_loss_args)
        out.add_parts(parts)
        agg = plan.loss_agg_mode
        if plan.kl_loss is not None:
            assert ref is not None
            term, kl_parts = kl_loss(logp, ref, rl_mask, plan.kl_loss, plan.kl_loss_coef, agg,
                                     shard.norm)
            loss = loss + term
            out.add_sum("kl_ref", float(kl_parts["kl_loss"]))
        if plan.entropy_coef > 0:
            term, ent_parts = entropy_bonus(token_entropy(logits, self.temperature), rl_mask,
                                            plan.entropy_coef, agg, shard.norm)
            loss = loss + term
            out.add_sum("entropy", float(ent_parts["entropy"]))
        vloss = None
        if self.critic is not None:
            values = self.critic.token_values(tb)
            vloss, v_parts = value_loss(values, rows["old_values"], rows["returns"], mask,
                                        plan.cliprange_value, agg, shard.norm)
            out.add_parts(v_parts)
            out.add_sum("value_loss", float(vloss.detach()))
        out.add_sum("loss", float(loss.detach()))
        return loss, vloss, out

    def _optimizer_step(self) -> dict[str, float]:
        """Clip the gradients (when configured), step the optimizers and the schedule."""
        cfg = self.config.trainer
        values = {}
        if cfg.grad_clip > 0:
            values["grad_norm"] = self.backend.clip_gradients(cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        if self.critic is not None and self.critic_optimizer is not None:
            if cfg.grad_clip > 0:
                values["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
                    self.critic.parameters(), cfg.grad_clip))
            self.critic_optimizer.step()
        return values

    def _step_shard(self, shard: Shard) -> dict[str, float]:
        """This rank's part of a step (the whole step with one process; see `step`)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        groups = pack(shard.records, self.config.trainer.micro_batch_tokens, self.pair_rows)
        passes = len(groups)
        if self.sharded:  # every rank runs as many passes as the busiest one
            passes = self._most(passes)
        local: list[LocalMetrics] = []
        for i in range(passes):
            if i >= len(groups):
                self.backend.idle_pass(self.pad_id)
                continue
            loss, vloss, part = self._loss(sub_shard(shard, groups[i]))
            (loss if vloss is None else loss + vloss).backward()
            local.append(part)
        # a TP group's ranks computed the same rows: count its first rank's metrics only
        gathered = [m for rank, ms in enumerate(all_gather_objects(local, self.dist))
                    if rank % self.backend.model_parallel == 0 for m in ms]
        self.backend.reduce_gradients()
        if self.critic is not None:
            all_reduce_gradients(self.critic.parameters(), self.dist)
        values = dict(shard.metrics)
        values.update(merge_metrics(gathered))
        if self.config.trainer.micro_batch_tokens > 0:
            values["micro_batches"] = float(len(gathered))
        values.update(self._optimizer_step())
        values.update(loss=values.pop("loss", 0.0), lr=self.scheduler.get_last_lr()[0],
                      tokens=float(shard.num_tokens), stale_dropped=shard.dropped_stale)
        return values

    def _most(self, n: int) -> int:
        """The largest `n` over the ranks."""
        return max(all_gather_objects(n, self.dist))
