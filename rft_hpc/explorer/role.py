"""The explorer role: tasks -> rollouts -> buffer segments, step by step, new weights in.

Explorer `i` at step `s` takes the tasks of `(s, i)` from the seeded task stream, so a
restarted explorer redoes exactly the steps that were never committed. It submits step `s`
once it holds weights of at least version `required_version(s)` (the sync rules).
One loop (`ExplorerLoop.explore`) drives the workflow `explorer.workflow.type` names
through the `explorer.protocols.Workflow` interface (`WORKFLOWS`). Single-turn steps stream
(`explorer.step_stream`): up to `explorer.steps_in_flight` steps' requests in flight together, new
weights taken between engine steps, each step written once its last group is scored; their
reward functions run in worker processes, each call within `explorer.reward_timeout`
(`rft_hpc.tasks.reward_pool`), reward models in batched forwards and LLM judges in batched
generations in the explorer (`rft_hpc.tasks.model_reward`, `rft_hpc.tasks.judge_reward`),
both, with `reward_job.count`, in reward jobs of their own
(`rft_hpc.tasks.remote_reward`), a task's weighted terms summed by
`rft_hpc.tasks.reward_mix`. Multi-turn steps run one at a time (`explorer.overrollout`),
taking new weights at step boundaries.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.json_types import JSONValue
from rft_hpc.core.retry import io_metrics
from rft_hpc.core.rundir import RunDir
from rft_hpc.core.storage import close_all
from rft_hpc.core.watch import Waitable
from rft_hpc.engines import build_engine
from rft_hpc.engines.judge import judge_loaders
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.teacher import HFTeacher
from rft_hpc.explorer.multiturn import TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.explorer.protocols import CompletedStep, StepTasks, Workflow
from rft_hpc.explorer.step_stream import StepStream, steps_in_flight
from rft_hpc.explorer.workflow import RewardFailures, SamplingSettings
from rft_hpc.ledger.log import LedgerWriter
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.pipeline.explorer_side import ExplorerPipeline
from rft_hpc.runtime.common import (
    FRESH_BEAT_SECONDS,
    StopFlag,
    load_stage,
    read_heartbeat,
    set_threads,
    write_heartbeat,
)
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.runtime.logs import at_step, setup_logging, step_line
from rft_hpc.runtime.placement import reward_worker_bounds
from rft_hpc.sync.follower import WeightFollower, build_receiver
from rft_hpc.sync.protocols import VersionSource
from rft_hpc.sync.weight_files import load_start_weights
from rft_hpc.tasks.model_reward import engine_device
from rft_hpc.tasks.remote_reward import RemoteModelScorer
from rft_hpc.tasks.reward_mix import RewardMix, local_scorers
from rft_hpc.tasks.reward_pool import RewardPool

log = logging.getLogger(__name__)

REFRESH_SECONDS = 0.05
"""How often a streaming explorer looks for new weights between engine steps."""
BEAT_SECONDS = 10.0
"""The longest an explorer goes without replacing its heartbeat while it runs: one that
waits (for rewards from a reward job that is down, say) still shows it is alive."""
REPLACEMENT_POLL_SECONDS = 0.5
"""How often an explorer whose steps are written reads the trainer's heartbeat for stale
drops to replace."""


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


EngineStarter = Callable[[], StreamingEngine]
"""Builds the explorer's engine with the start weights loaded (slow: a model to load)."""

WorkflowBuilder = Callable[[ExperimentConfig, RunDir, str, EngineStarter], Workflow]
"""Builds a workflow for (config, run, role name, engine starter)."""


def single_turn_workflow(config: ExperimentConfig, run: RunDir, role: str,
                         start_engine: EngineStarter) -> Workflow:
    """Streaming single-turn steps (`StepStream`) scored by a `RewardMix`: reward functions
    in a `RewardPool`, reward models and LLM judges (loaded on first use) on the engine's
    device, or both in the explorer's reward job when `reward_job.count` is set
    (docs/reward-job.md)."""
    cfg = config.explorer
    workers, cores = reward_worker_bounds(cfg.reward_workers)
    pool = RewardPool(workers, cfg.reward_timeout, cores=cores)
    scorers = local_scorers(engine_device(), judge_loaders=judge_loaders())
    count = config.reward_job.count
    if count:  # one scorer for both kinds: its requests are this explorer's alone
        remote = RemoteModelScorer(run.root, int(role.rsplit("-", 1)[1]), count)
        scorers.update(model=remote, judge=remote)
    rewards = RewardMix(pool, scorers)
    failures = RewardFailures(cfg.reward_failure_limit)
    try:
        engine = start_engine()
        teacher = None
        if config.algorithm.teacher_model is not None:  # on-policy distillation
            teacher = HFTeacher(config.algorithm.teacher_model,
                                vocab=engine.tokenizer.get_vocab(), device=engine_device(),
                                dtype=config.model.dtype, temperature=cfg.temperature)
    except BaseException:
        # its workers ignore stop signals (they outlive Slurm's warning): left running, they
        # would hold the process at exit, where multiprocessing joins its children
        rewards.close()
        raise
    stream = StepStream(engine, SamplingSettings(cfg.repeat, cfg.max_new_tokens,
                                                 cfg.temperature),
                        rewards, steps_in_flight(config), config.pipeline.dynamic_sampling,
                        failures, greedy_baseline=config.algorithm.uses_greedy_baseline(),
                        teacher=teacher)
    log.info("up to %d steps in flight; up to %d reward workers, %d computing at once",
             stream.window, workers, cores)
    return stream


def multi_turn_workflow(config: ExperimentConfig, run: RunDir, role: str,
                        start_engine: EngineStarter) -> Workflow:
    """Multi-turn steps against environments, `steps_in_flight` at once, closed by
    over-rollout; it reports the stragglers a previous process of `role` lost (its
    heartbeat)."""
    cfg = config.explorer
    workflow = MultiTurnExplorer(start_engine(), cfg.workflow, TurnSettings(
        cfg.repeat, cfg.max_new_tokens, cfg.temperature), cfg.over_rollout,
        heartbeat=run.heartbeat(role), window=steps_in_flight(config))
    log.info("up to %d steps in flight", workflow.window)
    return workflow


WORKFLOWS: dict[str, WorkflowBuilder] = {"single_turn": single_turn_workflow,
                                         "multi_turn": multi_turn_workflow}
"""The workflow builder of each `explorer.workflow.type`."""


class ExplorerLoop:
    """Explorer `index`'s steps over one workflow: submit each step once the engine holds
    weights new enough for it, advance the workflow, write the steps it hands back in
    order (buffer, metrics, ledger, heartbeat, log), until the last step or a stop."""

    def __init__(self, config: ExperimentConfig, run: RunDir, index: int, *,
                 workflow: Workflow, writer: SegmentWriter, pipeline: ExplorerPipeline,
                 follower: WeightFollower, clock: JobClock, stop: StopFlag,
                 colocated: bool = False) -> None:
        self.config, self.run, self.index = config, run, index
        self.role = f"explorer-{index}"
        self.workflow, self.writer, self.pipeline = workflow, writer, pipeline
        self.follower, self.clock, self.stop = follower, clock, stop
        self.engine = workflow.engine
        self.metrics = MetricsWriter(run.metrics, self.role)
        self.total = self.quota = config.explorer.total_steps(config.trainer)
        """`total`: the steps to write, the quota raised by replacements for stale drops."""
        self.step = writer.next_step
        """The next step to write (every earlier one is written)."""
        self.ledger = LedgerWriter(run.ledger, self.role, durable=False)
        self.history = self.ledger.start(self.step, first_redone=self.step)
        self.started, self.start_step = time.time(), self.step
        self.beaten = 0.0
        """When the heartbeat was last replaced (monotonic)."""
        self.submit_beat_gap = FRESH_BEAT_SECONDS if colocated else 0.0
        """Colocated, taking turns with the trainer, the beat after a submit is on the
        loop's critical path: it is skipped within this many seconds of the last."""

    def step_tasks(self, step: int) -> StepTasks:
        """Step `step`'s tasks and sampling: the same after any restart."""
        cfg = self.config.explorer
        tasks = self.pipeline.tasks_for(step)
        first = (step * cfg.count + self.index) * cfg.tasks_per_step  # stream position
        return StepTasks(step, tasks, range(first, first + len(tasks)),
                         step_seed(self.config.run.seed, step, self.index),
                         self.pipeline.reserve_tasks_for(step), last=step + 1 >= self.total)

    def explore(self) -> None:
        """Run steps until the last one is written or the role is stopped; steps still in
        flight then are dropped (a restart redoes them)."""
        workflow, follower = self.workflow, self.follower
        submitted, refreshed = self.step, 0.0
        while self.step < self.total and not self.stop:
            at_step(self.step + 1)
            if time.monotonic() - refreshed >= REFRESH_SECONDS or not len(workflow):
                follower.refresh()  # between engine steps: requests in flight go on
                refreshed = time.monotonic()
            while (submitted < self.total and workflow.has_room
                   and self.engine.version >= self.required_version(submitted)):
                workflow.submit(self.step_tasks(submitted))
                submitted += 1
                if time.monotonic() - self.beaten >= self.submit_beat_gap:
                    self.beat("running")  # its steps_in_flight: what a restart would redo
            if not len(workflow):  # nothing in flight: the next step needs newer weights
                if not follower.wait_for(self.required_version(submitted)):
                    break
                continue
            workflow.advance()
            if time.monotonic() - self.beaten >= BEAT_SECONDS:
                self.beat("running")
            for done in workflow.completed():
                self.commit(done)
                if self.stop:
                    break
        if len(workflow):
            log.info("%d uncommitted steps in flight dropped (redone after a restart)",
                     len(workflow))

    def required_version(self, step: int) -> int:
        """The oldest weights `step` may use (`required_version`); a step that replaces
        stale records (past the quota) needs no newer weights than the quota's last step, so
        that it never waits for a version that only its own records would let the trainer
        reach."""
        return required_version(min(step, self.quota - 1), self.config)

    def await_replacements(self) -> bool:
        """With its steps written, while the trainer may still drop stale records
        (`ExperimentConfig.replaces_stale_drops`): wait, heartbeat `done` with
        `replacing_drops`, until the trainer is done (False) or has dropped enough records
        for more steps (True, `total` raised). False at once when drops are not replaced."""
        if not self.config.replaces_stale_drops():
            return False
        self.writer.flush()
        self.writer.wait()  # "done" tells the trainer that every step written is visible
        self.beat("done", replacing_drops=True)
        while not self.stop:
            trainer = read_heartbeat(self.run, "trainer")
            if trainer.get("status") == "done":
                return False
            total = self.config.explorer.total_steps(self.config.trainer,
                                                     int(trainer.get("dropped_stale") or 0))
            if total > self.total:
                log.info("the trainer dropped %s stale records: %d more steps to replace them",
                         trainer["dropped_stale"], total - self.total)
                self.total = total
                return True
            if not self.clock.next_step_fits():
                self.stop.out_of_time()
            self.stop.sleep(REPLACEMENT_POLL_SECONDS)
        return False

    def commit(self, done: CompletedStep) -> None:
        """Write a finished step and account for it (metrics, ledger, heartbeat, log)."""
        experiences, values = done.experiences, done.metrics
        values.update(self.pipeline.process(done.step, experiences))
        last = max((e.info.get("last_version", e.policy_version) for e in experiences),
                   default=done.version)
        first = min((e.policy_version for e in experiences), default=done.version)
        entry = {"version": first} if last == first else {"version": first,
                                                           "last_version": last}
        # in the ledger before the writer has it: a step whose segment is never committed
        # (a failure, a full disk) is redone and its event void, while a committed segment
        # that the ledger lacks (the commit runs on; the append failed) would break the audit
        self.ledger.append("step", step=done.step, records=len(experiences), **entry,
                           seconds=round(done.seconds, 4))
        self.writer.write_step(done.step, experiences)
        values.update(version=self.engine.version, seconds=done.seconds,
                      wait_seconds=self.follower.waited, sync_fallbacks=self.follower.fallbacks,
                      **io_metrics())  # this process's retried reads (weights)
        self.follower.waited = 0.0
        self.metrics.log(done.step, values)
        self.clock.observe_step(done.seconds)
        self.step = done.step + 1
        self.beat("running")
        log.info(step_line(self.step, self.total, version=self.engine.version,
                           reward=values.get("reward_mean"), seconds=done.seconds))
        log.debug("step %d: %s", self.step, values)
        if not self.clock.next_step_fits():
            self.stop.out_of_time()

    def finish(self) -> None:
        """Commit what the writer holds and record why the loop ended (ledger, log)."""
        at_step(None)
        self.writer.close()
        self.step = self.writer.committed_step
        done = self.step >= self.total
        reason = "done" if done else self.stop.reason
        self.ledger.append("stop", step=self.step, reason=reason)
        log.info("%s after step %d of %d", "finished" if done else f"stopped ({reason})",
                 self.step, self.total)

    def beat(self, status: str, **fields: JSONValue) -> None:
        """Replace the heartbeat: step, weights, restarts, and what is in flight."""
        self.beaten = time.monotonic()
        write_heartbeat(self.run, self.role, status=status, step=self.step, total=self.total,
                        version=self.engine.version, started=self.started,
                        start_step=self.start_step, restarts=self.history.restarts,
                        redone=self.history.redone, in_flight=self.workflow.in_flight,
                        steps_in_flight=len(self.workflow), **fields)

    def close(self) -> None:
        """Close the metrics and the ledger."""
        close_all((self.metrics.close, self.ledger.close))


def engine_starter(config: ExperimentConfig) -> EngineStarter:
    """Builds the stage's engine with its start weights loaded."""
    def start() -> StreamingEngine:
        engine = build_engine(config)
        load_start_weights(engine, config)
        return engine
    return start


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
    step, done = explore_stage(config, run, index, stop,
                               receiver=build_receiver(config, run, index))
    if not done:
        stop.check_requeue()
    return step


def explore_stage(config: ExperimentConfig, run: RunDir, index: int, stop: StopFlag, *,
                  receiver: VersionSource | None, wake: Waitable | None = None,
                  start_engine: EngineStarter | None = None,
                  colocated: bool = False) -> tuple[int, bool]:
    """Explorer `index`'s work on a stage (the role's body, in its process or in a
    colocated one): build its parts, run its steps until the last or `stop`, commit, close;
    returns the next step to do and whether every step is written. Versions come from
    `receiver` (None: files alone), and a wait for one is woken by `wake` (None: the
    weights folder's changes); `start_engine` builds the engine (None: `build_engine` with
    the stage's start weights). `colocated`: in the trainer's process, every version after
    the first comes from `receiver` (the files are read once, at the start)."""
    role = f"explorer-{index}"
    # everything started is closed however the role ends (a full disk can fail any part's
    # start): reward workers left running would hold the process at its exit
    with contextlib.ExitStack() as parts:
        writer = SegmentWriter(run.buffer, role, "rl", durable=config.buffer.fsync,
                               steps_per_segment=config.buffer.steps_per_segment,
                               background_commit=True)
        pipeline = ExplorerPipeline(config, run, index, committed_step=writer.next_step)
        parts.callback(pipeline.close)
        workflow = WORKFLOWS[config.explorer.workflow.type](
            config, run, role, start_engine or engine_starter(config))
        parts.callback(workflow.close)  # multi-turn: carried stragglers die (documented)
        clock = JobClock(config.launch.slurm.walltime_margin)
        follower = WeightFollower(run, workflow.engine, stop, clock, receiver, wake,
                                  files_once=colocated)
        try:
            loop = ExplorerLoop(config, run, index, workflow=workflow, writer=writer,
                                pipeline=pipeline, follower=follower, clock=clock, stop=stop,
                                colocated=colocated)
            parts.callback(loop.close)
            log.info("starting at step %d of %d (weights version %s)", loop.step, loop.total,
                     loop.engine.version)
            loop.explore()
            while loop.step >= loop.total and loop.await_replacements():
                loop.explore()
            loop.finish()
        except BaseException:
            follower.close()
            raise
    done = loop.step >= loop.total
    loop.beat("done" if done else "stopped")
    if done:  # the trainer may be sending a version already: take it
        follower.linger(config.sync.timeout)
    follower.close()
    return loop.step, done
