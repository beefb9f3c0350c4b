"""What `rft-hpc audit` needs to know of a buffer: every committed segment's size, steps and
policy versions (segments held by archives included), and which were quarantined.

A segment proven corrupt counts as lost; one that I/O errors keep unreadable through the
retries stops the audit (`LedgerError`): its records are not lost, only not readable now."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rft_hpc.buffer.archive import archive_name, list_writer, read_archive, read_archive_index
from rft_hpc.buffer.layout import QUARANTINE, writer_names
from rft_hpc.buffer.segment import (
    CorruptSegment,
    read_segment,
    read_segment_attrs,
    segment_name,
)
from rft_hpc.core.retry import StillUnreadable
from rft_hpc.ledger.replay import LedgerError

Ref = tuple[str, int, int]
"""A buffer record: (writer, segment's first step, index in the segment)."""

_QUARANTINED = re.compile(r"^(\d+)\.h5(\.\d+)?$")  # quarantine_segment adds .1, .2 on clashes


@dataclass
class SegmentInfo:
    """One committed segment: its records, and per record its step and policy version (kind
    `rl` only); `error` says why an unreadable segment could not be read."""

    step_end: int
    num_records: int
    steps: np.ndarray | None = None
    versions: np.ndarray | None = None
    error: str | None = None
    archive: str | None = None
    """The archive file that holds the segment (None: its own segment file)."""
    infos: list[str] | None = None
    """Per record its `info` JSON text (read only when asked: `scan_buffer(infos=True)`)."""


@dataclass
class BufferScan:
    """Every committed segment of a buffer, by (writer, first step), and the quarantined ones."""

    root: Path
    segments: dict[tuple[str, int], SegmentInfo] = field(default_factory=dict)
    quarantined: set[tuple[str, int]] = field(default_factory=set)
    _by_writer: dict[str, list[tuple[int, SegmentInfo]]] | None = field(default=None,
                                                                          repr=False)
    _indexed: int = field(default=0, repr=False)  # len(segments) when _by_writer was built

    def writers(self) -> list[str]:
        """Writers with committed segments, sorted."""
        return sorted({w for w, _ in self.segments})

    def writer_segments(self, writer: str) -> list[tuple[int, SegmentInfo]]:
        """(first step, segment) of one writer's committed segments, by step."""
        if self._by_writer is None or self._indexed != len(self.segments):
            by: dict[str, list[tuple[int, SegmentInfo]]] = {}
            for (w, s), info in self.segments.items():
                by.setdefault(w, []).append((s, info))
            self._by_writer = {w: sorted(v, key=lambda x: x[0]) for w, v in by.items()}
            self._indexed = len(self.segments)
        return self._by_writer.get(writer, [])

    def readable_records(self) -> int:
        """Records in segments that could be read."""
        return sum(s.num_records for s in self.segments.values() if s.error is None)

    def segment_path(self, writer: str, start: int) -> str:
        """The segment's path relative to the stage (`buffer/<writer>/<step>.h5`; an
        archived one's as `buffer/<writer>/<archive>#<step>`)."""
        info = self.segments.get((writer, start))
        if info is not None and info.archive is not None:
            return f"{self.root.name}/{writer}/{info.archive}#{start}"
        return f"{self.root.name}/{writer}/{segment_name(start)}"


def scan_buffer(buffer: Path, *, infos: bool = False) -> BufferScan:
    """Read every committed segment's step and policy_version columns (with `infos`, its
    records' info too; checksums checked);
    a corrupt segment is kept with its `error` (its records count as lost). Raises
    `LedgerError` when I/O errors keep a file unreadable through the retries."""
    try:
        return _scan(buffer, ("step", "policy_version", *(("info",) if infos else ())))
    except StillUnreadable as exc:
        raise LedgerError(f"cannot audit the buffer now: {exc.filename}: {exc.strerror}; "
                          "run the audit again") from exc


def _scan(buffer: Path, fields: tuple[str, ...]) -> BufferScan:
    scan = BufferScan(buffer)
    for writer in writer_names(buffer):
        files = list_writer(buffer / writer)
        for span in files.archives:
            _scan_archive(scan, writer, buffer / writer / archive_name(*span), span, fields)
        for start in files.segments:
            path = buffer / writer / segment_name(start)
            try:
                seg = read_segment(path, fields=fields)
            except CorruptSegment as exc:
                scan.segments[writer, start] = SegmentInfo(_step_end(path, start), 0,
                                                           error=exc.reason)
                continue
            scan.segments[writer, start] = SegmentInfo(
                seg.step_end, seg.num_records, seg.columns.get("step"),
                seg.columns.get("policy_version"), infos=_infos(seg.columns))
    quarantine = buffer / QUARANTINE
    if quarantine.is_dir():
        for writer in os.listdir(quarantine):
            if (quarantine / writer).is_dir():
                for name in os.listdir(quarantine / writer):
                    m = _QUARANTINED.match(name)
                    if m:
                        scan.quarantined.add((writer, int(m.group(1))))
    return scan


def _infos(columns: dict) -> list[str] | None:
    found = columns.get("info")
    return None if found is None else [str(x) for x in found]


def _scan_archive(scan: BufferScan, writer: str, path: Path, span: tuple[int, int],
                  fields: tuple[str, ...]) -> None:
    """Each segment an archive holds, as if it were a segment file of its own; an
    unreadable archive's segments (from its index, else its whole span) have `error` set."""
    try:
        parts = read_archive(path, fields=fields)
    except CorruptSegment as exc:
        try:
            starts = read_archive_index(path)
        except CorruptSegment:
            starts = [span[0]]
        ends = [*starts[1:], span[1]]
        for start, end in zip(starts, ends, strict=True):
            scan.segments[writer, start] = SegmentInfo(end, 0, error=exc.reason,
                                                       archive=path.name)
        return
    for p in parts:
        scan.segments[writer, p.step_start] = SegmentInfo(
            p.step_end, p.num_records, p.columns.get("step"), p.columns.get("policy_version"),
            archive=path.name, infos=_infos(p.columns))


def _step_end(path: Path, start: int) -> int:
    """A damaged segment's `step_end` if its attributes still read, else one step."""
    try:
        return int(read_segment_attrs(path)["step_end"])
    except (CorruptSegment, KeyError, TypeError, ValueError):
        return start + 1
