"""Archive files: the records of many consumed segments of one writer in one HDF5 file.

An archive has every dataset a segment of its kind has (so plain h5py reads it like one big
segment) plus three that name the segments folded into it: `segment_start`, `segment_end`
and `segment_records` (record boundaries: segment j holds archive records
`segment_records[j]:segment_records[j+1]`). A record keeps its identity (writer, segment's
first step, index in the segment) once archived, so cursors and ledgers need no change.

    <buffer>/<writer>/archive-<SSSSSSSS>-<EEEEEEEE>.h5   steps [S, E) of the folded segments

This module names, lists, reads and writes archives; `compact` decides what to fold.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from rft_hpc import __version__
from rft_hpc.buffer.segment import (
    LIBVER,
    SCHEMAS,
    BadContent,
    Segment,
    needed_version,
    parse_segment_name,
    read_judged,
    read_segment_once,
    segment_name,
)
from rft_hpc.core.retry import PROCESS_RETRY, Retrier

ARCHIVE_PREFIX = "archive-"
_NAME = re.compile(r"^archive-(\d+)-(\d+)\.h5$")
INDEX_DATASETS = (("segment_start", "<i8"), ("segment_end", "<i8"), ("segment_records", "<i8"))


def archive_name(step_start: int, step_end: int) -> str:
    """File name of the archive covering steps `[step_start, step_end)`."""
    return f"{ARCHIVE_PREFIX}{step_start:08d}-{step_end:08d}.h5"


def parse_archive_name(name: str) -> tuple[int, int] | None:
    """`(step_start, step_end)` of an archive's file name, or None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class WriterFiles:
    """What one listing of a writer folder shows, as readers must see it.

    `archives`: the committed archives no other archive contains, as (start, end), by start.
    `segments`: first steps of the committed segments outside every such archive, sorted.
    `covered_segments` / `covered_archives`: files whose records a committed archive also
    holds (left by a compaction that stopped before deleting them): never read them.
    """

    archives: list[tuple[int, int]] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    covered_segments: list[int] = field(default_factory=list)
    covered_archives: list[tuple[int, int]] = field(default_factory=list)

    def archive_covering(self, step: int) -> tuple[int, int] | None:
        """The archive whose steps include `step`, if any."""
        for a in self.archives:
            if a[0] <= step < a[1]:
                return a
        return None

    @property
    def first(self) -> int | None:
        """The first step of the first file (archive or segment), None for an empty writer."""
        starts = [a for a, _ in self.archives] + self.segments[:1]
        return min(starts) if starts else None

    @property
    def end(self) -> int:
        """The step after the last archive (0 without one): segments start at or after it."""
        return max((e for _, e in self.archives), default=0)

    def files(self) -> list[tuple[int, str]]:
        """(first step, file name) of every file to read, in step order."""
        out = [(a, archive_name(a, e)) for a, e in self.archives]
        out += [(s, segment_name(s)) for s in self.segments]
        return sorted(out)


def classify(names: Iterable[str]) -> WriterFiles:
    """Sort a writer folder's entry names into what to read and what is covered."""
    starts: list[int] = []
    spans: list[tuple[int, int]] = []
    for name in names:
        s = parse_segment_name(name)
        if s is not None:
            starts.append(s)
            continue
        span = parse_archive_name(name)
        if span is not None:
            spans.append(span)
    out = WriterFiles()
    # Widest first: an archive inside another was merged into it (its deletion pending).
    for a, e in sorted(spans, key=lambda x: (x[0], -x[1])):
        if out.archives and out.archives[-1][0] <= a and e <= out.archives[-1][1]:
            out.covered_archives.append((a, e))
        else:
            out.archives.append((a, e))
    for s in sorted(starts):
        (out.covered_segments if out.archive_covering(s) else out.segments).append(s)
    return out


def is_archive(path: Path) -> bool:
    """True when `path` names an archive file (else it is taken for a segment)."""
    return parse_archive_name(path.name) is not None


def list_writer(writer_dir: Path) -> WriterFiles:
    """One listing of a writer folder (with retries: `core.retry`), classified (empty for
    a missing folder)."""
    try:
        return classify(PROCESS_RETRY.read("writer folder", writer_dir,
                                           lambda: os.listdir(writer_dir)))
    except FileNotFoundError:
        return WriterFiles()


def _split(archive: Segment, index: dict[str, np.ndarray]) -> list[Segment]:
    """The archive's folded segments, each a `Segment` over views of the archive's columns."""
    schema = SCHEMAS[archive.kind]
    cols = archive.columns
    bounds = index["segment_records"]
    out = []
    for j, (start, end) in enumerate(zip(index["segment_start"].tolist(),
                                         index["segment_end"].tolist(), strict=True)):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        part: dict[str, object] = {}
        for g in schema.groups:
            if g.offsets not in cols:
                continue
            off = cols[g.offsets][lo:hi + 1]
            part[g.offsets] = off - off[0]
            for name, _ in (*g.columns, *g.optional):
                if name in cols:
                    part[name] = cols[name][off[0]:off[-1]]
        for name, _ in schema.scalars:
            if name in cols:
                part[name] = cols[name][lo:hi]
        for name in schema.strings:
            part[name] = cols[name][lo:hi]
        out.append(Segment(archive.path, archive.kind, archive.writer, start, end, part))
    return out


def read_archive(path: Path, *, fields: Iterable[str] | None = None,
                 retry: Retrier | None = None) -> list[Segment]:
    """Read an archive, check every checksum, and return its folded segments in step order.

    With `fields`, only those datasets (plus what they need) are read. Raises
    `CorruptSegment` on proof of damage, `StillUnreadable` when I/O errors outlast the
    retries (`segment.read_judged`).
    """
    wanted = None if fields is None else tuple(fields)
    return read_judged(path, lambda: _read_archive_once(path, wanted), retry=retry,
                       what="archive")


def _read_archive_once(path: Path, fields: tuple[str, ...] | None) -> list[Segment]:
    whole = read_segment_once(path, fields)
    with h5py.File(path, "r") as f:
        m = int(f.attrs["num_segments"])
        index = {name: _checked(f, name, dtype) for name, dtype in INDEX_DATASETS}
    n = len(whole.columns[SCHEMAS[whole.kind].strings[0]])
    b = index["segment_records"]
    if len(index["segment_start"]) != m or len(index["segment_end"]) != m or len(b) != m + 1 \
            or b[0] != 0 or b[-1] != n or np.any(np.diff(b) < 0):
        raise BadContent("archive index does not match its records")
    return _split(whole, index)


def read_archive_index(path: Path, *, retry: Retrier | None = None) -> list[int]:
    """First steps of the segments an archive holds (its index alone, checksum checked;
    verdicts as `read_archive`)."""
    def index() -> list[int]:
        with h5py.File(path, "r") as f:
            return _checked(f, "segment_start", "<i8").tolist()
    return read_judged(path, index, retry=retry, what="archive")


def _checked(f: h5py.File, name: str, dtype: str) -> np.ndarray:
    ds = f[name]
    arr = np.asarray(ds[()], dtype=dtype)
    if ds.dtype != np.dtype(dtype) or ds.ndim != 1 or \
            zlib.crc32(arr.tobytes()) != int(ds.attrs["crc32"]):
        raise BadContent(f"archive index {name}: bad type or checksum")
    return arr


def write_archive_file(path: Path, parts: list[Segment], *, writer: str) -> int:
    """Write the segments `parts` (in step order, one kind) as one archive file at `path`.

    Not fsynced, not committed. Each dataset is written part by part (no concatenated
    copy of the data). Returns the number of records.
    """
    kind = parts[0].kind
    schema = SCHEMAS[kind]
    if any(p.kind != kind for p in parts):
        raise ValueError("an archive holds records of one kind")
    counts = [p.num_records for p in parts]
    lengths: dict[str, int] = {}
    # an optional dataset that one part holds: in the archive, NaN for the parts without it
    optional = [c for g in schema.groups for c in g.optional
                if any(c[0] in p.columns for p in parts)]
    offsets_of = {name: g.offsets for g in schema.groups for name, _ in g.optional}
    for g in schema.groups:
        total = sum(int(p.columns[g.offsets][-1]) for p in parts)
        lengths[g.offsets] = sum(counts) + 1
        for name, _ in (*g.columns, *(c for c in g.optional if c in optional)):
            lengths[name] = total
    for name, _ in schema.scalars:
        lengths[name] = sum(counts)
    packed = {s: [_pack(p.columns[s]) for p in parts] for s in schema.strings}
    for s in schema.strings:
        lengths[s] = sum(len(x) for x in packed[s])
    dtypes = dict([c for g in schema.groups for c in g.columns] + optional
                  + list(schema.scalars))
    dtypes.update({g.offsets: "<i8" for g in schema.groups})
    dtypes.update({s: "|u1" for s in schema.strings})
    offsets = {g.offsets for g in schema.groups}
    with h5py.File(path, "w", libver=LIBVER, driver="sec2") as f:
        attrs = {"schema_version": needed_version(kind, lengths), "kind": kind, "writer": writer,
                 "step_start": parts[0].step_start, "step_end": parts[-1].step_end,
                 "num_records": sum(counts), "num_segments": len(parts),
                 "created": time.time(), "producer": f"rft-hpc {__version__}"}
        for key, value in attrs.items():
            f.attrs[key] = np.bytes_(value.encode()) if isinstance(value, str) else value
        names = schema.dataset_names(optional=True)
        for name in [n for n in names if n in lengths]:
            ds = f.create_dataset(name, shape=(lengths[name],), dtype=dtypes[name])
            crc, pos, base = 0, 0, 0
            if name in offsets:  # the leading 0; each part then adds its ends, shifted
                zero = np.zeros(1, dtype="<i8")
                ds[0:1] = zero
                crc, pos = zlib.crc32(zero.tobytes()), 1
            for k, p in enumerate(parts):
                if name in packed:
                    arr = packed[name][k]
                elif name in offsets:
                    arr = (p.columns[name][1:] + base).astype("<i8")
                    base = int(arr[-1]) if len(arr) else base
                elif name not in p.columns:  # an optional dataset this part lacks
                    arr = np.full(int(p.columns[offsets_of[name]][-1]), np.nan,
                                  dtype=dtypes[name])
                else:
                    arr = np.ascontiguousarray(p.columns[name], dtype=dtypes[name])
                if len(arr):
                    ds[pos:pos + len(arr)] = arr
                    crc = zlib.crc32(arr.tobytes(), crc)
                    pos += len(arr)
            ds.attrs["crc32"] = np.uint32(crc)
        bounds = np.zeros(len(parts) + 1, dtype="<i8")
        np.cumsum(counts, out=bounds[1:])
        index = {"segment_start": np.array([p.step_start for p in parts], dtype="<i8"),
                 "segment_end": np.array([p.step_end for p in parts], dtype="<i8"),
                 "segment_records": bounds}
        for name, arr in index.items():
            ds = f.create_dataset(name, data=arr)
            ds.attrs["crc32"] = np.uint32(zlib.crc32(arr.tobytes()))
    return sum(counts)


def _pack(values: list[str]) -> np.ndarray:
    """Strings as the segment format stores them: UTF-8 bytes, each followed by a NUL."""
    if not values:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(("\0".join(values) + "\0").encode("utf-8"), dtype=np.uint8)
