"""What the fabric weight-sync transports share (docs/weights-format.md, "Fabric sync").

The trainer's rank 0 sends a state dict to the explorers as a sequence of broadcasts; both
sides derive the same plan from a small header (the *layout*: names, dtypes, shapes and the
bucket size), so the header is all that travels besides the tensor bytes:

- tensors are taken in dtype groups (in order of first appearance, names kept in order);
- a tensor of at least half a bucket is a *big* tensor: it travels in place (its own bytes,
  no copy), in chunks of at most `bucket_bytes`;
- smaller tensors of one dtype are packed into buckets of at most `bucket_bytes`; the sender
  copies them into one buffer, the receiver keeps them as views of the buffer it received.

`rft_hpc.sync.collective` (torch.distributed: NCCL, gloo) and `rft_hpc.sync.mpi` (mpi4py)
move the pieces; `BackgroundReceiver` runs either kind of receiver on a thread.
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from rft_hpc.sync.protocols import SyncFailed, WeightReceiver
from rft_hpc.sync.storage import dtype_name

__all__ = ["SyncFailed"]  # the transports import it from here too

PROTOCOL_VERSION = 2
"""The fabric protocol's version (docs/weights-format.md): 2 added delta versions."""
DEFAULT_BUCKET_MB = 64.0


def check_protocol(version: int) -> None:
    """`SyncFailed` with a clear message unless the sender speaks this `PROTOCOL_VERSION`."""
    if version != PROTOCOL_VERSION:
        raise SyncFailed(f"the sender speaks fabric sync protocol {version}, this rft-hpc "
                         f"{PROTOCOL_VERSION}: run the same rft-hpc version on the trainer "
                         "and the explorers")


@dataclass(frozen=True)
class Layout:
    """The header of a sync: tensor names, dtypes and shapes (in send order) and bucket size."""

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    bucket_bytes: int

    @classmethod
    def of(cls, state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> Layout:
        """The layout of `state_dict` (insertion order) with buckets of `bucket_bytes`."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        return cls(tuple((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state_dict.items()),
                   bucket_bytes)

    def to_json(self) -> bytes:
        """The layout as compact JSON (what travels)."""
        return json.dumps({"protocol": PROTOCOL_VERSION, "bucket_bytes": self.bucket_bytes,
                           "tensors": [list(t) for t in self.tensors]},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Layout:
        """Parse `to_json`'s output; `SyncFailed` for a layout of another protocol version."""
        obj = json.loads(data)
        check_protocol(obj.get("protocol", 0))
        return cls(tuple((n, d, tuple(s)) for n, d, s in obj["tensors"]), obj["bucket_bytes"])

    def digest(self) -> str:
        """A short hash of the layout: equal layouts, equal digests."""
        return hashlib.sha1(self.to_json()).hexdigest()[:16]

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data a sync with this layout moves."""
        return sum(_nbytes(d, s) for _, d, s in self.tensors)


@dataclass(frozen=True)
class Piece:
    """One broadcast: `(tensor index, byte offset, bytes)` runs of one dtype, concatenated."""

    dtype: str
    runs: tuple[tuple[int, int, int], ...]
    nbytes: int
    packed: bool


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n


def plan(layout: Layout) -> list[Piece]:
    """The broadcasts of a sync, in order; sender and receivers compute the same list."""
    pieces: list[Piece] = []
    by_dtype: dict[str, list[int]] = {}
    for i, (_, dtype, _) in enumerate(layout.tensors):
        by_dtype.setdefault(dtype, []).append(i)
    cap = layout.bucket_bytes
    for dtype, indices in by_dtype.items():
        bucket: list[tuple[int, int, int]] = []
        filled = 0
        for i in indices:
            size = _nbytes(dtype, layout.tensors[i][2])
            if size == 0:
                continue
            if 2 * size >= cap:
                for off in range(0, size, cap):
                    n = min(cap, size - off)
                    pieces.append(Piece(dtype, ((i, off, n),), n, False))
                continue
            if filled + size > cap:
                pieces.append(Piece(dtype, tuple(bucket), filled, True))
                bucket, filled = [], 0
            bucket.append((i, 0, size))
            filled += size
        if bucket:
            pieces.append(Piece(dtype, tuple(bucket), filled, True))
    return pieces


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8)


def sender_tensors(state_dict: Mapping[str, torch.Tensor],
                   device: torch.device) -> list[torch.Tensor]:
    """The tensors of `state_dict` on `device`, contiguous (copies only where needed)."""
    return [t.detach().to(device).contiguous() for t in state_dict.values()]


def source_buffers(pieces: list[Piece], tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The sender's uint8 buffer of each piece: a view for big tensors, a packed copy else."""
    for p in pieces:
        views = [byte_view(tensors[i])[off:off + n] for i, off, n in p.runs]
        yield torch.cat(views) if p.packed else views[0]


class Destination:
    """Receiver-side storage of one sync: the new tensors and each piece's target bytes.

    Big tensors get their own storage; packed tensors are views of their bucket's buffer, so
    receiving costs no copy.
    """

    def __init__(self, layout: Layout, pieces: list[Piece], device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.tensors: list[torch.Tensor | None] = [None] * len(layout.tensors)
        self.buffers: list[torch.Tensor] = []
        for p in pieces:
            dtype = getattr(torch, p.dtype)
            if p.packed:
                buf = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                pos = 0
                for i, _, n in p.runs:
                    self.tensors[i] = buf[pos:pos + n].view(dtype).reshape(layout.tensors[i][2])
                    pos += n
                self.buffers.append(buf)
            else:
                i, off, n = p.runs[0]
                if self.tensors[i] is None:
                    self.tensors[i] = torch.empty(layout.tensors[i][2], dtype=dtype,
                                                  device=device)
                self.buffers.append(byte_view(self.tensors[i])[off:off + n])
        for i, (_, dtype, shape) in enumerate(layout.tensors):
            if self.tensors[i] is None:  # empty tensors travel as their header entry only
                self.tensors[i] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The received tensors by name, in the sender's order."""
        return {name: t for (name, _, _), t in zip(self.layout.tensors, self.tensors,
                                                    strict=True) if t is not None}


class BufferPool:
    """Receive buffers handed back by the caller, reused by later receives of the same layout.

    Receiving into fresh memory costs a page fault per page on CPUs, about as long as the
    transfer itself; a receiver whose caller gives its buffers back (`give_back`, once the
    engine has copied the weights in) receives the next version into the same, already
    mapped, memory. A state dict not given back is never overwritten: the pool remembers
    only the last `lent` dicts it handed out (holding them), and forgets older ones. Thread-
    safe: a background receiver takes buffers while the explorer gives others back.
    """

    def __init__(self, lent: int = 2, spares: int = 2) -> None:
        self._max_lent, self._spares = lent, spares
        self._lock = threading.Lock()
        self._free: dict[str, list[Destination]] = {}
        # id -> (the dict itself, so that its id stays unique while remembered; its buffers)
        self._lent: OrderedDict[int, tuple[dict[str, torch.Tensor], Destination]] = \
            OrderedDict()

    @staticmethod
    def _key(layout: Layout, device: torch.device) -> str:
        return f"{layout.digest()}@{device}"

    def get(self, layout: Layout, pieces: list[Piece], device: torch.device) -> Destination:
        """A destination for one sync of `layout`: a given-back one if any, else new."""
        with self._lock:
            free = self._free.get(self._key(layout, device))
            dest = free.pop() if free else None
        return dest or Destination(layout, pieces, device)

    def lend(self, dest: Destination) -> dict[str, torch.Tensor]:
        """`dest`'s state dict, remembered so that `give_back` can recognise it."""
        state = dest.state_dict()
        with self._lock:
            self._lent[id(state)] = (state, dest)
            while len(self._lent) > self._max_lent:
                self._lent.popitem(last=False)
        return state

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Let a later receive overwrite the buffers of `state_dict` (a dict `lend` returned;
        anything else is ignored). The caller must not use its tensors afterwards."""
        with self._lock:
            lent = self._lent.pop(id(state_dict), None)
            if lent is not None:
                dest = lent[1]
                free = self._free.setdefault(self._key(dest.layout, dest.device), [])
                if len(free) < self._spares:
                    free.append(dest)


def crc32_of(buffers: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """zlib CRC-32 of the concatenated bytes of uint8 tensors (copied off a GPU if needed)."""
    crc = 0
    for b in buffers:
        if b.numel():
            crc = zlib.crc32(memoryview(b.cpu().numpy()), crc)
    return crc


class BackgroundReceiver:
    """Receives versions on a daemon thread while the explorer keeps generating.

    The explorer calls `take()` at a step boundary and swaps in what it returns: the newest
    version received since the last call (older ones are dropped). Failed syncs are kept in
    `failures` (`SyncFailed`, with the version when known): load that version through the
    `checkpoint` method instead.
    """

    def __init__(self, receiver: WeightReceiver, poll: float = 0.2) -> None:
        self.receiver = receiver
        self.failures: list[SyncFailed] = []
        self._poll = poll
        self._lock = threading.Lock()
        self._newest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.receiver.receive(wait=self._poll)
            except SyncFailed as e:
                with self._lock:
                    self.failures.append(e)
                continue
            except BaseException as e:  # surfaced by take(): a bug must not be silent
                self._error = e
                return
            if got is not None:
                with self._lock:
                    dropped, self._newest = self._newest, got
                if dropped is not None:  # superseded before anyone took it
                    self.receiver.give_back(dropped[1])
        self.receiver.close()

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version received since the last call, or None; re-raises a crash.
        Give its state dict back (`give_back`) once the engine has copied it in."""
        if self._error is not None:
            raise RuntimeError("the weight-sync thread crashed") from self._error
        with self._lock:
            got, self._newest = self._newest, None
        return got

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The receiver may receive a later version into `state_dict`'s buffers."""
        self.receiver.give_back(state_dict)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread (after the receive in progress) and close the receiver."""
        self._stop.set()
        self._thread.join(timeout)

