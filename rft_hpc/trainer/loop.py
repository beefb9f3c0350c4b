"""Rank 0's training loop (or the only process's): `TrainerLoop`.

Its state (step, buffer cursor, published version, last evaluation and save, the start of
the current wait for data) is its fields; its phases (read a batch, train, publish,
evaluate, save, idle) are its methods, and `run` calls them in order. What it tells the
other ranks, and when, is the protocol of `rft_hpc.trainer.role`'s module doc.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rft_hpc.buffer.compact import Compactor
from rft_hpc.buffer.reader import Batch, BufferReader
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.json_types import JSONValue
from rft_hpc.core.retry import PROCESS_COUNTERS, PROCESS_RETRY
from rft_hpc.core.rundir import RunDir
from rft_hpc.core.storage import close_all, storage_full
from rft_hpc.eval.carry import carried_scores
from rft_hpc.eval.heldout import HeldOutEvaluation
from rft_hpc.eval.pairwise import PairwiseEvaluation
from rft_hpc.ledger.log import LedgerWriter, compact_refs
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.pipeline.filters import filter_batch
from rft_hpc.runtime.common import StopFlag, read_heartbeat, write_heartbeat
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.runtime.logs import at_step, step_line
from rft_hpc.sync.memory import MemoryHandover
from rft_hpc.sync.publisher import WeightPublisher
from rft_hpc.trainer.checkpoint import TrainerState, save_trainer_state
from rft_hpc.trainer.distributed import DistContext, broadcast_object
from rft_hpc.trainer.protocols import StageTrainer

log = logging.getLogger(__name__)


def explorers_done(run: RunDir, config: ExperimentConfig, dropped: int) -> dict[str, int] | None:
    """The steps each explorer wrote (by writer name) once every explorer has written its
    last step: none is running, and none that waits to replace stale records
    (`replaces_stale_drops`) owes steps for the `dropped` records the trainer has dropped
    so far; None while not."""
    owed = config.explorer.total_steps(config.trainer, dropped)
    steps = {}
    for i in range(config.explorer.count):
        beat = read_heartbeat(run, f"explorer-{i}")
        if beat.get("status") != "done" or (
                beat.get("replacing_drops") and beat.get("step", 0) < owed):
            return None
        steps[f"explorer-{i}"] = int(beat.get("step") or 0)
    return steps


def next_batch(reader: BufferReader, n: int, version: int, *, config: ExperimentConfig,
               run: RunDir, stop: StopFlag,
               idle: Callable[[], None] | None = None) -> Batch | None:
    """Wait for `n` usable records; None when stopped or when no more data will come.

    `idle` is called before each wait for more data (rank 0 keeps the other ranks posted).
    """
    batch = Batch()
    unseen_since: float | None = None  # explorers done, their last segments not seen yet
    while len(batch) < n:
        reader.poll()
        part = reader.take(n - len(batch), policy_version=version)
        for name in ("records", "refs", "weights", "uses"):
            getattr(batch, name).extend(getattr(part, name))
        batch.dropped_stale += part.dropped_stale
        if len(batch) >= n:
            break
        done = None if config.mode == "train" else explorers_done(
            run, config, reader.counters["dropped_stale"])
        finished = config.mode == "train" or done is not None
        if done and not all(reader.reached(w, step) for w, step in done.items()):
            # their last segments may reach this node after their final heartbeats
            unseen_since = unseen_since or time.monotonic()
            finished = time.monotonic() - unseen_since > PROCESS_RETRY.policy.appear_s
            if finished:
                log.warning("the explorers' last segments did not appear within %.0f s: "
                            "ending without them", PROCESS_RETRY.policy.appear_s)
        if finished and reader.poll() == 0 and reader.pending == 0:
            return batch if len(batch) else None
        if idle is not None:
            idle()
        if stop.sleep(config.buffer.poll_interval, reader.changes):
            return None
    return batch


class Followers:
    """Rank 0's messages to the other ranks: `batch`, `wait`, `weights`, `checkpoint` or
    `stop` (no-ops alone)."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist
        self.every = min(60.0, dist.timeout / 4)
        self.last = time.monotonic()
        self.stopped = False  # told to stop already: they are gone

    def send(self, kind: str) -> None:
        """Send `kind` to the other ranks. A failed `stop` (another rank is gone already)
        is only logged: rank 0 still saves, publishes and reports."""
        if not self.dist.distributed or (kind == "stop" and self.stopped):
            return
        self.stopped = kind == "stop"
        try:
            broadcast_object(kind, self.dist)
        except RuntimeError as exc:  # c10d's errors (DistBackendError ...) are RuntimeErrors
            if kind != "stop":
                raise
            log.warning("could not tell the other trainer ranks to stop: %s", exc)
        self.last = time.monotonic()

    @contextlib.contextmanager
    def stopped_by_a_full_disk(self) -> Iterator[None]:
        """Tell the others to stop when rank 0 fails on a full disk or an exceeded quota
        (met in a write, between collectives: they wait for a message) rather than leave
        them waiting for the collective timeout; then raise the failure."""
        try:
            yield
        except BaseException as exc:
            if storage_full(exc) is not None:
                self.send("stop")
            raise

    def keepalive(self) -> None:
        """Tell the others to keep waiting, at most every `every` seconds."""
        if time.monotonic() - self.last >= self.every:
            self.send("wait")


def rank_layout(trainer: StageTrainer) -> dict[str, Any]:
    """How this trainer is spread over its ranks, as checkpoints record it."""
    return {"world_size": trainer.dist.world_size, "backend": trainer.backend.name,
            "model_parallel": trainer.backend.model_parallel}


class TrainerLoop:
    """Rank 0 (or the only process): trains `trainer` from the stage's buffer to
    `trainer.steps` or until stopped, and writes everything the role writes (weights,
    checkpoints, ledger, metrics, heartbeat, evaluation answers)."""

    def __init__(self, trainer: StageTrainer, run: RunDir, stop: StopFlag,
                 saved: TrainerState | None, config_hash: str,
                 followers: Followers | None = None,
                 handover: MemoryHandover | None = None) -> None:
        config = self.config = trainer.config
        self.trainer, self.rundir, self.stop, self.config_hash = trainer, run, stop, config_hash
        self.steps = config.trainer.steps
        self.followers = followers or Followers(trainer.dist)
        self.clock = JobClock(config.launch.slurm.walltime_margin)
        self.step = saved.step if saved else 0
        self.reader = BufferReader(run.buffer, config.buffer,
                                   state=saved.cursor if saved else None, quarantine=True)
        # The position as of `step`: records gathered for a step that never ran stay pending.
        self.cursor = self.reader.state_dict()
        self.ledger = LedgerWriter(run.ledger, "trainer", durable=False)  # synced at saves
        self.history = self.ledger.start(self.step, first_redone=self.step + 1)
        self.metrics = MetricsWriter(run.metrics, "trainer")
        self.evaluation = (PairwiseEvaluation(config, trainer.device)
                           if config.algorithm.algorithm_type == "reward_model"
                           else HeldOutEvaluation(config, trainer.device))
        self.last_eval = self.last_saved = -1 if saved is None else self.step
        # versions an evaluator scores later are published even in mode train, never pruned
        self.scored = set(config.eval.scored_versions(self.steps)) \
            if config.eval.evaluator else set()
        self.publisher = WeightPublisher(config, run, keep_also=self.scored,
                                         device=trainer.device, handover=handover)
        self.compactor = Compactor(run.buffer, config.buffer.compact,
                                   durable=config.buffer.fsync) \
            if config.buffer.compact.enabled else None
        self.version = self.publisher.files_version  # the newest the explorers were given
        self.waiting_since: float | None = None  # when the current wait for data began
        self.exhausted = False  # no more data will come
        self.weights_gathered = 0  # times the full weights were taken (sharded: gathered)
        self._weights: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, taken)
        self.started, self.start_step = time.time(), self.step
        self.beaten_drops = -1  # the stale drops the last heartbeat told the explorers of

    def run(self) -> int:
        """Train to `trainer.steps`, until the data ends or until stopped; returns the steps
        done. Raises `RequeueRequested` when stopped for a requeue or the walltime."""
        try:
            self.evaluate_start()
            self.started = time.time()  # the heartbeat's rate: training, not the step-0 eval
            log.info("starting at step %d of %d", self.step, self.steps)
            while self.step < self.steps and not self.stop:
                at_step(self.step + 1)
                t0 = time.monotonic()
                batch = self.read_batch()
                if batch is None:
                    self.exhausted = not self.stop
                    break
                self.train_step(batch, t0)
            at_step(None)
            done = self.finish()
        finally:  # each closed even when another fails (a full disk fails every flush)
            close_all((self.metrics.close, self.ledger.close, self.publisher.close))
        self.beat("done" if done else "stopped", final_version=self.step if done else None)
        if not done:
            self.stop.check_requeue()
        return self.step

    # -- the phases ------------------------------------------------------------------------

    def read_batch(self) -> Batch | None:
        """The next `trainer.batch_size` records (`next_batch`), idling while none come;
        None when stopped or when no more data will come."""
        batch = next_batch(self.reader, self.config.trainer.batch_size, self.step,
                           config=self.config, run=self.rundir, stop=self.stop, idle=self.idle)
        self.waiting_since = None
        return batch

    def train_step(self, batch: Batch, t0: float) -> None:
        """One step on `batch` (read since `t0`) and everything after it: publish,
        evaluate, ledger, metrics, save, heartbeat, log line."""
        t1 = time.monotonic()
        values = self.train(batch)
        self.step += 1
        self.cursor = self.reader.state_dict()
        published = self.publish(values)
        if self.config.eval.interval and self.step % self.config.eval.interval == 0:
            values.update(self.evaluate())
        self._weights = None  # the step's gathered weights are not kept while waiting
        self.clock.observe_step(time.monotonic() - t1)
        values.update(seconds=time.monotonic() - t0, wait_seconds=t1 - t0,
                      backlog=self.reader.pending, weights_gathered=self.weights_gathered,
                      **self.reader.io_metrics(PROCESS_COUNTERS))  # and weights, ckpt ...
        self.ledger.append("step", step=self.step, consumed=compact_refs(batch.refs),
                           published=published, dropped_stale=batch.dropped_stale,
                           seconds=round(time.monotonic() - t0, 4))
        self.metrics.log(self.step, values)
        if self.step % self.config.trainer.save_interval == 0:
            self.save()
        self.beat("running", backlog=self.reader.pending)
        log.info(step_line(self.step, self.steps, version=self.version,
                           reward=values.get("reward_mean"), seconds=values["seconds"],
                           loss=values.get("loss", "-")))
        log.debug("step %d: %s", self.step, values)
        if not self.clock.next_step_fits():
            self.stop.out_of_time()

    def train(self, batch: Batch) -> dict[str, float]:
        """The optimizer step on what the experience filters keep of `batch` (every rank
        takes part); its metrics. A batch the filters empty changes no weights."""
        kept, filtered = filter_batch(batch, self.config.pipeline.experience_filters)
        if len(kept):
            self.followers.send("batch")
            t0 = time.monotonic()
            values = self.trainer.step(kept, version=self.step)
            values["train_seconds"] = time.monotonic() - t0  # the step alone: tokens/s
        else:
            values = {"filter/skipped_step": 1.0}
        values.update(filtered)
        return values

    def publish(self, values: dict[str, float]) -> int | None:
        """Publish the step's weights when it is due: to the explorers every `sync.interval`
        steps in mode both (its metrics into `values`), as files when an evaluator scores
        this version. Returns the version published, None if none."""
        published = None
        if self.config.mode == "both" and self.step % self.config.sync.interval == 0:
            values.update(self.publisher.publish(self.full_weights(), self.step))
            published = self.step
        if self.step in self.scored:
            self.write_files()
            published = self.step
        self.version = published if published is not None else self.version
        return published

    def write_files(self) -> None:
        """Make the current step's weights the newest on the filesystem; they are taken
        (gathered) only when that version is not written yet."""
        if self.publisher.files_version == self.step:
            self.publisher.flush()
        else:
            self.publisher.write_files(self.full_weights(), self.step)

    def evaluate(self) -> dict[str, float]:
        """The held-out scores of the current weights (`HeldOutEvaluation.score`); their
        greedy answers go to `eval/answers/` under the current step."""
        self.last_eval = self.step
        return self.evaluation.score(self.full_weights(), self.step,
                                     self.rundir.heldout_answers(self.step))

    def evaluate_start(self) -> None:
        """A fresh stage's step-0 scores: carried from the stage before when it scored
        these weights the same way (`carried_scores`), else evaluated."""
        if self.step != 0 or not self.evaluation.enabled:
            return
        carried = None if self.evaluation.tasksets else carried_scores(self.config, self.rundir)
        self.metrics.log(0, carried or self.evaluate())
        self.last_eval = 0

    def save(self) -> None:
        """Checkpoint the full state as of `step` (its version and ledger entries first),
        then compact what it has consumed."""
        t0 = time.monotonic()
        self.publisher.flush()  # a checkpoint's version is on the filesystem before it is saved
        self.ledger.sync()  # and its steps in the ledger
        if self.trainer.sharded:
            self.followers.send("checkpoint")
        model, optimizer = self.trainer.checkpoint_parts()
        save_trainer_state(self.rundir.ckpt, self.step, model=model, optimizer=optimizer,
                           scheduler=self.trainer.scheduler, cursor=self.cursor,
                           extra={"last_eval": self.last_eval}, config_hash=self.config_hash,
                           keep=self.config.trainer.keep_checkpoints,
                           modules=self.trainer.checkpoint_modules(),
                           ranks=rank_layout(self.trainer))
        self.ledger.append("save", step=self.step)
        self.last_saved = self.step
        self.clock.observe_save(time.monotonic() - t0)
        if self.compactor is not None:  # only what the checkpoint just saved has consumed
            done = self.compactor.run(self.cursor)
            if done.archives:
                log.info("compacted %d consumed segments (%d records) into %d archive(s)",
                         done.segments_folded, done.records, done.archives)

    def idle(self) -> None:
        """Called before each wait for data: keep the other ranks posted, stop when the
        next step would not fit the walltime, and once the wait has lasted
        `sync.idle_publish` seconds write the current weights as files (for an explorer
        that started after the last broadcast), once per version."""
        self.followers.keepalive()
        if self.reader.counters["dropped_stale"] != self.beaten_drops:
            self.beat("running", backlog=self.reader.pending)  # explorers replace drops
        if not self.clock.next_step_fits():
            self.stop.out_of_time()
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        elif (time.monotonic() - self.waiting_since >= self.config.sync.idle_publish
              and self.step and self.publisher.files_version != self.step):
            self.write_files()
            self._weights = None

    def finish(self) -> bool:
        """After the loop: tell the others to stop, save, and when the stage is done (all
        steps, or no more data) publish and score the final weights. Returns whether it is
        done (else it was stopped)."""
        if not self.trainer.sharded:
            self.followers.send("stop")
        if self.last_saved != self.step:
            self.save()
        done = self.step >= self.steps or self.exhausted
        if self.exhausted and self.step < self.steps:
            log.warning("no more data will come after step %d of %d: the stage ends %d steps "
                        "short (the offline data is used up, see buffer.max_uses, or the "
                        "explorers ended, see explorer.steps)", self.step, self.steps,
                        self.steps - self.step)
        final: dict[str, float] = {}
        if done:
            self.write_files()
            self.version = self.step
            if self.evaluation.enabled and self.last_eval != self.step:
                final = self.evaluate()
        if final or self.weights_gathered:
            self.metrics.log(self.step, {**final, "weights_gathered": self.weights_gathered})
        self._weights = None
        if self.trainer.sharded:  # the others took part in the final save and publish
            self.followers.send("stop")
        reason = "done" if done else self.stop.reason
        self.ledger.append("stop", step=self.step, reason=reason)
        log.info("%s after step %d of %d", "finished" if done else f"stopped ({reason})",
                 self.step, self.steps)
        return done

    # -- helpers ---------------------------------------------------------------------------

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full weights as of `step` (under a sharded trainer gathered from every rank:
        a `weights` message first), taken once per step however many phases need them."""
        if self._weights is None or self._weights[0] != self.step:
            if self.trainer.sharded:
                self.followers.send("weights")
            self._weights = (self.step, self.trainer.full_state_dict())
            self.weights_gathered += 1
        return self._weights[1]

    def beat(self, status: str, **fields: JSONValue) -> None:
        """Write the trainer's heartbeat with `status` and its progress."""
        self.beaten_drops = self.reader.counters["dropped_stale"]
        write_heartbeat(self.rundir, "trainer", status=status, step=self.step, total=self.steps,
                        version=self.version, started=self.started,
                        start_step=self.start_step, restarts=self.history.restarts,
                        redone=self.history.redone, dropped_stale=self.beaten_drops, **fields)
