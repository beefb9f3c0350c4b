"""The trainer's view of the buffer: discover committed segments, hand out records by policy.

Discovery costs one listing of the buffer folder plus one `stat` per writer per poll: each
writer's next segment is found by name (its first step is the previous segment's
`step_end`), never by listing what was already consumed. Archives (consumed segments folded
together by `compact`) are found by the one listing of each writer folder a reader makes,
or by a new listing when a segment it expects has gone into an archive; their records keep
their segment's identity. The reader's whole position is
`state_dict()`, plain JSON that goes into the trainer checkpoint; a reader built from it
hands out exactly the records the saved one had not yet handed out, in the same order.

Reads retry before they judge (`rft_hpc.core.retry`): only a segment proven corrupt is
skipped (and quarantined). One whose I/O errors outlast the retries stays pending: the
reader stops at it for that writer and reads it again at a poll `RetryPolicy.later_s` on,
so a passing filesystem fault delays records and never loses them.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rft_hpc.buffer import segment_tap
from rft_hpc.buffer.archive import archive_name, list_writer, read_archive
from rft_hpc.buffer.layout import quarantine_segment, writer_names
from rft_hpc.buffer.records import Record
from rft_hpc.buffer.sampling import PoolItem, build_pool
from rft_hpc.buffer.segment import CorruptSegment, Segment, read_segment, segment_name
from rft_hpc.config.buffer import BufferConfig
from rft_hpc.core.retry import ReadRetry, RetryPolicy, StillUnreadable, io_metrics
from rft_hpc.core.watch import FolderWatch

log = logging.getLogger(__name__)

CURSOR_VERSION = 1


@dataclass(frozen=True)
class RecordRef:
    """Where a record lives: writer folder, segment (its first step), index in the segment."""

    writer: str
    segment: int
    index: int

    def __str__(self) -> str:
        return f"{self.writer}/{self.segment}/{self.index}"


@dataclass
class Batch:
    """Records handed out by one `take`, with where they came from and their sample weights."""

    records: list[Record] = field(default_factory=list)
    refs: list[RecordRef] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    uses: list[int] = field(default_factory=list)
    """How many times each record had been handed out before (0 = first time)."""
    dropped_stale: int = 0

    def __len__(self) -> int:
        return len(self.records)


class BufferReader:
    """Reads a buffer folder with a sampling policy, staleness bound and replay limit.

    `poll()` discovers new committed segments (at most `max_pending` records are held in
    memory; the rest wait on disk). `take(n, policy_version)` hands out up to `n` records.
    A segment proven corrupt is skipped with a warning (and moved to quarantine when
    `quarantine` is set); reading goes on with the writer's next segment. A segment that
    cannot be read for now (I/O errors beyond `retry`'s tries) is read again later.
    """

    def __init__(self, buffer_dir: str | os.PathLike[str], config: BufferConfig | None = None,
                 *, state: dict[str, Any] | None = None, max_pending: int = 1 << 16,
                 quarantine: bool = False, retry: RetryPolicy | None = None) -> None:
        self.buffer_dir = Path(buffer_dir)
        self.config = config or BufferConfig()
        self.max_pending = max_pending
        self.quarantine = quarantine
        self._pool = build_pool(self.config.sampler)
        self._next: dict[str, int] = {}
        self._listed: dict[str, int] = {}  # writer -> last segment seen by its one listing
        self._archives: dict[str, dict[int, int]] = {}  # writer -> archive start -> end
        self._stuck: dict[str, list[int]] = {}  # writer -> [segment, size, mtime_ns] unreadable
        self._cache: dict[tuple[str, int], Segment] = {}
        self._refs: Counter[tuple[str, int]] = Counter()
        self.skipped: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()
        self._watch: FolderWatch | None = None
        self._later: dict[tuple[str, int], float] = {}  # unreadable for now -> when to retry
        self._tapped: list[Path] = []  # taken from the segment tap, maybe not yet committed
        if state is not None:
            self._load_state(state)
        self._retry = ReadRetry(self.counters, retry)

    # -- discovery ---------------------------------------------------------------------

    def poll(self) -> int:
        """Discover newly committed segments; return how many records were added."""
        added = 0
        for writer in writer_names(self.buffer_dir):
            if writer not in self._listed and not self._first_look(writer):
                continue
            while len(self._pool) < self.max_pending:
                n = self._poll_one(writer)
                if n is None:
                    break
                added += n
        return added

    def reached(self, writer: str, step: int) -> bool:
        """Whether this reader has read (or moved past) every step of `writer` before
        `step`."""
        return step <= 0 or self._next.get(writer, 0) >= step

    @property
    def changes(self) -> FolderWatch:
        """A watch on the buffer folder and its writers' folders (made on first use, kept
        up to date by `poll`): a waiter for new segments wakes as soon as one is committed
        on this node (`core.watch`), or offered in this process (`segment_tap`)."""
        if self._watch is None:
            self._watch = FolderWatch(self.buffer_dir,
                                      *(self.buffer_dir / w for w in self._listed))
            if segment_tap.enabled():  # a segment offered in memory wakes it too
                segment_tap.wake_on_offer(self._watch)
        return self._watch

    def _first_look(self, writer: str) -> bool:
        """List a writer's folder once per reader object: where to start, what exists.

        A new reader starts at the writer's first segment. The listing also lets a reader
        move past a hole (a segment quarantined by another process, before this reader or
        while it was stopped) instead of waiting for that segment for ever. False if the
        writer has no segment yet.
        """
        files = list_writer(self.buffer_dir / writer)
        first = files.first
        if first is None:
            return False
        self._next.setdefault(writer, first)
        self._listed[writer] = max(s for s, _ in files.files())
        self._archives[writer] = dict(files.archives)
        if self._watch is not None:
            self._watch.add(self.buffer_dir / writer)
        return True

    def _poll_one(self, writer: str) -> int | None:
        """Read the writer's next segment; the number of records added, or None to stop."""
        start = self._next[writer]
        if self._later.get((writer, start), 0.0) > time.monotonic():
            return None
        self._later.pop((writer, start), None)  # its time came: read it again
        end = self._archives[writer].get(start)
        if end is not None:
            return self._read_archive(writer, (start, end), start)
        path = self.buffer_dir / writer / segment_name(start)
        offered = segment_tap.take(path)
        if offered is not None:  # written in this process: its columns, maybe before the file
            self._tapped.append(path)
            self._next[writer] = offered.step_end
            return self._add_segment(writer, offered)
        try:
            st = self._retry.read("segment", path, lambda: os.stat(path))
        except StillUnreadable as exc:
            return self._read_later(writer, start, path, exc)
        except FileNotFoundError:
            if writer in self._stuck:
                return self._skip_if_superseded(writer, start)
            if self._listed[writer] > start:  # a hole: listed later segments exist
                return self._skip_if_superseded(writer, start, "missing")
            return None
        if self._stuck.get(writer) == [start, st.st_size, st.st_mtime_ns]:
            return self._skip_if_superseded(writer, start)
        try:
            seg = read_segment(path, retry=self._retry)
            if seg.step_start != start or seg.step_end <= start:
                raise CorruptSegment(path, f"steps [{seg.step_start}, {seg.step_end}) do not "
                                           f"match its name")
        except StillUnreadable as exc:
            if exc.errno == errno.ENOENT:  # folded into an archive, or set aside, after the stat
                return self._skip_if_superseded(writer, start, "missing")
            return self._read_later(writer, start, path, exc)
        except CorruptSegment as exc:
            if not path.exists():  # folded into an archive after the stat
                return self._skip_if_superseded(writer, start, "missing")
            log.warning("skipping %s", exc)
            self.counters["corrupt_segments"] += 1
            self._stuck[writer] = [start, st.st_size, st.st_mtime_ns]
            if self.quarantine:
                quarantine_segment(self.buffer_dir, path, f"found by a reader: {exc.reason}")
            return self._skip_if_superseded(writer, start, exc.reason)
        self._stuck.pop(writer, None)
        self._next[writer] = seg.step_end
        return self._add_segment(writer, seg)

    def _read_later(self, writer: str, start: int, path: Path, exc: StillUnreadable) -> None:
        """Leave an unreadable-for-now file pending: this writer's reading stops at it until
        a poll `later_s` seconds on reads it again. Nothing is skipped or quarantined."""
        wait = self._retry.policy.later_s
        log.warning("%s: %s; not quarantined: left pending, read again in %.0f s",
                    path, exc.strerror, wait)
        self.counters["reads_deferred"] += 1
        self._later[writer, start] = time.monotonic() + wait
        return None

    def _skip_if_superseded(self, writer: str, start: int,
                            reason: str = "unreadable") -> int | None:
        """Past an unreadable segment, move on once the writer has committed a later one;
        read on from the archive that now holds the segment, if there is one."""
        files = list_writer(self.buffer_dir / writer)
        self._archives[writer] = dict(files.archives)
        span = files.archive_covering(start)
        if span is not None:
            self._stuck.pop(writer, None)
            return self._read_archive(writer, span, start)
        later = [s for s, _ in files.files() if s > start]
        if not later:
            return None
        self.skipped.append({"writer": writer, "segment": start, "reason": reason})
        self.counters["skipped_segments"] += 1
        self._stuck.pop(writer, None)
        self._next[writer] = later[0]
        return 0

    def _read_archive(self, writer: str, span: tuple[int, int], start: int) -> int | None:
        """Add the archived segments from step `start` on; the reader goes on at its end."""
        path = self.buffer_dir / writer / archive_name(*span)
        try:
            parts = read_archive(path, retry=self._retry)
        except StillUnreadable as exc:
            if exc.errno == errno.ENOENT:  # merged into a larger archive meanwhile
                return self._skip_if_superseded(writer, start, "missing")
            return self._read_later(writer, start, path, exc)
        except CorruptSegment as exc:
            if not path.exists():  # merged into a larger archive meanwhile: look again
                return self._skip_if_superseded(writer, start, "missing")
            log.warning("skipping %s", exc)
            self.counters["corrupt_segments"] += 1
            if self.quarantine:
                quarantine_segment(self.buffer_dir, path, f"found by a reader: {exc.reason}")
            self.skipped.append({"writer": writer, "segment": start, "reason": exc.reason})
            self._next[writer] = span[1]
            return 0
        self._next[writer] = span[1]
        self.counters["archives_read"] += 1
        return sum(self._add_segment(writer, p) for p in parts if p.step_start >= start)

    def _add_segment(self, writer: str, seg: Segment) -> int:
        cols = seg.columns
        n = seg.num_records
        versions = cols["policy_version"].tolist() if "policy_version" in cols else [None] * n
        priorities = cols["priority"].tolist() if "priority" in cols else [0.0] * n
        start = seg.step_start
        add = self._pool.add
        added = 0
        for i, (taskset, version, priority) in enumerate(
                zip(cols["taskset"], versions, priorities, strict=True)):
            if add(PoolItem(writer, start, i, taskset=taskset, version=version,
                            priority=priority)):
                added += 1
        if added < n:
            self.counters["not_in_mixture"] += n - added
        key = (writer, seg.step_start)
        if added:
            self._cache[key] = seg
            self._refs[key] += added
        self.counters["segments_read"] += 1
        self.counters["records_read"] += n
        self.counters["bytes_read"] += seg.nbytes
        return added

    # -- handing out -------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records discovered and still to be handed out (counting allowed replays once),
        plus one for each file left unreadable for now: its records are still to come, so a
        reader with any is never out of data."""
        return len(self._pool) + len(self._later)

    def take(self, n: int, policy_version: int | None = None) -> Batch:
        """Hand out up to `n` records in policy order (fewer if fewer are available).

        With `policy_version` and `max_staleness` set, a record whose policy lag exceeds the
        bound is dropped or down-weighted as configured. A record goes back into the pool
        until it has been handed out `max_uses` times.
        """
        cfg = self.config
        batch = Batch()
        replays: list[PoolItem] = []  # requeued after the loop: never twice in one batch
        later: list[PoolItem] = []  # their segment is unreadable for now: back in the pool
        while len(batch) < n:
            item = self._pool.pop()
            if item is None:
                break
            weight = 1.0
            if cfg.max_staleness is not None and policy_version is not None \
                    and item.version is not None:
                excess = policy_version - item.version - cfg.max_staleness
                if excess > 0:
                    if cfg.stale == "drop":
                        batch.dropped_stale += 1
                        self._release(item)
                        continue
                    weight = cfg.stale_weight ** excess
            key = (item.writer, item.segment)
            if self._later.get(key, 0.0) > time.monotonic():
                later.append(item)
                continue
            self._later.pop(key, None)
            seg = self._segment(item)
            if seg is None:
                if key in self._later:  # unreadable for now, not lost
                    later.append(item)
                continue
            batch.records.append(seg.record(item.index))
            batch.refs.append(RecordRef(item.writer, item.segment, item.index))
            batch.weights.append(weight)
            batch.uses.append(item.uses)
            item.uses += 1
            if item.uses < cfg.max_uses:
                replays.append(item)
            else:
                self._release(item)
        for item in replays:
            self._pool.requeue(item)
        for item in later:
            self._pool.add(item)
        self.counters["taken"] += len(batch)
        self.counters["dropped_stale"] += batch.dropped_stale
        return batch

    def _segment(self, item: PoolItem) -> Segment | None:
        key = (item.writer, item.segment)
        seg = self._cache.get(key)
        if seg is not None:
            return seg
        path = self.buffer_dir / item.writer / segment_name(item.segment)
        try:  # only after a restore: the segment was read and checked before the save
            if not path.exists():
                return self._from_archive(item)
            seg = self._cache[key] = read_segment(path, retry=self._retry)
        except StillUnreadable as exc:  # `take` keeps the record for later
            return self._read_later(item.writer, item.segment, path, exc)
        except CorruptSegment as exc:
            log.warning("lost a pending record: %s", exc)
            self.counters["lost_records"] += 1
            self._release(item)
            return None
        return seg

    def _from_archive(self, item: PoolItem) -> Segment | None:
        """A pending record's segment from the archive that now holds it (after a restore
        from a cursor older than a compaction); caches every archived segment still needed."""
        files = list_writer(self.buffer_dir / item.writer)
        span = files.archive_covering(item.segment)
        if span is not None:
            for part in read_archive(self.buffer_dir / item.writer / archive_name(*span),
                                     retry=self._retry):
                if self._refs.get((item.writer, part.step_start)):
                    self._cache[item.writer, part.step_start] = part
        seg = self._cache.get((item.writer, item.segment))
        if seg is None:
            raise CorruptSegment(self.buffer_dir / item.writer / segment_name(item.segment),
                                 "missing, and in no archive")
        return seg

    def _release(self, item: PoolItem) -> None:
        key = (item.writer, item.segment)
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            self._cache.pop(key, None)

    def io_metrics(self, *others: Counter[str]) -> dict[str, int]:
        """This reader's retried reads (`core.retry.io_metrics`, with those of `others`
        added: the process's other reads and writes) and the reads it left pending for a
        later poll, as metric values."""
        return {**io_metrics(self.counters, *others),
                "reads_deferred": int(self.counters["reads_deferred"])}

    # -- cursor ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The reader's full position as JSON-serializable data (the cursor); it waits until
        every segment this reader took from the segment tap is committed, so that a
        checkpoint of it never runs ahead of the files."""
        segment_tap.wait_committed(self._tapped)
        self._tapped.clear()
        return {
            "cursor_version": CURSOR_VERSION,
            "sampler": self.config.sampler.type,
            "next_segment": dict(self._next),
            "stuck": dict(self._stuck),
            "pool": self._pool.state(),
            "skipped": list(self.skipped),
            "counters": dict(self.counters),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        if state.get("cursor_version") != CURSOR_VERSION:
            raise ValueError(f"unsupported cursor version {state.get('cursor_version')!r}")
        if state["sampler"] != self.config.sampler.type:
            raise ValueError(f"cursor was saved with sampler {state['sampler']!r}, config says "
                             f"{self.config.sampler.type!r}")
        self._next = {k: int(v) for k, v in state["next_segment"].items()}
        self._stuck = {k: list(v) for k, v in state["stuck"].items()}
        self._pool.load_state(state["pool"])
        self.skipped = list(state["skipped"])
        self.counters = Counter(state["counters"])
        for item in self._pool.items():
            self._refs[(item.writer, item.segment)] += 1
