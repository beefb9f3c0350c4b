"""Compaction: fold a writer's consumed segments into archive files, never losing a record.

Protocol (docs/buffer-format.md, "Compaction"), per writer folder:

1. Recover: delete this module's own temporary files, and every segment or archive that a
   committed archive lists in its index (a compaction stopped before deleting its sources).
2. Fold: when at least `min_segments` committed segments lie wholly below the consumed bound,
   write them as one archive under a temporary name, fsync it, rename it into place and
   fsync the folder. Only then delete the segments (and fsync the folder again).
3. Merge: when `fanout` trailing archives are of the same size tier or below, fold them into
   one, the same way. Tiers grow geometrically, so a writer keeps a few archives per tier.

A crash at any moment leaves either the sources (and at most a temporary file, removed by
the next run) or a committed archive beside sources that readers skip because the archive
covers them (`archive.classify`) and the next run deletes.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft_hpc.buffer.archive import (
    WriterFiles,
    archive_name,
    classify,
    read_archive,
    read_archive_index,
    write_archive_file,
)
from rft_hpc.buffer.layout import quarantine_segment, writer_names
from rft_hpc.buffer.sampling import state_items
from rft_hpc.buffer.segment import CorruptSegment, Segment, read_segment, segment_name
from rft_hpc.config.buffer import CompactConfig
from rft_hpc.core.rundir import TEMP_PREFIX, commit_file, fsync_dir

log = logging.getLogger(__name__)

TEMP_ARCHIVE = f"{TEMP_PREFIX}archive-"


@dataclass
class CompactResult:
    """What one compaction did (summed over writers)."""

    archives: int = 0
    """Archives committed (folds and merges)."""
    segments_folded: int = 0
    archives_merged: int = 0
    records: int = 0
    """Records written into new archives."""
    removed: int = 0
    """Files deleted: folded sources, and leftovers of an interrupted compaction."""

    def add(self, other: CompactResult) -> None:
        """Add another result's counts to this one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def consumed_bounds(cursor: dict[str, Any]) -> dict[str, int]:
    """Writer -> the first step a reader cursor (`BufferReader.state_dict()`) may still need.

    Segments starting below it were read and every record of theirs was handed out for the
    last time (none is pending in the cursor's pool, none is a segment it waits behind).
    """
    bounds = {w: int(s) for w, s in cursor["next_segment"].items()}
    for item in state_items(cursor["pool"]):
        bounds[item.writer] = min(bounds.get(item.writer, item.segment), item.segment)
    for writer, stuck in cursor["stuck"].items():
        bounds[writer] = min(bounds.get(writer, int(stuck[0])), int(stuck[0]))
    return bounds


def tier(span: tuple[int, int], config: CompactConfig) -> int:
    """An archive's size tier from the steps it covers: 0 up to `fanout` x `min_segments`."""
    steps = max(1, span[1] - span[0])
    return max(0, int(math.log(steps / config.min_segments, config.fanout) + 1e-9))


def recover_writer(writer_dir: Path, *, durable: bool = True) -> tuple[WriterFiles, int]:
    """Finish or undo an interrupted compaction of one writer folder; (its files, removed).

    Deletes this module's temporary files, and each segment or archive whose every segment
    the covering committed archive's index lists. One listing, plus one index read per
    covering archive when leftovers exist.
    """
    names = os.listdir(writer_dir)
    removed = 0
    for name in names:
        if name.startswith(TEMP_ARCHIVE):
            (writer_dir / name).unlink(missing_ok=True)
            removed += 1
    files = classify(names)
    indexes: dict[tuple[int, int], set[int]] = {}

    def held(span: tuple[int, int] | None) -> set[int]:
        if span is None:
            return set()
        if span not in indexes:
            indexes[span] = set(read_archive_index(writer_dir / archive_name(*span)))
        return indexes[span]

    doomed: list[str] = []
    for s in files.covered_segments:
        if s in held(files.archive_covering(s)):
            doomed.append(segment_name(s))
        else:  # cannot happen under the protocol: keep the file, say so
            log.warning("%s/%s lies inside an archive that does not hold it; left alone",
                        writer_dir, segment_name(s))
    for span in files.covered_archives:
        inner = set(read_archive_index(writer_dir / archive_name(*span)))
        if inner <= held(files.archive_covering(span[0])):
            doomed.append(archive_name(*span))
        else:
            log.warning("%s/%s lies inside an archive that does not hold it; left alone",
                        writer_dir, archive_name(*span))
    _delete(writer_dir, doomed, durable)
    return files, removed + len(doomed)


def _delete(writer_dir: Path, names: list[str], durable: bool) -> None:
    for name in names:
        (writer_dir / name).unlink(missing_ok=True)
    if names and durable:
        fsync_dir(writer_dir)


def _commit_archive(writer_dir: Path, writer: str, parts: list[Segment],
                    durable: bool) -> tuple[int, int]:
    """Write `parts` as an archive and commit it; (step_start, step_end) of the archive."""
    span = (parts[0].step_start, parts[-1].step_end)
    final = writer_dir / archive_name(*span)
    tmp = writer_dir / f"{TEMP_PREFIX}{final.name}.{os.getpid()}"
    try:
        write_archive_file(tmp, parts, writer=writer)
        commit_file(tmp, final, durable=durable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return span


def compact_writer(buffer_dir: Path, writer: str, below: int, config: CompactConfig, *,
                   durable: bool = True) -> CompactResult:
    """Recover, then fold the writer's segments below step `below`, then merge archives."""
    wdir = buffer_dir / writer
    result = CompactResult()
    files, result.removed = recover_writer(wdir, durable=durable)
    consumed = [s for s in files.segments if s < below]
    if len(consumed) >= config.min_segments:
        parts: list[Segment] = []
        for s in consumed:
            try:
                seg = read_segment(wdir / segment_name(s))
            except CorruptSegment as exc:  # a reader skipped it already: set it aside
                quarantine_segment(buffer_dir, wdir / segment_name(s),
                                   f"found by compaction: {exc.reason}")
                continue
            if seg.step_end > below:
                break
            if parts and parts[-1].kind != seg.kind:
                break  # one kind per archive; the rest waits for the next run
            parts.append(seg)
        if parts:
            span = _commit_archive(wdir, writer, parts, durable)
            _delete(wdir, [segment_name(p.step_start) for p in parts], durable)
            files.archives.append(span)
            result.archives += 1
            result.segments_folded += len(parts)
            result.removed += len(parts)
            result.records += sum(p.num_records for p in parts)
    _merge(wdir, writer, files.archives, config, durable, result)
    return result


def _merge(wdir: Path, writer: str, archives: list[tuple[int, int]], config: CompactConfig,
           durable: bool, result: CompactResult) -> None:
    """Fold trailing archives of the last one's tier or below, `fanout` or more at a time."""
    archives.sort()
    while len(archives) >= config.fanout:
        top = tier(archives[-1], config)
        run = 0
        while run < len(archives) and tier(archives[-1 - run], config) <= top:
            run += 1
        if run < config.fanout:
            return
        sources = archives[-run:]
        parts = [p for span in sources for p in read_archive(wdir / archive_name(*span))]
        if len({p.kind for p in parts}) > 1:
            return
        span = _commit_archive(wdir, writer, parts, durable)
        _delete(wdir, [archive_name(*s) for s in sources], durable)
        del archives[-run:]
        archives.append(span)
        result.archives += 1
        result.archives_merged += run
        result.removed += run
        result.records += sum(p.num_records for p in parts)


class Compactor:
    """The trainer's compaction: after each checkpoint, fold what its saved cursor consumed.

    A writer folder is looked at (listed) the first time, then only once its consumed bound
    has moved `min_segments` steps since: at most one listing per writer per `min_segments`
    consumed steps, nothing per poll.
    """

    def __init__(self, buffer_dir: Path, config: CompactConfig, *, durable: bool = True) -> None:
        self.buffer_dir = buffer_dir
        self.config = config
        self.durable = durable
        self._done: dict[str, int] = {}  # writer -> consumed bound at its last compaction
        self.total = CompactResult()

    def run(self, cursor: dict[str, Any]) -> CompactResult:
        """Compact every writer the durable `cursor` has consumed enough of; never raises
        for a filesystem error (logged: the next run tries again)."""
        result = CompactResult()
        for writer, below in consumed_bounds(cursor).items():
            last = self._done.get(writer)
            if last is not None and below - last < self.config.min_segments:
                continue
            try:
                result.add(compact_writer(self.buffer_dir, writer, below, self.config,
                                          durable=self.durable))
            except (OSError, CorruptSegment) as exc:
                log.warning("compaction of %s stopped: %s (retried later)", writer, exc)
                continue
            self._done[writer] = below
        self.total.add(result)
        return result


def compact_buffer(buffer_dir: Path, cursor: dict[str, Any], config: CompactConfig, *,
                   durable: bool = True) -> CompactResult:
    """Compact every writer of a buffer as far as `cursor` consumed it (a one-off job)."""
    result = CompactResult()
    bounds = consumed_bounds(cursor)
    for writer in writer_names(buffer_dir):
        if writer in bounds:
            result.add(compact_writer(buffer_dir, writer, bounds[writer], config,
                                      durable=durable))
    return result
