"""The `mpi` weight-sync method: bucketed non-blocking broadcasts over mpi4py.

Two ways to meet (docs/weights-format.md, "Fabric sync"):

- one MPI world (a single, possibly heterogeneous, Slurm job): `MpiSender(comm)` on the
  trainer's rank and `MpiReceiver(comm)` on the explorers' ranks of a shared communicator;
- separately launched programs (`rft_hpc.sync.mpi_port`): `MpiPortSender(folder)` opens an
  MPI port and writes its name to `folder/PORT`; each explorer program
  (`MpiPortReceiver(folder, id, comm)`, its comm of any size) drops a `join-*` file and
  connects; the two sides merge into one intracomm, a *link*. The sender keeps one link per
  connected program and broadcasts on all of them at once, so a dead program breaks only
  its own link.

The protocol on one intracomm (root = the sender): an announcement (`Ibcast` of 6 int64:
magic (with the protocol version), kind, version, layout bytes, info bytes, data bytes), the
layout JSON when it changed, the info JSON ({crc32, keep, delta}), then, for a delta, its
bytes and an `Iallreduce(MIN)` of every rank's verdict (done when all applied it), else or
when one could not, the pieces of `fabric.plan` (`Ibcast` of numpy views of the tensors: big
tensors in place) and an `Iallreduce(MIN)` of every rank's verdict. Every wait polls `Test`
against a deadline, so a dead or stuck peer gives `SyncFailed` after `timeout` instead of a
hang.

What MPI cannot recover: a pending collective can be neither cancelled nor completed once a
peer is gone, so a link (or a world) that failed is abandoned for good: its requests and
communicator are leaked, never freed. Explorers of a separately launched program re-join by
connecting again; in a single world there is nothing to re-join (and the launcher usually
kills the whole job when one rank dies): use `checkpoint` from then on. `Comm.Accept` and
`Comm.Connect` have no timeout; the sender accepts on a helper thread so that a joiner that
dies before connecting stalls only that thread (and MPI_Finalize at exit).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import numpy as np
import torch
from mpi4py import MPI

from rft_hpc.sync.fabric import (
    DEFAULT_BUCKET_MB,
    PROTOCOL_VERSION,
    BufferPool,
    Layout,
    SyncFailed,
    check_protocol,
    crc32_of,
    plan,
    sender_tensors,
    source_buffers,
)
from rft_hpc.sync.fabric_delta import DeltaSender, HeldVersion, chunks

_MAGIC_V1 = 0x52465453594E43  # "RFTSYNC": protocol 1
_MAGIC = _MAGIC_V1 << 8 | PROTOCOL_VERSION  # "RFTSYNC" and the protocol version
_DATA, _CLOSE = 1, 2
_WINDOW = 4
_CPU = torch.device("cpu")
_ABANDONED: list[_Link] = []  # failed links keep their buffers: MPI may still touch them


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def check_magic(magic: int) -> None:
    """`SyncFailed` unless `magic` opens an announcement of this protocol version."""
    if magic >> 8 == _MAGIC_V1:
        check_protocol(magic & 0xFF)
    elif magic == _MAGIC_V1:
        check_protocol(1)
    elif magic != _MAGIC:
        raise SyncFailed(f"not an rft-hpc sync announcement (magic {magic:#x})")


class _Link:
    """One intracomm to receivers, with its pending requests and its fate."""

    def __init__(self, comm: MPI.Intracomm, root: int, name: str) -> None:
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # a dead peer must raise, not abort us
        self.comm, self.root, self.name = comm, root, name
        self.pending: list[tuple[MPI.Request, object]] = []
        self._error: str | None = None
        self.layout = ""

    @property
    def error(self) -> str | None:
        return self._error

    @error.setter
    def error(self, value: str | None) -> None:
        if value is not None and self.pending:
            _ABANDONED.append(self)
        self._error = value

    def post(self, request: MPI.Request, *buffers: object) -> None:
        """Track `request`; `buffers` stay referenced until it completes."""
        if self._error is None:
            self.pending.append((request, buffers))


def _drain(links: list[_Link], deadline: float, keep: int = 0, spin: bool = True,
           poll: float = 0.001, any_progress: bool = False) -> None:
    """Progress until each healthy link has at most `keep` pending requests (oldest done),
    or, with `any_progress`, until one link has.

    A link whose request fails or is still pending at `deadline` gets `error` set and its
    requests are abandoned (MPI cannot cancel a collective).
    """
    while True:
        busy = False
        for link in links:
            if link.error is not None:
                continue
            try:
                while len(link.pending) > keep and link.pending[0][0].Test():
                    link.pending.pop(0)
            except MPI.Exception as e:
                link.error = f"MPI error: {e}"
                continue
            if len(link.pending) > keep:
                busy = True
            elif any_progress:
                return
        if not busy:
            return
        if time.monotonic() >= deadline:
            for link in links:
                if link.error is None and len(link.pending) > keep:
                    link.error = "did not finish in time"
            return
        if not spin:
            time.sleep(poll)


def _broadcast(links: list[_Link], buffers: list[np.ndarray], deadline: float) -> list[bool]:
    """Broadcast `buffers` on every link, then all-reduce each link's verdict; True where
    all ranks of a healthy link said ok.

    Each link advances on its own, its verdict included: a dead peer whose requests never
    fail stalls only its own link until the deadline. Were the verdicts posted once every
    link had sent its data, a healthy link's would wait for the dead one's deadline, and
    its receivers, whose own deadlines fall at about the same time, would give up first.
    """
    cursor = dict.fromkeys(range(len(links)), 0)
    flags = [np.zeros(1, np.int64) for _ in links]
    voted = [False] * len(links)
    while True:
        for k, link in enumerate(links):
            while link.error is None and cursor[k] < len(buffers) and \
                    len(link.pending) <= _WINDOW:
                link.post(link.comm.Ibcast(buffers[cursor[k]], root=link.root))
                cursor[k] += 1
            if link.error is None and cursor[k] == len(buffers) and not voted[k]:
                one = np.ones(1, np.int64)
                link.post(link.comm.Iallreduce(one, flags[k], op=MPI.MIN), one, flags[k])
                voted[k] = True
        active = [link for k, link in enumerate(links)
                  if link.error is None and cursor[k] < len(buffers)]
        if not active:
            break
        _drain(active, deadline, keep=_WINDOW, any_progress=True)
    _drain(links, deadline)
    return [link.error is None and flag[0] == 1 for link, flag in zip(links, flags, strict=True)]


class MpiSender:
    """Sends versions to the other ranks of `comm` (one MPI world), from rank `root`.

    With `full_every` K > 1 (`sync.full_every`) versions go as deltas but for every K-th
    (`rft_hpc.sync.fabric_delta`); `last_form` says how the last one went: "whole", "delta",
    or "delta+whole" (a link's receiver could not use the delta: that link got it whole).
    """

    def __init__(self, comm: MPI.Intracomm, *, root: int = 0, timeout: float = 120.0,
                 bucket_mb: float = DEFAULT_BUCKET_MB, checksum: bool = False,
                 full_every: int = 1) -> None:
        self.timeout, self.checksum = timeout, checksum
        self.bucket_bytes = max(1, round(bucket_mb * 2**20))
        self.links = [_Link(comm, root, "world")]
        self._delta = DeltaSender(full_every)
        self.last_form = ""

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> list[str]:
        """Broadcast `state_dict` as `version` on every healthy link; returns their names.

        Returns once every receiver has it all (and verified it, with `checksum`). Raises
        `SyncFailed` naming the links that failed (a dead peer, a checksum mismatch, or more
        than `timeout` seconds); those links are abandoned, the others got the version.
        """
        links = [link for link in self.links if link.error is None]
        if not links:
            raise SyncFailed("no healthy link to any receiver", version)
        layout = Layout.of(state_dict, self.bucket_bytes)
        pieces = plan(layout)
        tensors = sender_tensors(state_dict, _CPU)
        crc = crc32_of(source_buffers(pieces, tensors)) if self.checksum else None
        delta = self._delta.prepare(state_dict, version)
        info = np.frombuffer(json.dumps({
            "crc32": crc, "keep": self._delta.keep,
            "delta": None if delta is None else delta.header}).encode(), dtype=np.uint8)
        blob = np.frombuffer(layout.to_json(), dtype=np.uint8)
        digest = layout.digest()
        deadline = time.monotonic() + self.timeout
        for link in links:
            size = 0 if link.layout == digest else blob.size
            head = np.array([_MAGIC, _DATA, version, size, info.size, layout.total_bytes],
                            np.int64)
            link.post(link.comm.Ibcast(head, root=link.root), head)
            if size:
                link.post(link.comm.Ibcast(blob, root=link.root), blob)
            link.post(link.comm.Ibcast(info, root=link.root), info)
            link.layout = digest
        whole = links
        if delta is not None:
            ok = _broadcast(links, [_np(b) for b in chunks(delta.data, self.bucket_bytes)],
                            deadline)
            whole = [link for link, good in zip(links, ok, strict=True)
                     if link.error is None and not good]
        if whole:
            buffers = [_np(b) for b in source_buffers(pieces, tensors)]
            for link, good in zip(whole, _broadcast(whole, buffers, deadline), strict=True):
                if link.error is None and not good:
                    link.error = "a receiver's checksum did not match"
        self.last_form = "whole" if delta is None else "delta+whole" if whole else "delta"
        failed = [f"{link.name}: {link.error}" for link in links if link.error is not None]
        if failed:
            self._delta.restart()
            raise SyncFailed(f"v{version} failed on {len(failed)} of {len(links)} links: "
                             + "; ".join(failed), version)
        return [link.name for link in links]

    def close(self) -> None:
        """Tell the receivers that no more versions come (best effort, bounded)."""
        links = [link for link in self.links if link.error is None]
        for link in links:
            head = np.array([_MAGIC, _CLOSE, -1, 0, 0, 0], np.int64)
            link.post(link.comm.Ibcast(head, root=link.root), head)
        _drain(links, time.monotonic() + min(self.timeout, 5.0))
        for link in links:
            link.error = "closed"


class MpiReceiver:
    """Receives versions sent by `MpiSender` from rank `root` of `comm`."""

    def __init__(self, comm: MPI.Intracomm, *, root: int = 0, timeout: float = 120.0,
                 poll: float = 0.01, pool: BufferPool | None = None) -> None:
        self.link = _Link(comm, root, "world")
        self.timeout, self.poll = timeout, poll
        self.closed = False
        self.pool = pool or BufferPool()
        self.held = HeldVersion()
        """A copy of the last version received, when the sender sends deltas."""
        self._head = np.zeros(6, np.int64)
        self._layout: Layout | None = None

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Receive a later version into the buffers of `state_dict` (a dict `receive`
        returned, no longer used: e.g. copied into the engine)."""
        self.pool.give_back(state_dict)

    def receive(self, wait: float | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The next version: `(version, state_dict)` of CPU tensors.

        Waits up to `wait` seconds (None: for ever) for an announcement, else returns None
        (the posted receive stays pending for the next call). The transfer itself is bounded
        by `timeout`: `SyncFailed` when it fails; the communicator is then abandoned and
        every later call raises `SyncFailed` at once.
        """
        link = self.link
        if link.error is not None:
            raise SyncFailed(f"the link to the sender is gone ({link.error})")
        if not link.pending:
            link.post(link.comm.Ibcast(self._head, root=link.root), self._head)
        end = float("inf") if wait is None else time.monotonic() + wait
        _drain([link], end, spin=False, poll=self.poll)
        if link.error == "did not finish in time":
            link._error = None  # still waiting for an announcement: not a failure
            return None
        if link.error is not None:
            raise SyncFailed(f"waiting for an announcement: {link.error}")
        magic, kind, version, size, info_size, total = (int(x) for x in self._head)
        try:
            check_magic(magic)
        except SyncFailed:
            link.error = "protocol error"
            raise
        if kind == _CLOSE:
            link.error = "closed by the sender"
            self.closed = True
            raise SyncFailed("the sender closed the link")
        try:
            return self._receive(version, size, info_size, total)
        except BaseException:
            self.held.drop()
            raise

    def _receive(self, version: int, size: int, info_size: int,
                 total: int) -> tuple[int, dict[str, torch.Tensor]]:
        link = self.link
        deadline = time.monotonic() + self.timeout
        blob, info = np.empty(size, np.uint8), np.empty(info_size, np.uint8)
        if size:
            link.post(link.comm.Ibcast(blob, root=link.root), blob)
        link.post(link.comm.Ibcast(info, root=link.root), info)
        _drain([link], deadline)
        if link.error is None and size:
            self._layout = Layout.from_json(blob.tobytes())
        if link.error is None and (self._layout is None or self._layout.total_bytes != total):
            link.error = "protocol error: announcement does not match the layout"
        if link.error is not None:
            raise SyncFailed(f"v{version}: {link.error}", version)
        assert self._layout is not None
        layout, message = self._layout, json.loads(info.tobytes())
        dest = self.pool.get(layout, plan(layout), _CPU)
        if message["delta"] is not None:
            header = message["delta"]
            data = torch.empty(sum(header["bytes"]), dtype=torch.uint8)
            self._pieces(chunks(data, layout.bucket_bytes), deadline)
            ok = link.error is None and self.held.apply(version, layout, header, data)
            if self._verdict(ok, deadline, version):
                self.held.copy_into(dest)
                return version, self.pool.lend(dest)
        self._pieces(dest.buffers, deadline)
        crc = message["crc32"]
        ok = link.error is None and (crc is None or crc32_of(dest.buffers) == crc)
        if not self._verdict(ok, deadline, version):
            link.error = "checksum mismatch"
            raise SyncFailed(f"v{version}: {link.error}", version)
        if message["keep"]:
            self.held.keep(version, layout, [t for t in dest.tensors if t is not None])
        else:
            self.held.drop()
        return version, self.pool.lend(dest)

    def _pieces(self, buffers: list[torch.Tensor], deadline: float) -> None:
        """Receive the broadcasts of `buffers` (a window of them in flight)."""
        link = self.link
        for buf in buffers:
            link.post(link.comm.Ibcast(_np(buf), root=link.root), buf)
            _drain([link], deadline, keep=_WINDOW)
        _drain([link], deadline)

    def _verdict(self, ok: bool, deadline: float, version: int) -> bool:
        """All-reduce (MIN) this rank's verdict: True when every rank said ok; `SyncFailed`
        when the link failed."""
        link = self.link
        flag = np.zeros(1, np.int64)
        mine = np.array([1 if ok else 0], np.int64)
        link.post(link.comm.Iallreduce(mine, flag, op=MPI.MIN), mine, flag)
        _drain([link], deadline)
        if link.error is not None:
            raise SyncFailed(f"v{version}: {link.error}", version)
        return bool(flag[0] == 1)

    def close(self) -> None:
        """Stop using the communicator (a pending announcement is abandoned, not freed)."""
        self.link.error = self.link.error or "closed"
