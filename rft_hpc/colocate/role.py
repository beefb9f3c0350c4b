"""The colocated role: the explorer's loop and the trainer's loop in one process.

On one GPU, or a laptop, two processes must split one device's memory and hand every
version over through files. Colocated, the trainer's loop runs in the main thread and
explorer 0's in a second one, on the same devices, and each version goes to the engine in
memory (`sync.memory.MemoryHandover`): the trainer's `WeightPublisher` copies it, the
explorer's `WeightFollower` takes it at its next refresh and is woken by it. Everything
else is as in the split placement: the explorer writes its steps to the buffer and the
ledger, the trainer reads them and checkpoints, so `audit`, resume after Ctrl-C or a
requeue, every algorithm and pipeline feature work unchanged, and the same config runs split
or colocated. With `sync.offset: 0` the two loops take turns (strictly on-policy: the
explorer waits for each version, the trainer for each step's records), with an offset
they overlap. The newest version handed over is written as files at each checkpoint and at
the end, so that a restarted process starts its engine where the saved one stood, and the
trainer takes the explorer's segments as they are offered, before their files are written
(`buffer.segment_tap`; a checkpoint waits for their commits).

Their device work runs on one thread (`colocate.device`): on CPUs two threads computing at
once halve each other's speed, and on one GPU the calls take turns anyway.

The two loops share one stop flag: a signal, the walltime or either loop's failure stops
both at their next safe point. The trainer's loop raises `RequeueRequested` when the
process should run again; the explorer's failure is raised after both have stopped.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import cast

import torch

from rft_hpc.buffer import segment_tap
from rft_hpc.colocate.device import (
    ENGINE_CALLS,
    EVALUATION_CALLS,
    TRAINER_CALLS,
    DeviceThread,
    OnDevice,
)
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.explorer.role import engine_starter, explore_stage
from rft_hpc.runtime.common import StopFlag, load_stage, set_threads
from rft_hpc.runtime.logs import log_role_to, setup_logging, thread_role
from rft_hpc.sync.memory import MemoryHandover
from rft_hpc.trainer.distributed import init_distributed, shutdown
from rft_hpc.trainer.loop import TrainerLoop
from rft_hpc.trainer.protocols import StageTrainer
from rft_hpc.trainer.role import build_trainer, restore
from rft_hpc.trainer.trainer import config_hash

log = logging.getLogger(__name__)

EXPLORER = 0
"""The explorer a colocated process runs (one per process: `launch.colocate`)."""


class ExplorerThread(threading.Thread):
    """Explorer `EXPLORER`'s loop on a thread of its own, its failure kept for the main
    thread (and the shared stop flag set, so that the trainer's loop stops too)."""

    def __init__(self, config: ExperimentConfig, run: RunDir, stop: StopFlag,
                 handover: MemoryHandover, device: DeviceThread) -> None:
        super().__init__(name=f"explorer-{EXPLORER}", daemon=True)
        self.config, self.rundir, self.stop, self.handover = config, run, stop, handover
        self.device = device
        self.failure: BaseException | None = None

    def start_engine(self) -> StreamingEngine:
        """The stage's engine, built and computing on the device thread."""
        engine = self.device.call(engine_starter(self.config))
        return cast(StreamingEngine, OnDevice(engine, self.device, ENGINE_CALLS))

    def run(self) -> None:
        thread_role(self.name)
        torch.set_num_threads(1)  # its compute goes to the device thread (colocate.device)
        try:
            explore_stage(self.config, self.rundir, EXPLORER, self.stop, receiver=self.handover,
                          wake=self.handover, start_engine=self.start_engine, colocated=True)
        except BaseException as exc:
            self.failure = exc
            self.stop.request("failed")

    def raise_failure(self) -> None:
        """Raise the explorer's failure, if it failed (a user error's one message names
        the loop that failed)."""
        if isinstance(self.failure, UserError):
            raise UserError(f"{self.name}: {self.failure}") from self.failure
        if self.failure is not None:
            raise self.failure


def run_colocated(stage_dir: Path) -> int:
    """Run a stage's trainer and its explorer in this process until the stage is done or
    stopped; returns the trainer's steps done. Raises `RequeueRequested` when stopped for a
    requeue or the walltime, and the explorer's failure when it failed."""
    setup_logging("colocated")
    config, run = load_stage(stage_dir)
    for role in ("trainer", f"explorer-{EXPLORER}"):  # each loop's lines in its own log too
        log_role_to(role, run.log(role))
    device = DeviceThread(set_threads(config.trainer.threads, config.trainer.cpus))
    segment_tap.enable()  # the trainer takes the explorer's segments before their files
    torch.set_num_threads(1)  # this thread's compute goes to the device thread too
    stop = StopFlag()
    dist = init_distributed()
    handover = MemoryHandover()
    explorer = ExplorerThread(config, run, stop, handover, device)
    try:
        trainer = device.call(build_trainer, config, dist)
        chash = config_hash(config)
        saved = device.call(restore, trainer, run, chash)
        thread_role("trainer")
        explorer.start()  # its engine loads while the trainer's loop starts
        try:
            loop = TrainerLoop(cast(StageTrainer, OnDevice(trainer, device, TRAINER_CALLS)),
                               run, stop, saved, chash, handover=handover)
            loop.evaluation = OnDevice(loop.evaluation, device, EVALUATION_CALLS)
            steps = loop.run()
        except BaseException:
            stop.request("failed")
            raise
        finally:
            handover.close()  # an explorer waiting for a version wakes and sees the stop
            explorer.join()
            thread_role(None)
        explorer.raise_failure()
        return steps
    finally:
        device.close()
        shutdown()
