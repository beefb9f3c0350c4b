"""One segment file: its schema and how it is read and checked (written by `segment_write`).

A segment holds the records of one writer for a range of steps `[step_start, step_end)`, in
one HDF5 file with one dataset per field (docs/buffer-format.md). Variable-length sequences
are stored flat with offsets; every dataset carries a `crc32` attribute that `read_segment`
checks, so flipped bytes are found rather than trained on.

Reads retry before they judge (`rft_hpc.core.retry`): a file is `CorruptSegment` only on
proof, a checksum or the format contradicted by bytes read whole (`BadContent`), or an HDF5
failure that repeats itself exactly when the file is read again. An I/O error that outlasts
the retries raises `StillUnreadable` instead: the file may be fine, read it again later.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import h5py
import numpy as np
from h5py import h5a, h5d, h5s

from rft_hpc.buffer.records import RECORD_TYPES, Record
from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import PROCESS_RETRY, Retrier, StillUnreadable, io_errno

SCHEMA_VERSION = 3
"""The newest segment schema this rft-hpc reads: 3 added the optional token-aligned datasets
(`SequenceGroup.optional`), which a reader of version 2 would ignore. A file says the
oldest version that reads it whole (`needed_version`)."""
LIBVER = ("v110", "v110")  # readable by any HDF5 >= 1.10; metadata carries checksums
_NAME = re.compile(r"^(\d+)\.h5$")

T = TypeVar("T")

_decode_json = json.JSONDecoder().raw_decode  # no whitespace scan: the writer adds none


def _info_dict(text: str) -> dict[str, Any]:
    return _decode_json(text)[0] if text != "{}" else {}


@dataclass(frozen=True)
class SequenceGroup:
    """Token-aligned columns that share one offsets dataset (record i = data[off[i]:off[i+1]])."""

    offsets: str
    columns: tuple[tuple[str, str], ...]
    optional: tuple[tuple[str, str], ...] = ()
    """Float columns a segment holds only when one of its records has them (a record's
    field None: absent); in a segment that holds one, NaN stands for a record without."""


@dataclass(frozen=True)
class KindSchema:
    """The datasets of one record kind: sequence groups, per-record numbers, per-record strings."""

    kind: str
    groups: tuple[SequenceGroup, ...]
    scalars: tuple[tuple[str, str], ...]
    strings: tuple[str, ...] = ("task_id", "taskset", "info")

    def dataset_names(self, optional: bool = False) -> list[str]:
        """The datasets every segment of the kind holds (with `optional`: and those it
        may hold), in file order."""
        names = []
        for g in self.groups:
            names += [g.offsets, *(c for c, _ in g.columns)]
            names += [c for c, _ in g.optional] if optional else []
        return names + [s for s, _ in self.scalars] + list(self.strings)


SCHEMAS: dict[str, KindSchema] = {
    "rl": KindSchema(
        "rl",
        (SequenceGroup("offsets", (("tokens", "<i4"), ("response_mask", "|u1"),
                                   ("logprobs", "<f4")), (("teacher_logprobs", "<f4"),)),),
        (("prompt_length", "<i4"), ("reward", "<f4"), ("group_id", "<i8"),
         ("policy_version", "<i8"), ("step", "<i8"), ("priority", "<f4"), ("created", "<f8")),
    ),
    "sft": KindSchema(
        "sft",
        (SequenceGroup("offsets", (("tokens", "<i4"), ("response_mask", "|u1"))),),
        (("prompt_length", "<i4"), ("created", "<f8")),
    ),
    "dpo": KindSchema(
        "dpo",
        (SequenceGroup("chosen_offsets", (("chosen_tokens", "<i4"),)),
         SequenceGroup("rejected_offsets", (("rejected_tokens", "<i4"),))),
        (("prompt_length", "<i4"), ("created", "<f8")),
    ),
}


def needed_version(kind: str, names: Collection[str]) -> int:
    """The schema version a file of `kind` with the datasets `names` says it is: 3 when it
    holds an optional dataset, else 2, so that an older rft-hpc still reads every file it
    can read whole and refuses the others."""
    optional = {c for g in SCHEMAS[kind].groups for c, _ in g.optional}
    return SCHEMA_VERSION if optional & set(names) else 2


class CorruptSegment(Exception):
    """A committed segment that cannot be read back intact (truncated, flipped bytes, ...)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"corrupt segment {path}: {reason}")
        self.path = path
        self.reason = reason


class UnsupportedSegment(UserError):
    """A segment written by a newer rft-hpc (higher schema_version) than this one."""


class BadContent(ValueError):
    """Bytes read whole that contradict their checksum or the format: proof of damage."""


def _is_proof(exc: BaseException) -> bool:
    return isinstance(exc, BadContent | UnsupportedSegment)


def read_judged(path: Path, read: Callable[[], T], *, retry: Retrier | None = None,
                what: str = "segment") -> T:
    """`read()` of the segment or archive file `path`, with retries, and the verdict on a
    failure: `CorruptSegment` on proof (`BadContent`, or a failure without an errno that
    repeats exactly), `UnsupportedSegment` as it is, `StillUnreadable` for I/O errors that
    outlast the tries (ENOENT included: the file was listed, so it existed) and for any
    other OS error (EACCES, EMFILE, ...), which says nothing about the file's bytes."""
    try:
        return (retry or PROCESS_RETRY).read(what, path, read, proof=_is_proof, existed=True)
    except (UnsupportedSegment, StillUnreadable):
        raise
    except Exception as exc:
        code = io_errno(exc)
        if code is not None:
            raise StillUnreadable(code, path, 1, exc) from exc
        raise CorruptSegment(path, f"{type(exc).__name__}: {exc}") from exc


def segment_name(step_start: int) -> str:
    """File name of the committed segment whose first step is `step_start`."""
    return f"{step_start:08d}.h5"


def parse_segment_name(name: str) -> int | None:
    """First step of a committed segment's file name, or None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def _crc_array(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


@dataclass
class Segment:
    """A committed segment read fully into memory and checked."""

    path: Path
    kind: str
    writer: str
    step_start: int
    step_end: int
    columns: dict[str, Any]
    _lists: dict[str, list[Any]] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)

    @property
    def num_records(self) -> int:
        return len(self.columns[SCHEMAS[self.kind].strings[0]])

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.columns.values() if isinstance(v, np.ndarray))

    def record(self, i: int) -> Record:
        """Record `i` of this segment (token arrays are views into the segment's columns)."""
        schema = SCHEMAS[self.kind]
        cols = self.columns
        lists = self._lists or self._make_lists()
        kwargs: dict[str, Any] = {}
        for g in schema.groups:
            off = lists[g.offsets]
            s, e = off[i], off[i + 1]
            for name, _ in g.columns:
                kwargs[name] = cols[name][s:e]
            for name, _ in g.optional:
                column = cols.get(name)
                part = None if column is None else column[s:e]
                kwargs[name] = None if part is None or np.isnan(part).all() else part
        for name, _ in schema.scalars:
            kwargs[name] = lists[name][i]
        for name in schema.strings:
            kwargs[name] = _info_dict(cols[name][i]) if name == "info" else cols[name][i]
        # The segment was checked as a whole when read (`_check_records`): build the record
        # without re-validating each field.
        record = object.__new__(RECORD_TYPES[self.kind])
        for name, value in kwargs.items():
            object.__setattr__(record, name, value)
        return record

    def _make_lists(self) -> dict[str, list[Any]]:
        """Offsets and number columns as Python lists, converted once for `record`."""
        schema = SCHEMAS[self.kind]
        for name in [g.offsets for g in schema.groups] + [n for n, _ in schema.scalars]:
            self._lists[name] = self.columns[name].tolist()
        return self._lists

    def records(self) -> list[Record]:
        return [self.record(i) for i in range(self.num_records)]


def _read_attrs(f: h5py.File) -> dict[str, Any]:
    """Every attribute of the file's root group, as Python values."""
    root = f["/"].id
    attrs = {}
    for i in range(h5a.get_num_attrs(root)):
        attr = h5a.open(root, index=i)
        value = np.empty(attr.shape, dtype=attr.dtype)
        attr.read(value)
        attrs[attr.name.decode("utf-8")] = _py(value[()])
        attr.close()
    return attrs


def read_segment_attrs(path: Path, *, retry: Retrier | None = None) -> dict[str, Any]:
    """The file attributes of a segment, without reading or checking its data (verdicts as
    `read_judged`)."""
    def attrs() -> dict[str, Any]:
        with h5py.File(path, "r") as f:
            return _read_attrs(f)
    return read_judged(path, attrs, retry=retry)


def _py(v: object) -> object:
    if isinstance(v, bytes):
        return v.decode("utf-8")
    return v.item() if isinstance(v, np.generic) else v


def read_segment(path: Path, *, fields: Sequence[str] | None = None,
                 retry: Retrier | None = None) -> Segment:
    """Read a committed segment and check its structure and every checksum.

    With `fields`, only those datasets (plus what they need) are read and checked.
    Raises `CorruptSegment` on proof of damage, `StillUnreadable` when I/O errors outlast
    the retries, `UnsupportedSegment` for a file from a newer schema (`read_judged`).
    """
    return read_judged(path, lambda: read_segment_once(path, fields), retry=retry)


def read_segment_once(path: Path, fields: Sequence[str] | None = None) -> Segment:
    """One read of a segment file, no retry and no verdict: any failure is raised as it is
    (`BadContent` for checked bytes that contradict the format)."""
    with h5py.File(path, "r") as f:
        attrs = _read_attrs(f)
        version = int(attrs["schema_version"])
        if version > SCHEMA_VERSION:
            raise UnsupportedSegment(
                f"{path} has schema_version {version}; this rft-hpc reads up to "
                f"{SCHEMA_VERSION}: upgrade rft-hpc")
        kind = attrs["kind"]
        if kind not in SCHEMAS:
            raise BadContent(f"unknown kind {kind!r}")
        columns = _read_columns(f, SCHEMAS[kind], int(attrs["num_records"]), fields)
    return Segment(path, kind, str(attrs["writer"]), int(attrs["step_start"]),
                   int(attrs["step_end"]), columns)


def _read_columns(f: h5py.File, schema: KindSchema, n: int,
                  fields: Sequence[str] | None) -> dict[str, Any]:
    wanted = set(schema.dataset_names(optional=True) if fields is None else fields)
    cols: dict[str, Any] = {}
    for g in schema.groups:
        present = [c for c in g.optional if c[0] in wanted and c[0] in f]
        names = [c for c, _ in g.columns if c in wanted] + [c for c, _ in present]
        if not names:
            continue
        off = _read_numeric(f, g.offsets, "<i8", n + 1)
        if off[0] != 0 or np.any(off[1:] < off[:-1]):
            raise BadContent(f"{g.offsets} not increasing from 0")
        cols[g.offsets] = off
        for name, dtype in (*g.columns, *present):
            if name in wanted:
                cols[name] = _read_numeric(f, name, dtype, int(off[-1]))
    for name, dtype in schema.scalars:
        if name in wanted:
            cols[name] = _read_numeric(f, name, dtype, n)
    for name in schema.strings:
        cols[name] = _read_strings(f, name, n)
    if fields is None:
        _check_records(schema, cols)
    return cols


def _check_records(schema: KindSchema, cols: dict[str, Any]) -> None:
    """What each record's constructor would check, for all records at once: every prompt
    fits in its sequences (the offsets were checked, so token-aligned columns match)."""
    prompt = cols["prompt_length"]
    for g in schema.groups:
        lengths = np.diff(cols[g.offsets])
        if np.any(prompt < 0) or np.any(prompt > lengths):
            raise BadContent(f"a prompt_length lies outside its record ({g.offsets})")


def _stored_crc(ds: h5d.DatasetID) -> int:
    attr = h5a.open(ds, b"crc32")
    value = np.empty(attr.shape, dtype=attr.dtype)
    attr.read(value)
    attr.close()
    return int(value)


def _read_numeric(f: h5py.File, name: str, dtype: str, length: int | None) -> np.ndarray:
    """A 1-D dataset of `dtype` (and `length`, unless None), its checksum verified."""
    ds = h5d.open(f.id, name.encode())
    if len(ds.shape) != 1 or ds.dtype != np.dtype(dtype) or \
            (length is not None and ds.shape[0] != length):
        raise BadContent(f"{name} is {ds.dtype}{ds.shape}, expected {dtype}({length},)")
    length = ds.shape[0]
    arr = np.empty(length, dtype=dtype)
    if length:
        ds.read(h5s.ALL, h5s.ALL, arr)
    if _crc_array(arr) != _stored_crc(ds):
        raise BadContent(f"checksum mismatch in {name}")
    ds.close()
    return arr


def unpack_strings(packed: np.ndarray) -> list[str]:
    """A string dataset's values: UTF-8 strings, each followed by a NUL byte
    (`segment_write._pack_strings`)."""
    return packed[:-1].tobytes().decode("utf-8").split("\0")


def _read_strings(f: h5py.File, name: str, n: int) -> list[str]:
    packed = _read_numeric(f, name, "|u1", None)
    if n and (not packed.size or packed[-1] != 0):
        raise BadContent(f"{name} does not end with a NUL byte")
    values = unpack_strings(packed) if n else []
    if len(values) != n:
        raise BadContent(f"{name} holds {len(values)} strings, expected {n}")
    return values


def committed_segments(writer_dir: Path) -> list[int]:
    """First steps of the committed segments in one writer's folder, in order (one listing)."""
    starts = [s for s in (parse_segment_name(e) for e in os.listdir(writer_dir)) if s is not None]
    return sorted(starts)
