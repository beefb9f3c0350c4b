"""The `nccl` weight-sync method: torch.distributed broadcast (NCCL on GPUs, gloo on CPUs).

A *group* is the trainer's rank 0 (the sender, group rank 0) and the explorers that joined
(receivers, ranks 1..n by explorer id). It meets through a folder on the run directory::

    <dir>/GENERATION        "<g>\\n": the generation receivers must join (atomically replaced)
    <dir>/gen-<g>.store     a torch FileStore: join tokens, members, layouts, announcements

The group's process group is built directly on that store (`ProcessGroupGloo` /
`ProcessGroupNCCL`), never as torch's default group, so the trainer's own FSDP group and the
explorer's engine groups are untouched, and a new generation can be built in the same
process after a failure. The protocol (docs/weights-format.md, "Fabric sync"):

1. joining: a receiver sets `join/<id>` = a fresh token and adds 1 to `joins`; the sender
   waits for all expected receivers (or `join_timeout`), then sets `members`;
2. a sync: the sender sets `layout/<digest>` (once per layout) and `announce/<seq>` =
   {version, layout, bytes, crc32, keep, delta}; then broadcasts the pieces (`fabric.plan`),
   then every rank all-reduces (MIN) an "ok" flag (a receiver's checksum verdict). With a
   `delta` header the delta's bytes travel first, and a first verdict says whether every
   receiver rebuilt the version from it; if one did not, the pieces follow as above
   (`rft_hpc.sync.fabric_delta`);
3. anything that fails or outlasts `timeout` raises `SyncFailed` on every living rank; the
   group is dropped. A failed or restarted receiver joins the current generation again with
   a new token; the sender sees `joins` move and opens generation g+1 at its next send
   (announcing `regroup` to the old group), which every living peer then joins.

Waiting for the next announcement is done by polling the store, not inside a collective, so
an idle receiver never holds a collective that could time out or hang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rft_hpc.core.rundir import atomic_write_text, make_dirs
from rft_hpc.sync.fabric import (
    DEFAULT_BUCKET_MB,
    BufferPool,
    Layout,
    SyncFailed,
    crc32_of,
    plan,
    sender_tensors,
    source_buffers,
)
from rft_hpc.sync.fabric_delta import DeltaSender, HeldVersion, chunks

log = logging.getLogger(__name__)

GENERATION_FILE = "GENERATION"
_WINDOW = 4  # broadcasts in flight: the next bucket is packed while one travels
_GRACE = 2.0  # seconds for a receiver to rejoin once its own failed sync timed out


def _store_path(folder: Path, gen: int) -> Path:
    return folder / f"gen-{gen:06d}.store"


def read_generation(folder: str | Path) -> int | None:
    """The generation `folder/GENERATION` names, or None before the first sender."""
    try:
        return int((Path(folder) / GENERATION_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _open_store(path: Path, timeout: float) -> dist.FileStore:
    store = dist.FileStore(str(path), -1)
    store.set_timeout(timedelta(seconds=timeout))
    return store


def _process_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float,
                   device: torch.device) -> dist.ProcessGroup:
    """A gloo or NCCL group on `store`, outside torch's default-group bookkeeping."""
    prefixed = dist.PrefixStore("pg", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=timeout)
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    if backend == "nccl":
        torch.cuda.set_device(device)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, size, nccl_opts)
    raise ValueError(f"unknown backend {backend!r}: gloo or nccl")


def _default_device(backend: str, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
        torch.device("cpu")


class _Group:
    """One generation's store and process group, from one rank's point of view."""

    def __init__(self, gen: int, store: dist.FileStore) -> None:
        self.gen = gen
        self.store = store
        self.pg: dist.ProcessGroup | None = None
        self.seq = 0

    def drop(self) -> None:
        """Abandon the process group (aborting its pending work where the backend can)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()


def _wait(work: dist.Work, deadline: float, what: str, version: int | None) -> None:
    """Wait for `work` until `deadline` (time.monotonic); SyncFailed on error or lateness."""
    left = deadline - time.monotonic()
    try:
        if left <= 0 or not work.wait(timedelta(seconds=left)):
            raise SyncFailed(f"{what} did not finish in time", version)
    except SyncFailed:
        raise
    except Exception as e:  # gloo/NCCL report a dead peer or their own timeout this way
        raise SyncFailed(f"{what} failed: {e}", version) from e


def _transfer(pg: dist.ProcessGroup, buffers, deadline: float, version: int | None) -> None:
    """Broadcast each buffer from rank 0, keeping a few in flight."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pending: list[tuple[dist.Work, torch.Tensor]] = []
    for k, buf in enumerate(buffers):
        pending.append((pg.broadcast([buf], opts), buf))
        if len(pending) >= _WINDOW:
            _wait(pending.pop(0)[0], deadline, f"broadcast of bucket {k - _WINDOW + 1}", version)
    for work, _ in pending:
        _wait(work, deadline, "broadcast", version)


def _agree(pg: dist.ProcessGroup, ok: bool, device: torch.device, deadline: float,
           version: int | None) -> bool:
    """All-reduce (MIN) of every rank's verdict: True when every rank says ok."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    _wait(pg.allreduce([flag], opts), deadline, "final agreement", version)
    return bool(flag.item())


class CollectiveSender:
    """The trainer rank 0's side: sends versions to the receivers that joined.

    `receivers` is the number of explorers (ids 0..receivers-1). `timeout` bounds each
    transfer (and building a group), `join_timeout` how long a new generation waits for
    missing receivers before it goes ahead without them (after a failed sync, at least
    `timeout` + 2 s: a surviving receiver, with the same `timeout`, may take that long to
    notice the failure and come back). With `full_every` K > 1 (`sync.full_every`) versions
    go as deltas but for every K-th (`rft_hpc.sync.fabric_delta`); `last_form` says how the
    last one went: "whole", "delta", or "delta+whole" (a receiver could not use the delta).
    """

    def __init__(self, folder: str | Path, receivers: int, *, backend: str = "gloo",
                 device: str | torch.device | None = None, timeout: float = 120.0,
                 join_timeout: float = 30.0, bucket_mb: float = DEFAULT_BUCKET_MB,
                 checksum: bool = False, poll: float = 0.02, full_every: int = 1) -> None:
        if receivers < 1:
            raise ValueError(f"need at least one receiver, got {receivers}")
        self.folder = Path(folder)
        make_dirs(self.folder)
        self.receivers = receivers
        self.backend = backend
        self.device = _default_device(backend, device)
        self.timeout, self.join_timeout = timeout, join_timeout
        self.bucket_bytes = max(1, round(bucket_mb * 2**20))
        self.checksum, self.poll = checksum, poll
        self.members: list[int] = []
        self._group: _Group | None = None
        self._joins = 0
        self._failed_deadline = 0.0
        self._layouts: set[str] = set()
        self._delta = DeltaSender(full_every)
        self.last_form = ""
        self.wire_bytes = 0
        """Bytes of weights (whole pieces and delta) the last send broadcast."""

    @property
    def generation(self) -> int | None:
        """The generation of the current group (None before the first send)."""
        return None if self._group is None else self._group.gen

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> list[int]:
        """Broadcast `state_dict` as `version` to every member; returns the members' ids.

        Forms or re-forms the group first when needed (first send, after a failure, when a
        receiver joined or re-joined). Returns only once every member has the whole state
        dict (and, with `checksum`, has verified it). Raises `SyncFailed` when no receiver
        joined, a member died or the transfer outlasted `timeout`; the next call starts a
        new generation.
        """
        group = self._ensure_group(version)
        layout = Layout.of(state_dict, self.bucket_bytes)
        pieces = plan(layout)
        tensors = sender_tensors(state_dict, self.device)
        crc = crc32_of(source_buffers(pieces, tensors)) if self.checksum else None
        digest = layout.digest()
        try:
            delta = self._delta.prepare(state_dict, version)
            if digest not in self._layouts:
                group.store.set(f"layout/{digest}", layout.to_json())
                self._layouts.add(digest)
            self._announce(group, {"kind": "data", "version": version, "layout": digest,
                                   "bytes": layout.total_bytes, "crc32": crc,
                                   "keep": self._delta.keep,
                                   "delta": None if delta is None else delta.header})
            deadline = time.monotonic() + self.timeout
            assert group.pg is not None
            self.wire_bytes = 0
            if delta is not None:
                data = delta.data.to(self.device)
                _transfer(group.pg, chunks(data, self.bucket_bytes), deadline, version)
                self.wire_bytes += data.numel()
                if _agree(group.pg, True, self.device, deadline, version):
                    self.last_form = "delta"
                    return list(self.members)
                log.info("v%d: a receiver could not apply the delta: sent whole too", version)
            _transfer(group.pg, source_buffers(pieces, tensors), deadline, version)
            self.wire_bytes += layout.total_bytes
            if not _agree(group.pg, True, self.device, deadline, version):
                raise SyncFailed(f"a receiver's checksum of v{version} did not match", version)
            self.last_form = "whole" if delta is None else "delta+whole"
        except BaseException:
            self._delta.restart()
            self._fail()
            raise
        return list(self.members)

    def _announce(self, group: _Group, message: dict) -> None:
        group.store.set(f"announce/{group.seq}", json.dumps(message))
        group.seq += 1

    def _ensure_group(self, version: int | None) -> _Group:
        if self._group is not None and self._group.pg is not None:
            if self._group.store.add("joins", 0) == self._joins:
                return self._group
            self._announce(self._group, {"kind": "regroup"})  # someone (re)joined
            self._group.drop()
        return self._new_generation(version)

    def _new_generation(self, version: int | None) -> _Group:
        gen = max(read_generation(self.folder) or 0, self.generation or 0) + 1
        path = _store_path(self.folder, gen)
        path.unlink(missing_ok=True)
        for old in self.folder.glob("gen-*.store"):  # keep the previous one for late readers
            if old.name < _store_path(self.folder, gen - 1).name:
                old.unlink(missing_ok=True)
        group = self._group = _Group(gen, _open_store(path, self.timeout))
        self._layouts = set()
        atomic_write_text(self.folder / GENERATION_FILE, f"{gen}\n")
        # After a failure, survivors notice it by the failed sync's deadline at the latest
        # (their own timeout); give them a little longer to come back.
        end = max(time.monotonic() + self.join_timeout, self._failed_deadline + _GRACE)
        self._failed_deadline = 0.0
        while group.store.add("joins", 0) < self.receivers and time.monotonic() < end:
            time.sleep(self.poll)
        self._joins = group.store.add("joins", 0)  # before reading tokens: no join is lost
        tokens = {i: group.store.get(f"join/{i}").decode() for i in range(self.receivers)
                  if group.store.check([f"join/{i}"])}
        self.members = sorted(tokens)
        if not tokens:
            raise SyncFailed(f"no receiver joined generation {gen} within "
                             f"{self.join_timeout:g} s", version)
        group.store.set("members", json.dumps([[i, tokens[i]] for i in self.members]))
        try:
            group.pg = _process_group(self.backend, group.store, 0, len(tokens) + 1,
                                      self.timeout, self.device)
        except Exception as e:
            raise SyncFailed(f"generation {gen}: a member did not connect: {e}",
                             version) from e
        return group

    def _fail(self) -> None:
        self._failed_deadline = time.monotonic() + self.timeout
        if self._group is not None:
            with contextlib.suppress(Exception):  # tell members that missed the failure
                self._announce(self._group, {"kind": "regroup"})
            self._group.drop()

    def close(self) -> None:
        """Tell the members no more versions come from this sender and drop the group."""
        if self._group is not None and self._group.pg is not None:
            with contextlib.suppress(Exception):
                self._announce(self._group, {"kind": "close"})
            self._group.drop()


class CollectiveReceiver:
    """An explorer's side: joins the sender's group and receives versions.

    `device` is where the received tensors live (the GPU for NCCL). Each `receive` joins or
    re-joins the current generation as needed, so a restarted explorer needs nothing else.
    """

    def __init__(self, folder: str | Path, receiver_id: int, *, backend: str = "gloo",
                 device: str | torch.device | None = None, timeout: float = 120.0,
                 poll: float = 0.02) -> None:
        self.folder = Path(folder)
        self.receiver_id = receiver_id
        self.backend = backend
        self.device = _default_device(backend, device)
        self.timeout, self.poll = timeout, poll
        self._group: _Group | None = None
        self._token = ""
        self._layouts: dict[str, Layout] = {}
        self.pool = BufferPool()
        self.held = HeldVersion()
        """A copy of the last version received, when the sender sends deltas."""

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Receive a later version into the buffers of `state_dict` (a dict `receive`
        returned, no longer used: e.g. copied into the engine)."""
        self.pool.give_back(state_dict)

    def receive(self, wait: float | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The next version the sender sends: `(version, state_dict)`.

        Waits up to `wait` seconds (None: for ever) for the sender to announce one and
        returns None if none came. Once announced, the transfer is bounded by `timeout`:
        `SyncFailed` when it fails (this receiver then re-joins on the next call).
        """
        end = None if wait is None else time.monotonic() + wait
        checks = 0
        while True:
            group = self._group
            if group is None or group.pg is None:
                self._join()
            elif group.store.check([f"announce/{group.seq}"]):
                message = json.loads(group.store.get(f"announce/{group.seq}"))
                group.seq += 1
                if message["kind"] == "data":
                    return self._receive(group, message)
                self._leave()  # regroup / close: join whatever generation comes next
                continue
            elif checks % 25 == 24 and read_generation(self.folder) != group.gen:
                self._leave()  # a restarted sender opened a new generation
                continue
            checks += 1
            if end is not None and time.monotonic() >= end:
                return None
            time.sleep(self.poll)

    def _join(self) -> None:
        """One step of joining: register in the current generation, or build the group."""
        gen = read_generation(self.folder)
        if gen is None:
            return
        if self._group is None or self._group.gen != gen:
            group = _Group(gen, _open_store(_store_path(self.folder, gen), self.timeout))
            self._token = uuid.uuid4().hex
            group.store.set(f"join/{self.receiver_id}", self._token)
            group.store.add("joins", 1)
            self._group = group
        group = self._group
        if not group.store.check(["members"]):
            return
        members = [tuple(m) for m in json.loads(group.store.get("members"))]
        if (self.receiver_id, self._token) not in members:
            return  # too late for this generation: the sender regroups at its next send
        rank = 1 + members.index((self.receiver_id, self._token))
        try:
            group.pg = _process_group(self.backend, group.store, rank, len(members) + 1,
                                      self.timeout, self.device)
        except Exception as e:
            self._group = None
            raise SyncFailed(f"generation {gen}: could not connect: {e}") from e
        group.seq = 0

    def _receive(self, group: _Group, message: dict) -> tuple[int, dict[str, torch.Tensor]]:
        version = message["version"]
        deadline = time.monotonic() + self.timeout
        try:
            digest = message["layout"]
            if digest not in self._layouts:
                self._layouts[digest] = Layout.from_json(group.store.get(f"layout/{digest}"))
            layout = self._layouts[digest]
            pieces = plan(layout)
            dest = self.pool.get(layout, pieces, self.device)
            assert group.pg is not None
            if message["delta"] is not None:
                header = message["delta"]
                data = torch.empty(sum(header["bytes"]), dtype=torch.uint8, device=self.device)
                _transfer(group.pg, chunks(data, layout.bucket_bytes), deadline, version)
                ok = self.held.apply(version, layout, header, data)
                if _agree(group.pg, ok, self.device, deadline, version):
                    self.held.copy_into(dest)
                    return version, self.pool.lend(dest)
            _transfer(group.pg, dest.buffers, deadline, version)
            ok = message["crc32"] is None or crc32_of(dest.buffers) == message["crc32"]
            if not _agree(group.pg, ok, self.device, deadline, version):
                raise SyncFailed(f"v{version}: checksum mismatch on "
                                 f"{'this' if not ok else 'another'} receiver", version)
            if message["keep"]:
                self.held.keep(version, layout, [t for t in dest.tensors if t is not None])
            else:
                self.held.drop()
        except BaseException as e:
            self.held.drop()
            self._leave()
            if isinstance(e, SyncFailed | KeyboardInterrupt):
                raise
            raise SyncFailed(f"v{version}: {e}", version) from e
        return version, self.pool.lend(dest)

    def _leave(self) -> None:
        if self._group is not None:
            self._group.drop()
        self._group = None

    def close(self) -> None:
        """Leave the group (the sender regroups without this receiver at its next failure)."""
        self._leave()
