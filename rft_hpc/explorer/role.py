"""The explorer role: tasks -> rollouts -> buffer segments, step by step, new weights in.

Explorer `i` at step `s` takes the tasks of `(s, i)` from the seeded task stream, so a
restarted explorer redoes exactly the steps that were never committed. It submits step `s`
once it holds weights of at least version `required_version(s)` (the sync rules).
Single-turn steps stream (`explorer.stream`): up to `explorer.steps_in_flight` steps'
requests in flight together, new weights taken between engine steps, each step written
once its last group is scored; their rewards run in worker processes, each call within
`explorer.reward_timeout` (`rft_hpc.tasks.reward_pool`). Multi-turn steps run one at a time
(`explorer.overrollout`), taking new weights at step boundaries.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.retry import io_metrics
from rft_hpc.engines import build_engine
from rft_hpc.explorer.multiturn import SerialEngine, TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.explorer.stream import StepStream, steps_in_flight
from rft_hpc.explorer.workflow import RewardFailures, SamplingSettings
from rft_hpc.ledger.log import LedgerWriter
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.pipeline.explorer_side import ExplorerPipeline
from rft_hpc.runtime.common import StopFlag, load_stage, set_threads, write_heartbeat
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.runtime.logs import at_step, setup_logging, step_line
from rft_hpc.sync.checkpoint import load_start_weights
from rft_hpc.sync.follower import WeightFollower, build_receiver
from rft_hpc.tasks.reward_pool import RewardPool

log = logging.getLogger(__name__)

REFRESH_SECONDS = 0.05
"""How often a streaming explorer looks for new weights between engine steps."""


def required_version(step: int, config: ExperimentConfig) -> int:
    """The oldest weights explorer step `step` may use.

    Trainer step k consumes the next `trainer.batch_size` records and publishes version
    k + 1 (every `sync.interval` steps). The explorers' steps before `step` hold
    `step x records_per_step` records, which feed `v = floor(that / batch_size)` whole
    trainer steps: strictly on-policy, step `step` samples with version v (explorer step s
    with version s when one explorer step is one batch). An explorer may run `sync.offset`
    versions behind that; mode `explore` never waits.
    """
    if config.mode != "both":
        return 0
    fed = step * config.explorer.records_per_step() // config.trainer.batch_size
    need = max(0, fed - config.sync.offset)
    return need - need % config.sync.interval


def step_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of explorer `index` at `step` (the same after any restart)."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


def run_explorer(stage_dir: Path, index: int) -> int:
    """Run explorer `index` of a stage until its last step; returns the next step to do.

    Stopped by Slurm's warning signal or by its job's time limit, it commits what it wrote
    and raises `RequeueRequested`.
    """
    role = f"explorer-{index}"
    setup_logging(role)
    config, run = load_stage(stage_dir)
    set_threads(config.explorer.threads, config.explorer.cpus)  # logs how many and why
    stop = StopFlag()
    cfg = config.explorer
    writer = SegmentWriter(run.buffer, role, "rl", durable=config.buffer.fsync,
                           steps_per_segment=config.buffer.steps_per_segment,
                           background_commit=True)
    pipeline = ExplorerPipeline(config, run, index, committed_step=writer.next_step)
    rewards = (RewardPool(cfg.reward_workers, cfg.reward_timeout)  # start while the model loads
               if cfg.workflow.type == "single_turn" else None)
    failures = RewardFailures(cfg.reward_failure_limit)
    engine = build_engine(config)
    load_start_weights(engine, config)
    multi_turn = None
    if cfg.workflow.type == "multi_turn":  # tasks run in threads: one engine call at a time
        engine = SerialEngine(engine)
        multi_turn = MultiTurnExplorer(engine, cfg.workflow, TurnSettings(
            cfg.repeat, cfg.max_new_tokens, cfg.temperature), cfg.over_rollout,
            heartbeat=run.heartbeat(role))
    clock = JobClock(config.launch.slurm.walltime_margin)
    follower = WeightFollower(run, engine, stop, clock, build_receiver(config, run, index))
    settings = SamplingSettings(cfg.repeat, cfg.max_new_tokens, cfg.temperature)
    metrics = MetricsWriter(run.metrics, role)
    total = cfg.total_steps(config.trainer)
    step = writer.next_step
    ledger = LedgerWriter(run.ledger, role, durable=False)
    history = ledger.start(step, first_redone=step)
    started, start_step = time.time(), step

    def group_of(explorer_step: int) -> int:
        """The group id of the step's first task: its position in the task stream."""
        return (explorer_step * cfg.count + index) * cfg.tasks_per_step
    log.info("starting at step %d of %d (weights version %s)", step, total, engine.version)
    stream: StepStream | None = None  # single-turn: the steps in flight

    def beat(status: str) -> None:
        write_heartbeat(run, role, status=status, step=step, total=total,
                        version=engine.version, started=started, start_step=start_step,
                        restarts=history.restarts, redone=history.redone,
                        in_flight=multi_turn.in_flight if multi_turn is not None else 0,
                        steps_in_flight=len(stream) if stream is not None else 0)

    def commit(done_step: int, experiences: list, values: dict, seconds: float,
               version: int) -> None:
        """Write a finished step and account for it (metrics, ledger, heartbeat, log)."""
        nonlocal step
        values.update(pipeline.process(done_step, experiences))
        writer.write_step(done_step, experiences)
        last = max((e.info.get("last_version", e.policy_version) for e in experiences),
                   default=version)
        values.update(version=engine.version, seconds=seconds, wait_seconds=follower.waited,
                      sync_fallbacks=follower.fallbacks, **io_metrics())  # weights' reads
        follower.waited = 0.0
        metrics.log(done_step, values)
        first = min((e.policy_version for e in experiences), default=version)
        entry = {"version": first} if last == first else {"version": first,
                                                           "last_version": last}
        ledger.append("step", step=done_step, records=len(experiences), **entry,
                      seconds=round(seconds, 4))
        clock.observe_step(seconds)
        step = done_step + 1
        beat("running")
        log.info(step_line(step, total, version=engine.version,
                           reward=values.get("reward_mean"), seconds=seconds))
        log.debug("step %d: %s", step, values)
        if not clock.next_step_fits():
            stop.out_of_time()

    try:
        if multi_turn is not None:
            while step < total and not stop:
                at_step(step + 1)
                if not follower.wait_for(required_version(step, config)):
                    break
                t0 = time.monotonic()
                experiences, values = multi_turn.run_step(
                    pipeline.tasks_for(step), first_group_id=group_of(step), step=step,
                    seed=step_seed(config.run.seed, step, index), last=step + 1 >= total)
                commit(step, experiences, values, time.monotonic() - t0, engine.version)
        else:
            assert rewards is not None
            stream = StepStream(engine, settings, rewards, steps_in_flight(config),
                                config.pipeline.dynamic_sampling)
            log.info("up to %d steps in flight", stream.window)
            submitted, t_last, t_refresh = step, time.monotonic(), 0.0
            while step < total and not stop:
                at_step(step + 1)
                if time.monotonic() - t_refresh >= REFRESH_SECONDS or not len(stream):
                    follower.refresh()  # between engine steps: requests in flight go on
                    t_refresh = time.monotonic()
                while (submitted < total and stream.has_room
                       and engine.version >= required_version(submitted, config)):
                    tasks = pipeline.tasks_for(submitted)
                    first = group_of(submitted)
                    stream.submit(submitted, tasks,
                                  group_ids=range(first, first + len(tasks)),
                                  seed=step_seed(config.run.seed, submitted, index),
                                  reserve=pipeline.reserve_tasks_for(submitted))
                    submitted += 1
                    beat("running")  # its steps_in_flight: what a restart would redo
                if not len(stream):  # nothing in flight: the next step needs newer weights
                    if not follower.wait_for(required_version(submitted, config)):
                        break
                    continue
                stream.advance()
                for done in stream.completed():
                    # before the write: a run stopped here redoes this step once resumed
                    failures.add(len(done.experiences), done.metrics)
                    now = time.monotonic()
                    commit(done.step, done.experiences, done.metrics, now - t_last,
                           done.version)
                    t_last = now
                    if stop:
                        break
            if len(stream):
                log.info("%d uncommitted steps in flight dropped (redone after a restart)",
                         len(stream))
        at_step(None)
        writer.close()
        step = writer.committed_step
        reason = "done" if step >= total else stop.reason
        ledger.append("stop", step=step, reason=reason)
        log.info("%s after step %d of %d", "finished" if step >= total else f"stopped ({reason})",
                 step, total)
    except BaseException:
        follower.close()
        raise
    finally:
        if multi_turn is not None:  # carried stragglers die with the process (documented)
            multi_turn.close()
        if rewards is not None:
            rewards.close()
        metrics.close()
        ledger.close()
        pipeline.close()
    beat("done" if step >= total else "stopped")
    if step >= total:  # the trainer may be sending a version already: take it
        follower.linger(config.sync.timeout)
    follower.close()
    if step < total:
        stop.check_requeue()
    return step
