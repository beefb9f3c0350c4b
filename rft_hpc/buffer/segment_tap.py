"""Segments written in this process, handed to a reader in this process before their file.

In the colocated placement (docs/colocated.md) the explorer's writer and the trainer's
reader share a process, and strictly on-policy they take turns: every millisecond between
the explorer's last token and the trainer's first op is on the loop's critical path.
Writing a segment file (~2.5 ms of HDF5 calls), committing it (fsync and rename) and
reading it back (open, read, checksums) are not needed to hand the records over. When the
tap is on (`enable`), the writer offers each segment's columns as a reader would read them
(`offer`), keyed by the segment's final path, before it writes the file, and a reader
takes them (`take`) at once: an offer pokes the folder watches of this process's readers
(`core.watch.FolderWatch.poke`).

The reader may train on records whose file is not committed yet, but its position never
gets into a checkpoint ahead of the files: `BufferReader.state_dict` waits until every
segment it took is committed (`wait_committed`), and raises the writer's error if one
never will be. A process killed before that point restarts from the checkpoint before it
(the ledger voids the later steps) and its explorer redoes the uncommitted steps; a
restarted process (an empty tap) reads the files.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from rft_hpc.buffer.segment import Segment
from rft_hpc.core.watch import FolderWatch


@dataclass
class _Offer:
    segment: Segment | None  # None once taken (or given up)
    settled: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None


_lock = threading.Lock()
_offers: dict[Path, _Offer] = {}
_enabled = False
_watches: weakref.WeakSet[FolderWatch] = weakref.WeakSet()


def enable() -> None:
    """Turn the tap on for this process (writers offer, readers take)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    """Whether writers of this process offer their segments."""
    return _enabled


def wake_on_offer(watch: FolderWatch) -> None:
    """Poke `watch` at every offer (a reader's watch: its waits end at once)."""
    _watches.add(watch)


def offer(segment: Segment) -> None:
    """The segment about to be written and committed at `segment.path`. Offered again (its
    file written again after a transient error), it replaces an offer not yet taken."""
    with _lock:
        current = _offers.get(segment.path)
        if current is None or current.segment is not None:
            _offers[segment.path] = _Offer(segment)
    for watch in list(_watches):
        watch.poke()


def committed(path: Path) -> None:
    """The segment offered for `path` is committed: a reader that took it may say so."""
    _settle(path, None)


def failed(path: Path, failure: BaseException) -> None:
    """The segment offered for `path` will not be committed (`failure` says why): it is
    withdrawn, and a reader that took it gets `failure` from `wait_committed`."""
    _settle(path, failure)


def _settle(path: Path, failure: BaseException | None) -> None:
    with _lock:
        entry = _offers.get(path)
        if entry is None:
            return
        if failure is not None:  # withdrawn: never handed out now
            entry.segment, entry.failure = None, failure
        entry.settled.set()


def take(path: Path) -> Segment | None:
    """The segment offered for `path` (once), committed or not; None: read the file."""
    with _lock:
        entry = _offers.get(path)
        if entry is None or entry.segment is None:
            return None
        segment, entry.segment = entry.segment, None
        if entry.settled.is_set():
            del _offers[path]
        return segment


def wait_committed(paths: list[Path]) -> None:
    """Block until the segments taken for `paths` are committed; raises the writer's error
    for one that will not be."""
    for path in paths:
        with _lock:
            entry = _offers.get(path)
        if entry is None:  # taken after its commit
            continue
        entry.settled.wait()
        with _lock:
            _offers.pop(path, None)
        if entry.failure is not None:
            raise entry.failure
