"""The explorer role: step by step, tasks -> rollouts -> one buffer segment, new weights in.

Explorer `i` at step `s` takes the tasks of `(s, i)` from the seeded task stream, so a
restarted explorer redoes exactly the steps that were never committed. Before step `s` it
holds weights of at least version `required_version(s)` (the sync rules), and at every step
boundary it loads the newest published weights. Single-turn rollouts are scored in reward
worker processes, each call within `explorer.reward_timeout` (`rft_hpc.tasks.reward_pool`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.config import ExperimentConfig
from rft_hpc.engines import build_engine
from rft_hpc.explorer.multiturn import SerialEngine, TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.explorer.workflow import RewardFailures, SamplingSettings, explore_tasks
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


def required_version(step: int, config: ExperimentConfig) -> int:
    """The oldest weights explorer step `step` may use.

    Trainer step k consumes explorer step k and publishes version k + 1 (every
    `sync.interval` steps), so strictly on-policy step s needs version s; an explorer may
    run `sync.offset` steps ahead; mode `explore` never waits.
    """
    if config.mode != "both":
        return 0
    need = max(0, step - config.sync.offset)
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
    set_threads(config.explorer.threads)
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
    log.info("starting at step %d of %d (weights version %s)", step, total, engine.version)

    def beat(status: str) -> None:
        write_heartbeat(run, role, status=status, step=step, total=total,
                        version=engine.version, started=started, start_step=start_step,
                        restarts=history.restarts, redone=history.redone,
                        in_flight=multi_turn.in_flight if multi_turn is not None else 0)

    try:
        while step < total and not stop:
            at_step(step + 1)
            if not follower.wait_for(required_version(step, config)):
                break
            t0 = time.monotonic()
            tasks = pipeline.tasks_for(step)
            first_group = (step * cfg.count + index) * cfg.tasks_per_step
            if multi_turn is not None:
                experiences, values = multi_turn.run_step(
                    tasks, first_group_id=first_group, step=step,
                    seed=step_seed(config.run.seed, step, index), last=step + 1 >= total)
            else:
                assert rewards is not None
                experiences, values = explore_tasks(
                    engine, tasks, settings, first_group_id=first_group, step=step,
                    seed=step_seed(config.run.seed, step, index), score=rewards.score)
                # before the write: a run stopped here redoes this step once resumed
                failures.add(len(experiences), values)
            values.update(pipeline.process(step, experiences))
            writer.write_step(step, experiences)
            seconds = time.monotonic() - t0
            values.update(version=engine.version, seconds=seconds,
                          wait_seconds=follower.waited, sync_fallbacks=follower.fallbacks)
            follower.waited = 0.0
            metrics.log(step, values)
            ledger.append("step", step=step, records=len(experiences), version=engine.version,
                          seconds=round(seconds, 4))
            clock.observe_step(seconds)
            step += 1
            beat("running")
            log.info(step_line(step, total, version=engine.version,
                               reward=values.get("reward_mean"), seconds=seconds))
            log.debug("step %d: %s", step, values)
            if not clock.next_step_fits():
                stop.out_of_time()
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
