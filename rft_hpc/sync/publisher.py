"""The trainer's side of weight sync: every new version goes out by `sync.method`.

`checkpoint` writes versioned files (sync/weight_files.py), by default on a background thread
while the next step trains (sync/background.py, `sync.background`). `nccl` (gloo on CPUs) and `mpi`
broadcast the weights to the explorers over the fabric (sync/collective.py, sync/mpi.py);
with `model.lora` the weights are the adapter's tensors alone, on every path (the files add
its peft config; over the fabric both sides take it from the stage's `model.lora`);
when such a sync fails or outlasts `sync.timeout`, that version is written as files instead
and counted (`sync_fallbacks`), so no role ever hangs on a dead peer. Files are also written
at the end, once an explorer has finished (it no longer listens), and whenever the trainer
has waited `sync.idle_publish` seconds for data: an explorer that (re)started after the last
broadcast then finds the current weights on the filesystem. With `sync.full_every` > 1 the
files of a whole model's version are a delta against the files version before, but for every
`full_every`-th and those an evaluator scores, and over the fabric a version goes as a delta
against the one broadcast before, but for every `full_every`-th (docs/weights-format.md).
Colocated (`launch.colocate`), the explorer shares the trainer's process: every version is
handed over in memory (`sync.memory.MemoryHandover`), and only the versions that must be on
the filesystem are written: the newest one at each checkpoint and at the end, so that a
restarted process finds the weights its checkpoint's explorer steps used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.models.lora import adapter_config
from rft_hpc.runtime.common import role_status
from rft_hpc.sync.background import BackgroundWeightWriter
from rft_hpc.sync.delta import DeltaChain
from rft_hpc.sync.fabric import SyncFailed
from rft_hpc.sync.memory import MemoryHandover
from rft_hpc.sync.protocols import WeightSender
from rft_hpc.sync.weight_files import latest_weights_version, publish_weights

log = logging.getLogger(__name__)


def sync_folder(run: RunDir, method: str) -> Path:
    """Where the trainer and the explorers of a stage meet for the `method` sync."""
    return run.sync_state(method)


def fabric_backend() -> str:
    """`nccl` where CUDA is there, else `gloo`: the same code on GPUs and CPUs."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightPublisher:
    """Publishes the trainer's versions by the configured method, with files as fallback."""

    def __init__(self, config: ExperimentConfig, run: RunDir, *,
                 keep_also: Collection[int] = (), device: torch.device | None = None,
                 handover: MemoryHandover | None = None) -> None:
        self.config, self.run, self.keep_also = config, run, keep_also
        self.method = "memory" if handover is not None else config.sync.method
        self.handover = handover
        """Colocated: the explorer in this process takes every version from here."""
        self.device = device
        self.fallbacks = 0
        self.fabric_deltas = 0
        """Versions that went over the fabric as deltas (every explorer applied them)."""
        self.files_version = latest_weights_version(run.weights)
        """The newest version written as files, or being written in the background."""
        self._sender: WeightSender | None = handover
        self._chain = DeltaChain(config.sync.full_every if config.model.lora is None else 1)
        self._writer = (BackgroundWeightWriter(run.weights, keep_also, self._chain)
                        if self.method == "checkpoint" and config.sync.background else None)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Send `version` to the explorers; returns the sync's metrics (`sync_seconds`: the
        trainer's time in it; with background writes, `sync_write_seconds`: the last
        finished write's; with nccl/mpi, `sync_fabric_deltas`: versions sent as deltas)."""
        t0 = time.monotonic()
        values = {}
        if self._writer is not None and self.files_version != version:
            self._writer.submit(state_dict, version, adapter=self._adapter(state_dict))
            self.files_version = version
            values["sync_write_seconds"] = self._writer.write_seconds
        elif self.method == "checkpoint" or self._an_explorer_finished() or not self._send(
                state_dict, version):
            self.write_files(state_dict, version)
        if self.method not in ("checkpoint", "memory"):
            values["sync_fabric_deltas"] = float(self.fabric_deltas)
        return {**values, "sync_seconds": time.monotonic() - t0,
                "sync_fallbacks": float(self.fallbacks)}

    def write_files(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `version` the newest weights on the filesystem (once); returns when they
        are there."""
        if self._writer is not None:
            self._writer.wait()
        if self.files_version != version:
            base = None
            if self._chain.active:
                snapshot = {n: t.detach().to("cpu", copy=True) for n, t in state_dict.items()}
                base = self._chain.next(snapshot, version, whole=version in self.keep_also)
            publish_weights(self.run.weights, state_dict, version, keep_also=self.keep_also,
                            adapter=self._adapter(state_dict), delta_of=base)
            self.files_version = version

    def _adapter(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
        """peft's adapter config of a LoRA run's published tensors (None: a whole model)."""
        lora = self.config.model.lora
        return None if lora is None else adapter_config(lora, state_dict,
                                                        self.config.model.path)

    def flush(self) -> None:
        """Wait until every version published so far is on the filesystem (colocated: the
        newest version handed over is written now, from the handover's copy)."""
        if self._writer is not None:
            self._writer.wait()
        if self.handover is not None:
            with self.handover.held():
                newest = self.handover.newest()
                if newest is not None and newest[0] > (self.files_version or -1):
                    self.write_files(newest[1], newest[0])

    def _send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        try:
            sender = self._sender_for()
            sender.send(state_dict, version)
            self.fabric_deltas += sender.last_form == "delta"
            return True
        except SyncFailed as exc:
            self.fallbacks += 1
            log.warning("%s sync of v%d failed (%s): written as files instead", self.method,
                        version, exc)
            return False

    def _sender_for(self) -> WeightSender:
        if self._sender is not None:
            return self._sender
        sync, count = self.config.sync, self.config.explorer.count
        folder = sync_folder(self.run, self.method)
        if self.method == "nccl":
            from rft_hpc.sync.collective import CollectiveSender

            self._sender = CollectiveSender(folder, count, backend=fabric_backend(),
                                            device=self.device, timeout=sync.timeout,
                                            join_timeout=sync.timeout,
                                            bucket_mb=sync.bucket_mb, checksum=sync.checksum,
                                            full_every=self._chain.full_every)
        else:
            from rft_hpc.sync.mpi_port import MpiPortSender

            port = MpiPortSender(folder, timeout=sync.timeout, bucket_mb=sync.bucket_mb,
                                 checksum=sync.checksum, full_every=self._chain.full_every)
            port.wait_for_receivers(count, sync.timeout)
            self._sender = port
        return self._sender

    def _an_explorer_finished(self) -> bool:
        """An explorer that finished no longer listens: waiting for it would stall a sync.
        (Colocated, the explorer is in this process and takes every version: one that says
        it is done may still be asked to replace stale records, and looks nowhere else.)"""
        return self.method != "memory" and any(
            role_status(self.run, f"explorer-{i}") == "done"
            for i in range(self.config.explorer.count))

    def close(self) -> None:
        """Finish the write in flight; tell the explorers no more versions come by the
        fabric."""
        try:
            self.flush()
        finally:
            if self._sender is not None:
                self._sender.close()
