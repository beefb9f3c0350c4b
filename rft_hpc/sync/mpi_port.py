"""The `mpi` weight-sync method between separately launched programs (`rft_hpc.sync.mpi`'s
module docstring has the protocol): the trainer opens an MPI port and writes its name to
`folder/PORT`; each explorer program drops a `join-*` file and connects, and the two sides
merge into one intracomm, a *link*, on which `rft_hpc.sync.mpi`'s sender and receiver run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from mpi4py import MPI

from rft_hpc.core.rundir import atomic_write_text, make_dirs
from rft_hpc.sync.fabric import DEFAULT_BUCKET_MB, BufferPool, SyncFailed
from rft_hpc.sync.mpi import MpiReceiver, MpiSender, _Link

PORT_FILE = "PORT"


class MpiPortSender(MpiSender):
    """Sends to separately launched receiver programs that connect through `folder/PORT`.

    A helper thread accepts each program that drops a `join-*` file; its link is used from
    the next `send` on. Links that fail are dropped; a restarted program connects again.
    """

    def __init__(self, folder: str | Path, *, timeout: float = 120.0,
                 bucket_mb: float = DEFAULT_BUCKET_MB, checksum: bool = False,
                 poll: float = 0.05, full_every: int = 1) -> None:
        super().__init__(MPI.COMM_SELF, timeout=timeout, bucket_mb=bucket_mb,
                         checksum=checksum, full_every=full_every)
        self.links = []
        self.folder = Path(folder)
        make_dirs(self.folder)
        for old in [*self.folder.glob("join-*"), *self.folder.glob("go-*")]:
            old.unlink(missing_ok=True)
        self.port = MPI.Open_port()
        self.generation = uuid.uuid4().hex[:12]
        atomic_write_text(self.folder / PORT_FILE, f"{self.generation}\n{self.port}\n")
        self._new: list[_Link] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll = poll
        self._thread = threading.Thread(target=self._accept, daemon=True, name="mpi-accept")
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            for path in sorted(self.folder.glob(f"join-{self.generation}-*")):
                name = path.name.split("-")[2]
                go = self.folder / ("go-" + path.name.removeprefix("join-"))
                os.rename(path, go)  # one joiner at a time: concurrent connects crash MPICH
                try:
                    inter = MPI.COMM_SELF.Accept(self.port, root=0)
                    link = _Link(inter.Merge(high=False), 0, name)
                except MPI.Exception:  # the joiner died while connecting: it will retry
                    continue
                finally:
                    go.unlink(missing_ok=True)
                with self._lock:
                    self._new.append(link)
            time.sleep(self._poll)

    def wait_for_receivers(self, n: int, timeout: float) -> int:
        """Wait up to `timeout` s until `n` links are healthy; returns how many are."""
        end = time.monotonic() + timeout
        while True:
            self._adopt()
            healthy = sum(link.error is None for link in self.links)
            if healthy >= n or time.monotonic() >= end:
                return healthy
            time.sleep(self._poll)

    def _adopt(self) -> None:
        with self._lock:
            new, self._new = self._new, []
        self.links = [link for link in self.links if link.error is None] + new

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> list[str]:
        """`MpiSender.send` to every program connected so far (receiver ids as names)."""
        self._adopt()
        return super().send(state_dict, version)

    def close(self) -> None:
        """Close the links, stop accepting and remove `PORT` (if it is still ours)."""
        self._stop.set()
        # the accept thread must not be between calls into MPI when the process exits (one
        # stuck in Accept, for a joiner that died, is left: MPI gives no way to stop it)
        self._thread.join(timeout=10 * self._poll + 1.0)
        self._adopt()
        super().close()
        with contextlib.suppress(FileNotFoundError):
            if (self.folder / PORT_FILE).read_text().split("\n")[0] == self.generation:
                (self.folder / PORT_FILE).unlink()


class MpiPortReceiver:
    """A receiver program's side of `MpiPortSender`: connects (again) whenever needed.

    `comm` holds the program's receiving ranks (collective calls on it); rank 0 of `comm`
    drops the join file.
    """

    def __init__(self, folder: str | Path, receiver_id: int, *,
                 comm: MPI.Intracomm = MPI.COMM_SELF, timeout: float = 120.0,
                 poll: float = 0.01) -> None:
        self.folder = Path(folder)
        self.receiver_id, self.comm = receiver_id, comm
        self.timeout, self.poll = timeout, poll
        self.generation: str | None = None
        self._inner: MpiReceiver | None = None
        self.pool = BufferPool()  # outlives reconnections

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """See `MpiReceiver.give_back`."""
        self.pool.give_back(state_dict)

    def _port(self) -> tuple[str, str] | None:
        try:
            gen, port = (self.folder / PORT_FILE).read_text().split("\n")[:2]
        except (FileNotFoundError, ValueError):
            return None
        return (gen, port) if port else None

    def _connect(self, end: float) -> bool:
        while True:
            found = self._port() if self.comm.rank == 0 else None
            found = self.comm.bcast(found, root=0)
            if found is not None:
                break
            if time.monotonic() >= end:
                return False
            time.sleep(self.poll * 10)
        gen, port = found
        if self.comm.rank == 0:
            name = f"{gen}-{self.receiver_id}-{uuid.uuid4().hex[:8]}"
            atomic_write_text(self.folder / f"join-{name}", f"{os.getpid()}\n")
            while not (self.folder / f"go-{name}").exists():  # the sender's turn for us
                time.sleep(self.poll)
        inter = self.comm.Connect(port, root=0)
        self._inner = MpiReceiver(inter.Merge(high=True), root=0, timeout=self.timeout,
                                  poll=self.poll, pool=self.pool)
        self.generation = gen
        return True

    def receive(self, wait: float | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """`MpiReceiver.receive`, connecting first (again after a failure or a new sender)."""
        end = float("inf") if wait is None else time.monotonic() + wait
        while True:
            if self._inner is None and not self._connect(end):
                return None
            assert self._inner is not None
            step = min(1.0, max(0.0, end - time.monotonic()))
            try:
                got = self._inner.receive(wait=step)
            except SyncFailed:
                self._inner = None
                raise
            if got is not None:
                return got
            found = self._port() if self.comm.size == 1 else (self.generation, "")
            if found is None or found[0] != self.generation:
                self._inner.close()  # the sender is gone or was restarted: connect anew
                self._inner = None
            if time.monotonic() >= end:
                return None

    def close(self) -> None:
        """Stop receiving (the link is abandoned; the sender drops it at its next send)."""
        if self._inner is not None:
            self._inner.close()
        self._inner = None
