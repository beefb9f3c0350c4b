"""The single writer of one buffer folder: gathers steps into segments and commits them.

A writer owns `buffer/<writer>/` alone (the launcher guarantees one live process per name).
It writes each segment under a temporary name and commits it by rename, so a reader never
sees a torn record. A restarted writer removes the temporary files its dead predecessor left
and continues at the step after the last committed segment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rft_hpc.buffer import segment_tap
from rft_hpc.buffer.archive import list_writer
from rft_hpc.buffer.layout import ensure_buffer_dir, quarantine_segment
from rft_hpc.buffer.records import Record
from rft_hpc.buffer.segment import (
    CorruptSegment,
    Segment,
    read_segment_attrs,
    segment_name,
)
from rft_hpc.buffer.segment_write import write_segment_file
from rft_hpc.core.retry import PROCESS_RETRY
from rft_hpc.core.rundir import TEMP_PREFIX, commit_file, is_temporary, remove_tree
from rft_hpc.core.storage import raise_if_full

log = logging.getLogger(__name__)


class SegmentWriter:
    """Appends steps of records to `<buffer>/<writer>/` as committed segment files.

    `write_step(step, records)` must be called with consecutive steps starting at
    `next_step`; every `steps_per_segment` steps one segment is written and committed.
    `flush()` commits a partial segment (e.g. before a planned stop).

    With `background_commit`, the fsync and rename of a segment run on a helper thread
    while the caller goes on (an explorer generates its next step meanwhile); segments are
    still committed one at a time and in order, and `close()` waits for the last one. A
    failed background commit is raised by the next `flush`, `wait` or `close`; the writer is
    then unusable, and a new one recovers from what is on disk.
    """

    def __init__(self, buffer_dir: str | os.PathLike[str], writer: str, kind: str, *,
                 steps_per_segment: int = 1, durable: bool = True,
                 background_commit: bool = False) -> None:
        if not writer or "/" in writer or writer.startswith(".") or writer == "quarantine":
            raise ValueError(f"invalid writer name {writer!r}")
        self.buffer_dir = ensure_buffer_dir(Path(buffer_dir))
        self.writer = writer
        self.kind = kind
        self.steps_per_segment = steps_per_segment
        self.durable = durable
        self.dir = self.buffer_dir / writer
        self.dir.mkdir(exist_ok=True)
        self.removed_temporaries = self._remove_temporaries()
        self.committed_step = self._recover()
        """Every step below this one is committed (visible to readers)."""
        self._written_step = self.committed_step  # handed to a commit, maybe not finished
        self._pending: list[Record] = []
        self._pending_steps = 0
        self.bytes_written = 0
        self._committer = ThreadPoolExecutor(1, f"commit-{writer}") if background_commit \
            else None
        self._inflight: Future[None] | None = None

    @property
    def next_step(self) -> int:
        """The step `write_step` expects next."""
        return self._written_step + self._pending_steps

    def write_step(self, step: int, records: Sequence[Record]) -> Path | None:
        """Add one step's records; write a segment when enough steps are gathered.

        Returns the segment's path (committed, or being committed in the background), or
        None while the segment is still filling.
        """
        if step != self.next_step:
            raise ValueError(f"writer {self.writer}: got step {step}, expected {self.next_step}")
        self._pending.extend(records)
        self._pending_steps += 1
        if self._pending_steps >= self.steps_per_segment:
            return self.flush()
        return None

    def flush(self) -> Path | None:
        """Write the gathered steps as one segment now (nothing to do if none are pending)."""
        if not self._pending_steps:
            return None
        start, end = self._written_step, self.next_step
        final = self.dir / segment_name(start)
        tmp = self.dir / f"{TEMP_PREFIX}{final.name}.{os.getpid()}"
        offer = None
        if segment_tap.enabled():  # a reader in this process takes it before the file
            def offer(columns: dict[str, Any]) -> None:
                segment_tap.offer(Segment(final, self.kind, self.writer, start, end, columns))
        try:
            # written whole again (same temporary name) after a transient error
            self.bytes_written += PROCESS_RETRY.write("segment", tmp, lambda: write_segment_file(
                tmp, self.kind, self._pending, writer=self.writer, step_start=start,
                step_end=end, offer=offer))
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            segment_tap.failed(final, exc)
            raise_if_full(exc, final)  # a full disk: named with the segment (StorageFull)
            raise
        self._pending = []
        self._pending_steps = 0
        self._written_step = end
        if self._committer is None:
            self._commit(tmp, final, end)
        else:
            self.wait()  # one commit in flight at most: segments become visible in order
            self._inflight = self._committer.submit(self._commit, tmp, final, end)
        return final

    def _commit(self, tmp: Path, final: Path, end: int) -> None:
        try:
            commit_file(tmp, final, durable=self.durable)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            segment_tap.failed(final, exc)
            raise
        self.committed_step = end
        segment_tap.committed(final)

    def wait(self) -> None:
        """Block until the segment being committed in the background is visible."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()

    def close(self) -> None:
        """Commit what is gathered and wait until every segment is visible."""
        self.flush()
        self.wait()
        if self._committer is not None:
            self._committer.shutdown()

    def _remove_temporaries(self) -> list[str]:
        removed = sorted(e for e in os.listdir(self.dir) if is_temporary(e))
        for name in removed:
            path = self.dir / name
            if path.is_dir():
                remove_tree(path)
            else:
                path.unlink(missing_ok=True)
        if removed:
            log.info("writer %s: removed %d temporary file(s) of an earlier process",
                     self.writer, len(removed))
        return removed

    def _recover(self) -> int:
        """The step after the last committed segment or archive (0 for a new writer)."""
        files = list_writer(self.dir)
        starts = files.segments
        if not starts:
            return files.end
        last = self.dir / segment_name(starts[-1])
        try:
            return max(files.end, int(read_segment_attrs(last)["step_end"]))
        except (CorruptSegment, KeyError, ValueError) as exc:
            # The newest segment is unreadable: set it aside and redo its steps.
            reason = exc.reason if isinstance(exc, CorruptSegment) else f"bad attributes: {exc}"
            quarantine_segment(self.buffer_dir, last, f"found by restarted writer: {reason}")
            log.warning("writer %s: newest segment %s is corrupt (%s); quarantined, redoing "
                        "from step %d", self.writer, last.name, reason, starts[-1])
            return max(files.end, starts[-1])
