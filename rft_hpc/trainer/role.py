"""The trainer role: read experiences, update the policy, publish weights, checkpoint.

Per step: take `batch_size` records from the buffer (the reader's policy and staleness
bound), compute the loss of the algorithm (GRPO or SFT), step AdamW, and every
`sync.interval` steps publish the weights as version `step`. The full state (model,
optimizer, schedule, RNG, buffer cursor) is saved every `save_interval` steps and when a
stop signal arrives, so a restarted trainer continues where the saved one stopped.

With several ranks (`rft_hpc.trainer.distributed`) rank 0 runs the loop above and tells the
other ranks, before each step, whether a batch follows (`batch`), nothing yet (`wait`, sent
while it waits for data so that no rank sits in a collective for long) or the end (`stop`:
steps done, no more data, or a stop signal). The other ranks only follow: they take part in
each step and return when told to stop.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rft_hpc.buffer.reader import Batch, BufferReader
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.eval.accuracy import exact_match_accuracy
from rft_hpc.explorer.role import load_start_weights
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.roles.common import StopFlag, load_stage, set_threads, write_heartbeat
from rft_hpc.rundir import RunDir, read_json
from rft_hpc.sync.checkpoint import latest_weights_version, publish_weights
from rft_hpc.tasks.source import build_tasks
from rft_hpc.trainer.batching import TokenBatch, collate
from rft_hpc.trainer.checkpoint import TrainerState, load_trainer_state, save_trainer_state
from rft_hpc.trainer.distributed import (
    DistContext,
    Shard,
    all_reduce_gradients,
    all_reduce_sum,
    broadcast_object,
    broadcast_parameters,
    init_distributed,
    scatter_objects,
    shard_batch,
    shutdown,
)
from rft_hpc.trainer.losses import (
    grpo_advantages,
    kl_penalty,
    policy_loss,
    sft_loss,
    token_logprobs,
)

log = logging.getLogger(__name__)


def config_hash(config: ExperimentConfig) -> str:
    """Hash of the settings a resumed trainer must share with the saved one."""
    keep = config.model_dump(mode="json", include={"model", "buffer", "trainer", "tasks"})
    for key in ("steps", "save_interval", "threads"):
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
        ecfg = self.config.eval
        return exact_match_accuracy(self.engine, tasks, max_new_tokens=ecfg.max_new_tokens,
                                    batch_size=ecfg.batch_size)


def _explorers_done(run: RunDir, count: int) -> bool:
    for i in range(count):
        path = run.state / f"explorer-{i}.json"
        if not path.exists() or read_json(path).get("status") != "done":
            return False
    return True


def next_batch(reader: BufferReader, n: int, version: int, *, config: ExperimentConfig,
               run: RunDir, stop: StopFlag,
               idle: Callable[[], None] | None = None) -> Batch | None:
    """Wait for `n` usable records; None when stopped or when no more data will come.

    `idle` is called before each wait for more data (rank 0 keeps the other ranks posted).
    """
    batch = Batch()
    while len(batch) < n:
        reader.poll()
        part = reader.take(n - len(batch), policy_version=version)
        for name in ("records", "refs", "weights", "uses"):
            getattr(batch, name).extend(getattr(part, name))
        batch.dropped_stale += part.dropped_stale
        if len(batch) >= n:
            break
        finished = config.mode == "train" or _explorers_done(run, config.explorer.count)
        if finished and reader.poll() == 0 and reader.pending == 0:
            return batch if len(batch) else None
        if idle is not None:
            idle()
        if stop.sleep(config.buffer.poll_interval):
            return None
    return batch


class _Followers:
    """Rank 0's messages to the other ranks: `batch`, `wait` or `stop` (no-ops alone)."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist
        self.every = min(60.0, dist.timeout / 4)
        self.last = time.monotonic()

    def send(self, kind: str) -> None:
        """Send `kind` to the other ranks. A failed `stop` (another rank is gone already)
        is only logged: rank 0 still saves, publishes and reports."""
        if not self.dist.distributed:
            return
        try:
            broadcast_object(kind, self.dist)
        except RuntimeError as exc:  # c10d's errors (DistBackendError ...) are RuntimeErrors
            if kind != "stop":
                raise
            log.warning("could not tell the other trainer ranks to stop: %s", exc)
        self.last = time.monotonic()

    def keepalive(self) -> None:
        """Tell the others to keep waiting, at most every `every` seconds."""
        if time.monotonic() - self.last >= self.every:
            self.send("wait")


def _follow(trainer: Trainer, step: int) -> int:
    """A rank other than 0: take part in each step until rank 0 says stop."""
    while True:
        kind = broadcast_object(None, trainer.dist)
        if kind == "stop":
            return step
        if kind == "batch":
            trainer.step(None)
            step += 1


def _restore(trainer: Trainer, run: RunDir, chash: str) -> TrainerState | None:
    """Load the latest checkpoint on every rank; the ranks must agree on its step."""
    saved = load_trainer_state(run.ckpt, trainer.model, trainer.optimizer, trainer.scheduler,
                               config_hash=chash)
    step = saved.step if saved else 0
    lead = broadcast_object(step, trainer.dist)
    if lead != step:
        raise RuntimeError(f"rank {trainer.dist.rank} restored step {step}, rank 0 step {lead}")
    return saved


def run_trainer(stage_dir: Path) -> int:
    """Train a stage to `trainer.steps` (or until stopped); returns the steps done.

    Under a multi-rank launch (`init_distributed`) every rank calls this; rank 0 leads.
    """
    config, run = load_stage(stage_dir)
    set_threads(config.trainer.threads)
    stop = StopFlag()  # other ranks too: a signal must not kill them mid-step
    dist = init_distributed()
    try:
        trainer = Trainer(config, dist)
        chash = config_hash(config)
        saved = _restore(trainer, run, chash)
        if not dist.is_main:
            return _follow(trainer, saved.step if saved else 0)
        return _lead(trainer, run, stop, saved, chash)
    finally:
        shutdown()


def _lead(trainer: Trainer, run: RunDir, stop: StopFlag, saved: TrainerState | None,
          chash: str) -> int:
    """Rank 0 (or the only process): the training loop and everything it writes."""
    config = trainer.config
    tcfg = config.trainer
    followers = _Followers(trainer.dist)
    idle = followers.keepalive if trainer.dist.distributed else None
    step = saved.step if saved else 0
    reader = BufferReader(run.buffer, config.buffer, state=saved.cursor if saved else None,
                          quarantine=True)
    metrics = MetricsWriter(run.metrics, "trainer")
    _, eval_tasks = build_tasks(config.tasks, config.run.seed)
    last_eval = last_saved = -1 if saved is None else step
    if step == 0 and eval_tasks:
        metrics.log(0, {"eval_accuracy": trainer.accuracy(eval_tasks)})
        last_eval = 0

    # versions an evaluator scores later are published even in mode train, and never pruned
    scored = set(config.eval.scored_versions(tcfg.steps)) if config.eval.evaluator else set()

    def publish() -> None:
        publish_weights(run.weights, trainer.model.state_dict(), step, keep_also=scored)

    def save() -> None:
        save_trainer_state(run.ckpt, step, model=trainer.model, optimizer=trainer.optimizer,
                           scheduler=trainer.scheduler, cursor=reader.state_dict(),
                           extra={"last_eval": last_eval}, config_hash=chash)

    exhausted = False
    try:
        while step < tcfg.steps and not stop:
            t0 = time.monotonic()
            batch = next_batch(reader, tcfg.batch_size, step, config=config, run=run, stop=stop,
                               idle=idle)
            if batch is None:
                exhausted = not stop
                break
            wait = time.monotonic() - t0
            followers.send("batch")
            values = trainer.step(batch)
            step += 1
            if (config.mode == "both" and step % config.sync.interval == 0) or step in scored:
                publish()
            if config.eval.interval and step % config.eval.interval == 0 and eval_tasks:
                values["eval_accuracy"] = trainer.accuracy(eval_tasks)
                last_eval = step
            values.update(seconds=time.monotonic() - t0, wait_seconds=wait,
                          backlog=reader.pending)
            metrics.log(step, values)
            if step % tcfg.save_interval == 0:
                save()
                last_saved = step
            write_heartbeat(run, "trainer", status="running", step=step, backlog=reader.pending)
        followers.send("stop")
        if last_saved != step:
            save()
        done = step >= tcfg.steps or exhausted
        if done:
            if latest_weights_version(run.weights) != step:
                publish()
            if eval_tasks and last_eval != step:
                metrics.log(step, {"eval_accuracy": trainer.accuracy(eval_tasks)})
    finally:
        metrics.close()
    write_heartbeat(run, "trainer", status="done" if done else "stopped", step=step,
                    final_version=step if done else None)
    return step
