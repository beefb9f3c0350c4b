"""The policy being trained: model, optimizer, loss; `Trainer.step` is one update.

The algorithm comes from the config (`AlgorithmPlan`): advantages, policy loss, KL in the
reward or the loss against a frozen copy of the starting policy, entropy bonus, and for PPO
a critic with its own optimizer. Every step, rank 0 computes what needs the whole batch
(advantages, critic values, loss divisors: `BatchPreparer`) and hands each rank its shard;
with one process that is the whole batch. Each rank's loss is its rows' share of the whole
batch's loss, the gradients are summed over the ranks, so any number of ranks takes the same
step.
"""

from __future__ import annotations

import contextlib
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
from rft_hpc.batch.logprobs import target_logprobs
from rft_hpc.buffer.reader import Batch
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.eval.accuracy import exact_match_accuracy
from rft_hpc.sync.checkpoint import load_start_weights
from rft_hpc.trainer import megatron_backend
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.distributed import (
    DistContext,
    Shard,
    all_gather_objects,
    all_reduce_gradients,
    broadcast_parameters,
    scatter_objects,
)
from rft_hpc.trainer.fsdp import (
    FullState,
    full_model_state,
    full_optimizer_state,
    idle_pass,
    shard_model,
)
from rft_hpc.trainer.micro import drop_oversized, pack, sub_shard
from rft_hpc.trainer.prepare import BatchPreparer, collate_for, expert_rows, old_logprobs
from rft_hpc.trainer.step_metrics import LocalMetrics, merge_metrics

log = logging.getLogger(__name__)


def config_hash(config: ExperimentConfig) -> str:
    """Hash of the settings a resumed trainer must share with the saved one.

    Settings left at their defaults do not count, so a checkpoint stays resumable by an
    rft-hpc that has since gained settings (a job requeued after an upgrade).
    """
    keep = config.model_dump(mode="json", include={"model", "buffer", "trainer", "algorithm",
                                                   "tasks"}, exclude_defaults=True)
    # how the work is split (ranks, micro-batches, recomputation) may change on a resume
    for key in ("steps", "save_interval", "keep_checkpoints", "threads",
                "micro_batch_tokens", "activation_checkpointing"):
        keep.get("trainer", {}).pop(key, None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    """Model, optimizer and loss of one stage; `step(batch)` is one policy update.

    With a `DistContext` of several ranks `step` is a collective (see `step`): every
    rank holds a full replica on its device (`trainer.parallel: ddp`) or its shard of the
    model (`fsdp`); either way the ranks start from rank 0's weights. With
    `trainer.backend: megatron` `model` is this rank's `MegatronPolicy` (a GPTModel shard
    with an HF-style forward, `rft_hpc.trainer.megatron_backend`).
    """

    def __init__(self, config: ExperimentConfig, dist: DistContext | None = None) -> None:
        self.config = config
        self.dist = dist if dist is not None else DistContext()
        self.plan = AlgorithmPlan.of(config)
        tcfg = config.trainer
        self.megatron = tcfg.backend == "megatron"
        self.device = (megatron_backend.setup_model_parallel(config, self.dist)
                       if self.megatron else self.dist.device)
        self.tokenizer, self.model = load_policy(config.model.path, config.model.dtype)
        # megatron: only rank 0 keeps a whole HF replica on the device (for evaluation)
        if self.device.type != "cpu" and (self.dist.is_main or not self.megatron):
            self.model.to(self.device)
        self.engine = HFEngine(model=self.model, tokenizer=self.tokenizer,
                               device=str(self.device))
        load_start_weights(self.engine, config)
        self._eval_engine: HFEngine | None = None  # sharded: rank 0's whole replica for eval
        hf_model = self.model
        if not self.megatron:  # megatron: every rank converts the same files into its shard
            broadcast_parameters(hf_model, self.dist)
        if self.megatron:  # the HF model stays as rank 0's evaluation replica
            self.model = megatron_backend.build(hf_model, config, self.device)
            self._eval_engine = self.engine if self.dist.is_main else None
        self.model.train()
        if tcfg.activation_checkpointing and not self.megatron:  # megatron: in its config
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compute_dtype = (getattr(torch, config.model.dtype) if self.megatron
                              else compute_dtype(tcfg.dtype, self.device))
        self.reference = None
        if self.plan.needs_reference:
            self.reference = (megatron_backend.build(hf_model, config, self.device, frozen=True)
                              if self.megatron else _frozen(self.model))
        if self.megatron and not self.dist.is_main:
            self.engine.model = None  # its shard is all a rank trains; rank 0 alone evaluates
        self.critic: ValueHeadModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if self.plan.critic_lr is not None:
            self.critic = ValueHeadModel(copy.deepcopy(self.model)).train()
            broadcast_parameters(self.critic, self.dist)
            self.critic_optimizer = torch.optim.AdamW(
                [p for p in self.critic.parameters() if p.requires_grad],
                lr=self.plan.critic_lr, weight_decay=tcfg.weight_decay)
        # FSDP after the reference and critic copies: they stay whole replicas
        self.fsdp = tcfg.parallel == "fsdp" and self.dist.distributed and not self.megatron
        self.sharded = self.fsdp or self.megatron  # full weights only when gathered
        if self.fsdp:
            shard_model(self.model, self.dist,
                        None if self.compute_dtype == torch.float32 else self.compute_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tcfg.lr,
                                           weight_decay=tcfg.weight_decay)
        warmup = tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.pad_id = self.engine.pad_id
        rl = self.plan.is_rl
        self.temperature = (self.config.explorer.temperature or 1.0) if rl else 1.0
        # sharded over ranks, rank 0 cannot run the policy alone (a forward is a collective)
        alone = not (self.sharded and self.dist.distributed) or (
            self.megatron and tcfg.megatron.tensor_parallel == 1)
        self.preparer = BatchPreparer(self.plan, self.model if alone else None,
                                      self.reference, self.critic, self.temperature,
                                      self.pad_id, self.device)

    def checkpoint_modules(self) -> dict[str, Any]:
        """Parts saved with a checkpoint besides the policy, optimizer and schedule."""
        if self.critic is None:
            return {}
        return {"critic": self.critic, "critic_optimizer": self.critic_optimizer}

    def step(self, batch: Batch | None) -> dict[str, float]:
        """One optimizer step on `batch`; returns the step's metrics.

        With several ranks this is a collective that every rank calls: rank 0 with the
        whole batch, the others with None. Rank 0 computes what needs the whole batch
        (advantages, critic values, loss divisors) and sends each rank its shard; each
        rank's loss is its rows' share of the whole batch's loss; the gradients are summed
        over the ranks; every rank takes the same optimizer step. The metrics, on every
        rank, are those of the whole batch. With `trainer.micro_batch_tokens`, records that
        alone exceed it are left out of the step (a warning, `skipped_sequences`).
        """
        if self.dist.is_main:
            if batch is None:
                raise ValueError("rank 0 (or a single-process trainer) needs a batch")
            return self._step_shard(scatter_objects(self._shards(batch), self.dist))
        return self._step_shard(scatter_objects(None, self.dist))

    def _shards(self, batch: Batch) -> list[Shard]:
        """Rank 0: the batch, without records over the micro-batch budget, in shards."""
        budget = self.config.trainer.micro_batch_tokens
        batch, skipped = drop_oversized(batch, budget)
        if skipped:
            log.warning("skipped %d sequence(s) longer than trainer.micro_batch_tokens = %d "
                        "padded tokens", skipped, budget)
        world = self.dist.world_size
        group = self._model_parallel  # ranks that share one shard (a TP group)
        if batch.records:
            shards = self.preparer.shards(batch, world // group)
        else:
            shards = [Shard(records=[], advantages=None, num_tokens=0, num_records=0,
                            dropped_stale=batch.dropped_stale) for _ in range(world // group)]
        if budget > 0:
            for shard in shards:
                shard.metrics["skipped_sequences"] = float(skipped)
        return [shards[rank // group] for rank in range(world)]

    @property
    def _model_parallel(self) -> int:
        """Consecutive ranks that hold one model between them and train on the same rows
        (megatron's TP group; 1 for the torch backend)."""
        return self.config.trainer.megatron.tensor_parallel if self.megatron else 1

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (what is published and checkpointed). Under FSDP a
        collective of every rank, complete on rank 0 only (empty elsewhere); so is the
        megatron backend's gather of its shards (HF names, as the torch backend's)."""
        if self.megatron:
            return self.model.hf_state()
        if self.sharded:
            return full_model_state(self.model)
        return self.model.state_dict()

    def checkpoint_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `save_trainer_state` takes them. Under FSDP a collective
        of every rank that gathers both full states (complete on rank 0, which saves)."""
        if not self.sharded:
            return self.model, self.optimizer
        if self.megatron:
            return megatron_backend.checkpoint_parts(self.model, self.optimizer)
        return (FullState(self.model, None, full_model_state(self.model)),
                FullState(self.model, self.optimizer,
                          full_optimizer_state(self.model, self.optimizer)))

    def restore_parts(self) -> tuple[Any, Any]:
        """(model, optimizer) as `load_trainer_state` takes them: under FSDP views that
        load a saved full state into this rank's shards (every rank loads together)."""
        if not self.sharded:
            return self.model, self.optimizer
        if self.megatron:
            return (megatron_backend.MegatronState(self.model, None),
                    megatron_backend.MegatronState(self.model, self.optimizer))
        return FullState(self.model, None), FullState(self.model, self.optimizer)

    def _loss(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor | None, LocalMetrics]:
        """This shard's share of the policy loss and of the critic's value loss (None
        without a critic), and its metrics."""
        plan = self.plan
        tb = collate_for(plan, shard.records, self.pad_id)
        width = tb.loss_mask.shape[1]
        rows = {k: v[:, :width] for k, v in shard.rows.items()}
        adv = None if shard.advantages is None else shard.advantages[:, :width]
        if self.device.type != "cpu":
            tb = tb.to(self.device)
            rows = {k: v.to(self.device) for k, v in rows.items()}
            adv = None if adv is None else adv.to(self.device)
        mask = tb.loss_mask
        with self._autocast():
            logits = self.model(input_ids=tb.input_ids, attention_mask=tb.attention_mask,
                                use_cache=False).logits.float()
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
        if self.reference is not None and (plan.kl_loss or plan.policy_loss_fn == "dpo"):
            with torch.no_grad():
                ref = target_logprobs(self.reference(
                    input_ids=tb.input_ids, attention_mask=tb.attention_mask,
                    use_cache=False).logits, tb.targets, self.temperature)
        inputs = PolicyLossInputs(logp=logp, mask=mask, old_logp=old, advantages=adv,
                                  ref_logp=ref, is_expert=is_expert, norm=shard.norm,
                                  expert_norm=shard.expert_norm)
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
        if cfg.grad_clip > 0 and self.megatron:  # over the full model, not this shard
            values["grad_norm"] = megatron_backend.clip_grad_norm(self.model, cfg.grad_clip)
        elif cfg.grad_clip > 0:
            values["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                       cfg.grad_clip))
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
        groups = pack(shard.records, self.config.trainer.micro_batch_tokens)
        passes = len(groups)
        if self.sharded:  # every rank runs as many passes as the busiest one
            passes = self._most(passes)
        local: list[LocalMetrics] = []
        for i in range(passes):
            if i >= len(groups):
                idle_pass(self.model, self.device, self.pad_id)
                continue
            loss, vloss, part = self._loss(sub_shard(shard, groups[i]))
            (loss if vloss is None else loss + vloss).backward()
            local.append(part)
        # a TP group's ranks computed the same rows: count its first rank's metrics only
        gathered = [m for rank, ms in enumerate(all_gather_objects(local, self.dist))
                    if rank % self._model_parallel == 0 for m in ms]
        if self.megatron:
            megatron_backend.reduce_gradients(self.model, self.dist)
        elif not self.sharded:
            all_reduce_gradients(self.model.parameters(), self.dist)
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype when it is not float32 and FSDP does not already
        gather the weights in it (megatron computes in its weights' dtype)."""
        if self.compute_dtype == torch.float32 or self.fsdp or self.megatron:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def accuracy(self, tasks: list[Any], weights: dict[str, torch.Tensor] | None = None,
                 ) -> float:
        """Greedy exact-match accuracy of the current weights on `tasks`. Under FSDP pass
        the gathered `weights` (`full_state_dict`, on rank 0): they are scored on a whole
        replica that rank 0 keeps for evaluation."""
        ecfg = self.config.eval
        engine = self.engine
        if self.sharded:
            if weights is None:
                raise ValueError("a sharded trainer scores gathered weights: pass weights")
            if self._eval_engine is None:
                tokenizer, model = load_policy(self.config.model.path, self.config.model.dtype)
                self._eval_engine = HFEngine(model=model.to(self.device).eval(),
                                             tokenizer=tokenizer, device=str(self.device))
            self._eval_engine.model.load_state_dict(weights)
            engine = self._eval_engine
        return exact_match_accuracy(engine, tasks, max_new_tokens=ecfg.max_new_tokens,
                                    batch_size=ecfg.batch_size)


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype `trainer.dtype` means on `device` (auto: bfloat16 on GPUs, else float32)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (the reference policy of KL terms and DPO)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
