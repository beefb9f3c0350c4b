"""The trainer role: read experiences, update the policy, publish weights, checkpoint.

Per step: take `batch_size` records from the buffer (the reader's policy and staleness
bound), compute the loss of the algorithm (GRPO or SFT), step AdamW, and every
`sync.interval` steps publish the weights as version `step`. The full state (model,
optimizer, schedule, RNG, buffer cursor) is saved every `save_interval` steps and when a
stop signal arrives, so a restarted trainer continues where the saved one stopped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
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
from rft_hpc.trainer.batching import collate
from rft_hpc.trainer.checkpoint import load_trainer_state, save_trainer_state
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
    for key in ("steps", "save_interval", "threads"):
        keep["trainer"].pop(key, None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    """Model, optimizer and loss of one stage; `step(batch)` is one policy update."""

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config
        tcfg = config.trainer
        self.tokenizer, self.model = load_policy(config.model.path, config.model.dtype)
        self.engine = HFEngine(model=self.model, tokenizer=self.tokenizer)
        load_start_weights(self.engine, config)
        self.model.train()
        self.reference = copy.deepcopy(self.model).eval() if tcfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tcfg.lr,
                                           weight_decay=tcfg.weight_decay)
        warmup = tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.pad_id = self.engine.pad_id

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; returns the step's metrics."""
        cfg = self.config.trainer
        tb = collate(batch.records, pad_id=self.pad_id)
        values: dict[str, float] = {}
        if cfg.algorithm == "sft":
            loss = sft_loss(token_logprobs(self.model, tb), tb.loss_mask)
        else:
            temperature = self.config.explorer.temperature or 1.0
            new = token_logprobs(self.model, tb, temperature)
            old = tb.old_logprobs
            if tb.has_old_logprobs is not None and not bool(tb.has_old_logprobs.all()):
                # Imported records carry no rollout log-probs: treat them as on-policy.
                known = tb.has_old_logprobs.unsqueeze(1)
                old = torch.where(known, old, new.detach())
                values["unknown_logprob_records"] = float((~tb.has_old_logprobs).sum())
            adv = grpo_advantages(tb.rewards, tb.group_ids)
            adv = adv * torch.tensor(batch.weights, dtype=adv.dtype)
            loss, parts = policy_loss(new, old, adv, tb.loss_mask,
                                      clip_low=cfg.clip_ratio, clip_high=cfg.clip_ratio)
            values.update({k: float(v) for k, v in parts.items()})
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, tb, temperature)
                kl = kl_penalty(new, ref, tb.loss_mask)
                loss = loss + cfg.kl_coef * kl
                values["kl_ref"] = float(kl)
            values["reward_mean"] = float(tb.rewards.float().mean())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            values["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                       cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        values.update(loss=float(loss), lr=self.scheduler.get_last_lr()[0],
                      tokens=float(tb.loss_mask.sum()), stale_dropped=batch.dropped_stale)
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
               run: RunDir, stop: StopFlag) -> Batch | None:
    """Wait for `n` usable records; None when stopped or when no more data will come."""
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
        if stop.sleep(config.buffer.poll_interval):
            return None
    return batch


def run_trainer(stage_dir: Path) -> int:
    """Train a stage to `trainer.steps` (or until stopped); returns the steps done."""
    config, run = load_stage(stage_dir)
    set_threads(config.trainer.threads)
    stop = StopFlag()
    tcfg = config.trainer
    trainer = Trainer(config)
    chash = config_hash(config)
    saved = load_trainer_state(run.ckpt, trainer.model, trainer.optimizer, trainer.scheduler,
                               config_hash=chash)
    step = saved.step if saved else 0
    reader = BufferReader(run.buffer, config.buffer, state=saved.cursor if saved else None,
                          quarantine=True)
    metrics = MetricsWriter(run.metrics, "trainer")
    _, eval_tasks = build_tasks(config.tasks, config.run.seed)
    last_eval = last_saved = -1 if saved is None else step
    if step == 0 and eval_tasks:
        metrics.log(0, {"eval_accuracy": trainer.accuracy(eval_tasks)})
        last_eval = 0

    def save() -> None:
        save_trainer_state(run.ckpt, step, model=trainer.model, optimizer=trainer.optimizer,
                           scheduler=trainer.scheduler, cursor=reader.state_dict(),
                           extra={"last_eval": last_eval}, config_hash=chash)

    exhausted = False
    try:
        while step < tcfg.steps and not stop:
            t0 = time.monotonic()
            batch = next_batch(reader, tcfg.batch_size, step, config=config, run=run, stop=stop)
            if batch is None:
                exhausted = not stop
                break
            wait = time.monotonic() - t0
            values = trainer.step(batch)
            step += 1
            if config.mode == "both" and step % config.sync.interval == 0:
                publish_weights(run.weights, trainer.model.state_dict(), step)
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
        if last_saved != step:
            save()
        done = step >= tcfg.steps or exhausted
        if done:
            if latest_weights_version(run.weights) != step:
                publish_weights(run.weights, trainer.model.state_dict(), step)
            if eval_tasks and last_eval != step:
                metrics.log(step, {"eval_accuracy": trainer.accuracy(eval_tasks)})
    finally:
        metrics.close()
    write_heartbeat(run, "trainer", status="done" if done else "stopped", step=step,
                    final_version=step if done else None)
    return step
