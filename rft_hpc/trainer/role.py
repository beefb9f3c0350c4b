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
each step and return when told to stop. Under FSDP (`trainer.parallel: fsdp`) the full
weights exist only when every rank gathers them, so rank 0 also asks for `weights` (before
it publishes or evaluates) and `checkpoint` (before it saves), and sends `stop` only after
its final save and publish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rft_hpc.buffer.compact import Compactor
from rft_hpc.buffer.reader import Batch, BufferReader
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir, write_jsonl
from rft_hpc.eval.carry import carried_scores
from rft_hpc.ledger.log import LedgerWriter, compact_refs
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.pipeline.filters import filter_batch
from rft_hpc.pipeline.taskset_eval import taskset_accuracy, taskset_eval_tasks
from rft_hpc.runtime.common import (
    StopFlag,
    load_stage,
    role_status,
    set_threads,
    write_heartbeat,
)
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.runtime.logs import at_step, setup_logging, step_line
from rft_hpc.sync.publisher import WeightPublisher
from rft_hpc.tasks.source import build_tasks
from rft_hpc.trainer.checkpoint import TrainerState, load_trainer_state, save_trainer_state
from rft_hpc.trainer.distributed import (
    DistContext,
    broadcast_object,
    init_distributed,
    shutdown,
)
from rft_hpc.trainer.trainer import Trainer, config_hash

log = logging.getLogger(__name__)


def _explorers_done(run: RunDir, count: int) -> bool:
    return all(role_status(run, f"explorer-{i}") == "done" for i in range(count))


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
        if stop.sleep(config.buffer.poll_interval, reader.changes):
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
        elif kind == "weights":
            trainer.full_state_dict()
        elif kind == "checkpoint":
            trainer.checkpoint_parts()


def _ranks(trainer: Trainer) -> dict[str, Any]:
    """How this trainer is spread over its ranks, as checkpoints record it."""
    return {"world_size": trainer.dist.world_size, "backend": trainer.backend.name,
            "model_parallel": trainer.backend.model_parallel}


def _restore(trainer: Trainer, run: RunDir, chash: str) -> TrainerState | None:
    """Load the latest checkpoint on every rank; the ranks must agree on its step. A
    checkpoint saved by another number of ranks is resharded as it loads (its states are
    whole); rank 0 logs the change."""
    model, optimizer = trainer.restore_parts()
    saved = load_trainer_state(run.ckpt, model, optimizer, trainer.scheduler,
                               config_hash=chash, modules=trainer.checkpoint_modules(),
                               model_parallel=trainer.backend.model_parallel)
    step = saved.step if saved else 0
    lead = broadcast_object(step, trainer.dist)
    if lead != step:
        raise RuntimeError(f"rank {trainer.dist.rank} restored step {step}, rank 0 step {lead}")
    now = _ranks(trainer)
    if saved and trainer.dist.is_main and saved.ranks and saved.ranks != now:
        was = saved.ranks
        log.info("resuming step %d saved by %d rank(s) (%s, model-parallel %d) on %d rank(s) "
                 "(%s, model-parallel %d): the whole saved states were resharded", step,
                 was.get("world_size", 0), was.get("backend", "?"), was.get("model_parallel", 1),
                 now["world_size"], now["backend"], now["model_parallel"])
    return saved


def run_trainer(stage_dir: Path) -> int:
    """Train a stage to `trainer.steps` (or until stopped); returns the steps done.

    Under a multi-rank launch (`init_distributed`) every rank calls this; rank 0 leads.
    """
    setup_logging("trainer")
    config, run = load_stage(stage_dir)
    set_threads(config.trainer.threads, config.trainer.cpus)
    stop = StopFlag()  # other ranks too: a signal must not kill them mid-step
    dist = init_distributed()
    if not dist.is_main:
        setup_logging(f"trainer-rank{dist.rank}")
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
    clock = JobClock(config.launch.slurm.walltime_margin)

    waiting_since: list[float] = []  # when the current wait for data began

    def weights() -> dict[str, Any]:
        """The full weights (under FSDP gathered from every rank)."""
        if trainer.sharded:
            followers.send("weights")
        return trainer.full_state_dict()

    def accuracy() -> dict[str, float]:
        """Held-out scores on the eval split (`eval_accuracy`, `eval_reward`, ...); each
        task's greedy answer and reward go to `eval/answers/` under the current step."""
        answers: list[dict[str, Any]] = []
        scores = trainer.evaluate(eval_tasks, weights() if trainer.sharded else None, answers)
        write_jsonl(run.heldout_answers(step), answers)
        return scores

    def set_accuracy() -> dict[str, float]:
        """Accuracy on each task set's eval split (`pipeline.tasksets`)."""
        full = weights() if trainer.sharded and set_evals else None
        return taskset_accuracy(trainer, set_evals, full)

    def idle() -> None:
        followers.keepalive()
        if not clock.next_step_fits():
            stop.out_of_time()
        if not waiting_since:
            waiting_since.append(time.monotonic())
        elif time.monotonic() - waiting_since[0] >= config.sync.idle_publish and step:
            publisher.write_files(weights(), step)

    step = saved.step if saved else 0
    reader = BufferReader(run.buffer, config.buffer, state=saved.cursor if saved else None,
                          quarantine=True)
    # The position as of `step`: records gathered for a step that never ran stay pending.
    cursor = reader.state_dict()
    ledger = LedgerWriter(run.ledger, "trainer", durable=False)  # synced before each save
    history = ledger.start(step, first_redone=step + 1)
    metrics = MetricsWriter(run.metrics, "trainer")
    _, eval_tasks = build_tasks(config.tasks, config.run.seed)
    set_evals = taskset_eval_tasks(config)
    last_eval = last_saved = -1 if saved is None else step
    if step == 0 and eval_tasks:
        carried = None if set_evals else carried_scores(config, run)
        metrics.log(0, carried or {**accuracy(), **set_accuracy()})
        last_eval = 0

    # versions an evaluator scores later are published even in mode train, and never pruned
    scored = set(config.eval.scored_versions(tcfg.steps)) if config.eval.evaluator else set()

    publisher = WeightPublisher(config, run, keep_also=scored, device=trainer.device)
    compactor = Compactor(run.buffer, config.buffer.compact, durable=config.buffer.fsync) \
        if config.buffer.compact.enabled else None

    def save() -> None:
        t0 = time.monotonic()
        publisher.flush()  # a checkpoint's version is on the filesystem before it is saved
        ledger.sync()  # and its steps in the ledger
        if trainer.sharded:
            followers.send("checkpoint")
        model, optimizer = trainer.checkpoint_parts()
        save_trainer_state(run.ckpt, step, model=model, optimizer=optimizer,
                           scheduler=trainer.scheduler, cursor=cursor,
                           extra={"last_eval": last_eval}, config_hash=chash,
                           keep=tcfg.keep_checkpoints, modules=trainer.checkpoint_modules(),
                           ranks=_ranks(trainer))
        ledger.append("save", step=step)
        clock.observe_save(time.monotonic() - t0)
        if compactor is not None:  # only what the checkpoint just saved has consumed
            done = compactor.run(cursor)
            if done.archives:
                log.info("compacted %d consumed segments (%d records) into %d archive(s)",
                         done.segments_folded, done.records, done.archives)

    version = publisher.files_version  # the newest version the explorers were given
    started, start_step = time.time(), step
    log.info("starting at step %d of %d", step, tcfg.steps)

    def beat(status: str, **fields: Any) -> None:
        write_heartbeat(run, "trainer", status=status, step=step, total=tcfg.steps,
                        version=version, started=started, start_step=start_step,
                        restarts=history.restarts, redone=history.redone, **fields)

    exhausted = False
    try:
        while step < tcfg.steps and not stop:
            at_step(step + 1)
            t0 = time.monotonic()
            batch = next_batch(reader, tcfg.batch_size, step, config=config, run=run, stop=stop,
                               idle=idle)
            if batch is None:
                exhausted = not stop
                break
            t1 = time.monotonic()
            waiting_since.clear()
            kept, filtered = filter_batch(batch, config.pipeline.experience_filters)
            if len(kept):
                followers.send("batch")
                t2 = time.monotonic()
                values = trainer.step(kept, version=step)
                values["train_seconds"] = time.monotonic() - t2  # the step alone: tokens/s
            else:  # the filters dropped every record: this step changes no weights
                values = {"filter/skipped_step": 1.0}
            values.update(filtered)
            step += 1
            cursor = reader.state_dict()
            published = None
            if config.mode == "both" and step % config.sync.interval == 0:
                values.update(publisher.publish(weights(), step))
                published = step
            if step in scored:
                publisher.write_files(weights(), step)
                published = step
            version = published if published is not None else version
            if config.eval.interval and step % config.eval.interval == 0 and eval_tasks:
                values.update(**accuracy(), **set_accuracy())
                last_eval = step
            clock.observe_step(time.monotonic() - t1)
            values.update(seconds=time.monotonic() - t0, wait_seconds=t1 - t0,
                          backlog=reader.pending, **reader.io_metrics())
            ledger.append("step", step=step, consumed=compact_refs(batch.refs),
                          published=published, dropped_stale=batch.dropped_stale,
                          seconds=round(time.monotonic() - t0, 4))
            metrics.log(step, values)
            if step % tcfg.save_interval == 0:
                save()
                last_saved = step
            beat("running", backlog=reader.pending)
            log.info(step_line(step, tcfg.steps, version=version,
                               reward=values.get("reward_mean"), seconds=values["seconds"],
                               loss=values.get("loss", "-")))
            log.debug("step %d: %s", step, values)
            if not clock.next_step_fits():
                stop.out_of_time()
        at_step(None)
        if not trainer.sharded:
            followers.send("stop")
        if last_saved != step:
            save()
        done = step >= tcfg.steps or exhausted
        if exhausted and step < tcfg.steps:
            log.warning("no more data will come after step %d of %d: the stage ends %d steps "
                        "short (the offline data is used up, see buffer.max_uses, or the "
                        "explorers ended, see explorer.steps)", step, tcfg.steps,
                        tcfg.steps - step)
        if done:
            publisher.write_files(weights(), step)
            version = step
            if eval_tasks and last_eval != step:
                metrics.log(step, {**accuracy(), **set_accuracy()})
        if trainer.sharded:  # the others took part in the final save and publish
            followers.send("stop")
        reason = "done" if done else stop.reason
        ledger.append("stop", step=step, reason=reason)
        log.info("%s after step %d of %d", "finished" if done else f"stopped ({reason})", step,
                 tcfg.steps)
    finally:
        metrics.close()
        ledger.close()
        publisher.close()
    beat("done" if done else "stopped", final_version=step if done else None)
    if not done:
        stop.check_requeue()
    return step
