"""The explorer's side of weight sync: keep the engine on the trainer's newest weights.

With `checkpoint`, the newest version on the filesystem. With `nccl` or `mpi`, versions
arrive over the fabric on a background thread and are swapped in at a step boundary; files
fill in what the fabric missed (a failed sync's fallback, or the weights published while
this explorer was not yet listening). Colocated, versions come from the trainer in the same
process (`sync.memory.MemoryHandover`), which also wakes a follower that waits for one.
"""

from __future__ import annotations

import logging
import time

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.core.watch import FolderWatch, Waitable
from rft_hpc.runtime.common import StopFlag, role_status
from rft_hpc.runtime.lifecycle import JobClock
from rft_hpc.sync.protocols import VersionSource, WeightSink
from rft_hpc.sync.publisher import fabric_backend, sync_folder
from rft_hpc.sync.storage import ReadBuffer
from rft_hpc.sync.weight_files import (
    WeightsGone,
    WeightsUnavailable,
    latest_weights_version,
    load_weights,
)

log = logging.getLogger(__name__)


def build_receiver(config: ExperimentConfig, run: RunDir, index: int) -> VersionSource | None:
    """A background receiver for explorer `index` (None with the checkpoint method)."""
    sync = config.sync
    if sync.method == "checkpoint":
        return None
    from rft_hpc.sync.fabric import BackgroundReceiver

    folder = sync_folder(run, sync.method)
    if sync.method == "nccl":
        from rft_hpc.sync.collective import CollectiveReceiver

        return BackgroundReceiver(CollectiveReceiver(folder, index, backend=fabric_backend(),
                                                     timeout=sync.timeout))
    from rft_hpc.sync.mpi_port import MpiPortReceiver

    return BackgroundReceiver(MpiPortReceiver(folder, index, timeout=sync.timeout))


class WeightFollower:
    """Keeps an engine on the newest weights the trainer published."""

    def __init__(self, run: RunDir, engine: WeightSink, stop: StopFlag,
                 clock: JobClock | None = None, receiver: VersionSource | None = None,
                 wake: Waitable | None = None, files_once: bool = False) -> None:
        self.run, self.engine, self.stop, self.clock = run, engine, stop, clock
        self.receiver = receiver
        self.read_buffer = ReadBuffer()  # the engine copies weights in: reuse it every load
        self.held: tuple[int, dict] | None = None
        """The version last loaded from files and its tensors (in `read_buffer`): the base
        that a delta version is applied to."""
        self.waited = 0.0
        self.fallbacks = 0
        self.published = FolderWatch(run.weights)  # woken when LATEST is replaced
        self.wake = wake
        """What wakes a wait for a version instead of the weights folder (colocated: the
        handover itself)."""
        self.files_once = files_once
        """Look at the files only until the first refresh (colocated: every later version
        comes from `receiver`, and reading `LATEST` at each refresh would only cost time)."""
        self._files_read = False

    def refresh(self) -> int:
        """Swap in the newest version: one that came over the fabric, else files.

        With files alone a version that differs from the engine's is loaded (it is older only
        after the trainer resumed from an earlier checkpoint: its weights are the truth);
        next to a fabric, files are loaded only when newer than what the engine holds.
        """
        if self.receiver is not None:
            got = self.receiver.take()
            if got is not None:
                self.engine.load_weights(got[1], got[0])  # copies: the buffers are free again
                self.receiver.give_back(got[1])
            self.fallbacks += len(self.receiver.failures)
            self.receiver.failures.clear()
        if self.files_once and self._files_read:
            return self.engine.version
        try:
            version = self._load_latest_files()
            self._files_read = True
            return version
        except WeightsUnavailable as exc:  # the files may be intact: keep what we hold
            log.warning("weights unreadable for now (%s): keeping version %d and reading "
                        "again at the next refresh", exc, self.engine.version)
            return self.engine.version

    def _load_latest_files(self) -> int:
        """Load the version `LATEST` names when it is one to take (see `refresh`)."""
        while True:
            latest = latest_weights_version(self.run.weights)
            if latest is None or latest == self.engine.version or (
                    self.receiver is not None and latest < self.engine.version):
                return self.engine.version
            held, self.held = self.held, None  # a failed load may leave it half changed
            try:
                state = load_weights(self.run.weights, latest, self.read_buffer, held=held)
            except WeightsGone:
                continue  # pruned while we read it: a newer one exists
            self.held = (latest, state)
            self.engine.load_weights(state, latest)
            return latest

    def wait_for(self, version: int, poll: float = 0.02) -> bool:
        """Block until the engine holds weights >= `version`; False if stopped or the
        trainer finished without publishing it."""
        start = time.monotonic()
        try:
            while self.refresh() < version:
                if self.clock is not None and not self.clock.next_step_fits():
                    self.stop.out_of_time()
                if not self.published.active:  # the trainer had not published yet
                    self.published.add(self.run.weights)
                if self._trainer_done() or self.stop.sleep(poll, self.wake or self.published):
                    return False
            return True
        finally:
            self.waited += time.monotonic() - start

    def _trainer_done(self) -> bool:
        return role_status(self.run, "trainer") == "done"

    def linger(self, timeout: float, poll: float = 0.1) -> None:
        """Keep receiving (and dropping) versions until the trainer is done, at most
        `timeout` s: a broadcast the trainer began before it saw this explorer finish must
        not stall on a receiver that left."""
        if self.receiver is None:
            return
        end = time.monotonic() + timeout
        while not self._trainer_done() and not self.stop and time.monotonic() < end:
            got = self.receiver.take()
            if got is not None:
                self.receiver.give_back(got[1])
            time.sleep(poll)

    def close(self) -> None:
        """Stop receiving."""
        self.published.close()
        if self.receiver is not None:
            self.receiver.close()
