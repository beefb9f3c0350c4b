"""The single writer of one buffer folder: gathers steps into segments and commits them.

A writer owns `buffer/<writer>/` alone (the launcher guarantees one live process per name).
It writes each segment under a temporary name and commits it by rename, so a reader never
sees a torn record. A restarted writer removes the temporary files its dead predecessor left
and continues at the step after the last committed segment.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from rft_hpc.buffer.layout import ensure_buffer_dir, quarantine_segment
from rft_hpc.buffer.records import Record
from rft_hpc.buffer.segment import (
    CorruptSegment,
    committed_segments,
    read_segment_attrs,
    segment_name,
    write_segment_file,
)
from rft_hpc.rundir import TEMP_PREFIX, commit_file, is_temporary

log = logging.getLogger(__name__)


class SegmentWriter:
    """Appends steps of records to `<buffer>/<writer>/` as committed segment files.

    `write_step(step, records)` must be called with consecutive steps starting at
    `next_step`; every `steps_per_segment` steps one segment is committed. `flush()` commits
    a partial segment (e.g. before a planned stop).
    """

    def __init__(self, buffer_dir: str | os.PathLike[str], writer: str, kind: str, *,
                 steps_per_segment: int = 1, durable: bool = True) -> None:
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
        """Every step below this one is committed."""
        self._pending: list[Record] = []
        self._pending_steps = 0
        self.bytes_written = 0

    @property
    def next_step(self) -> int:
        """The step `write_step` expects next."""
        return self.committed_step + self._pending_steps

    def write_step(self, step: int, records: Sequence[Record]) -> Path | None:
        """Add one step's records; commit a segment when enough steps are gathered.

        Returns the committed segment's path, or None while the segment is still filling.
        """
        if step != self.next_step:
            raise ValueError(f"writer {self.writer}: got step {step}, expected {self.next_step}")
        self._pending.extend(records)
        self._pending_steps += 1
        if self._pending_steps >= self.steps_per_segment:
            return self.flush()
        return None

    def flush(self) -> Path | None:
        """Commit the gathered steps as one segment now (nothing to do if none are pending)."""
        if not self._pending_steps:
            return None
        start, end = self.committed_step, self.next_step
        final = self.dir / segment_name(start)
        tmp = self.dir / f"{TEMP_PREFIX}{final.name}.{os.getpid()}"
        try:
            self.bytes_written += write_segment_file(
                tmp, self.kind, self._pending, writer=self.writer, step_start=start,
                step_end=end)
            commit_file(tmp, final, durable=self.durable)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.committed_step = end
        self._pending = []
        self._pending_steps = 0
        return final

    def _remove_temporaries(self) -> list[str]:
        removed = sorted(e for e in os.listdir(self.dir) if is_temporary(e))
        for name in removed:
            path = self.dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if removed:
            log.info("writer %s: removed %d temporary file(s) of an earlier process",
                     self.writer, len(removed))
        return removed

    def _recover(self) -> int:
        """The step after the last committed segment (0 for a new writer)."""
        starts = committed_segments(self.dir)
        if not starts:
            return 0
        last = self.dir / segment_name(starts[-1])
        try:
            return int(read_segment_attrs(last)["step_end"])
        except (CorruptSegment, KeyError, ValueError) as exc:
            # The newest segment is unreadable: set it aside and redo its steps.
            reason = exc.reason if isinstance(exc, CorruptSegment) else f"bad attributes: {exc}"
            quarantine_segment(self.buffer_dir, last, f"found by restarted writer: {reason}")
            log.warning("writer %s: newest segment %s is corrupt (%s); quarantined, redoing "
                        "from step %d", self.writer, last.name, reason, starts[-1])
            return starts[-1]
