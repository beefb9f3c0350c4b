"""One segment file: its schema, how it is written, how it is read and checked.

A segment holds the records of one writer for a range of steps `[step_start, step_end)`, in
one HDF5 file with one dataset per field (docs/buffer-format.md). Variable-length sequences
are stored flat with offsets; every dataset carries a `crc32` attribute that `read_segment`
checks, so flipped bytes are found rather than trained on.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rft_hpc import __version__
from rft_hpc.buffer.records import RECORD_TYPES, Record
from rft_hpc.errors import UserError

SCHEMA_VERSION = 1
LIBVER = ("v110", "v110")  # readable by any HDF5 >= 1.10; metadata carries checksums
_NAME = re.compile(r"^(\d+)\.h5$")
_STR = h5py.string_dtype("utf-8")


@dataclass(frozen=True)
class SequenceGroup:
    """Token-aligned columns that share one offsets dataset (record i = data[off[i]:off[i+1]])."""

    offsets: str
    columns: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class KindSchema:
    """The datasets of one record kind: sequence groups, per-record numbers, per-record strings."""

    kind: str
    groups: tuple[SequenceGroup, ...]
    scalars: tuple[tuple[str, str], ...]
    strings: tuple[str, ...] = ("task_id", "taskset", "info")

    def dataset_names(self) -> list[str]:
        names = []
        for g in self.groups:
            names += [g.offsets, *(c for c, _ in g.columns)]
        return names + [s for s, _ in self.scalars] + list(self.strings)


SCHEMAS: dict[str, KindSchema] = {
    "rl": KindSchema(
        "rl",
        (SequenceGroup("offsets", (("tokens", "<i4"), ("response_mask", "|u1"),
                                   ("logprobs", "<f4"))),),
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


class CorruptSegment(Exception):
    """A committed segment that cannot be read back intact (truncated, flipped bytes, ...)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"corrupt segment {path}: {reason}")
        self.path = path
        self.reason = reason


class UnsupportedSegment(UserError):
    """A segment written by a newer rft-hpc (higher schema_version) than this one."""


def segment_name(step_start: int) -> str:
    """File name of the committed segment whose first step is `step_start`."""
    return f"{step_start:08d}.h5"


def parse_segment_name(name: str) -> int | None:
    """First step of a committed segment's file name, or None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def _crc_array(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


def _crc_strings(values: Sequence[str]) -> int:
    crc = 0
    for v in values:
        crc = zlib.crc32(v.encode("utf-8") + b"\0", crc)
    return crc


def records_to_columns(kind: str, records: Sequence[Record]) -> dict[str, Any]:
    """The dataset contents for `records` (all of `kind`), keyed by dataset name."""
    schema = SCHEMAS[kind]
    n = len(records)
    cols: dict[str, Any] = {}
    for g in schema.groups:
        first = g.columns[0][0]
        lengths = np.fromiter((len(getattr(r, first)) for r in records), np.int64, count=n)
        offsets = np.zeros(n + 1, dtype="<i8")
        np.cumsum(lengths, out=offsets[1:])
        cols[g.offsets] = offsets
        for name, dtype in g.columns:
            parts = [getattr(r, name) for r in records]
            cols[name] = (np.concatenate(parts).astype(dtype, copy=False) if parts
                          else np.zeros(0, dtype=dtype))
    for name, dtype in schema.scalars:
        cols[name] = np.fromiter((getattr(r, name) for r in records), dtype, count=n)
    for name in schema.strings:
        if name == "info":
            cols[name] = [json.dumps(r.info, separators=(",", ":"), sort_keys=True)
                          for r in records]
        else:
            cols[name] = [getattr(r, name) for r in records]
    return cols


def write_segment_file(path: Path, kind: str, records: Sequence[Record], *, writer: str,
                       step_start: int, step_end: int) -> int:
    """Write `records` as a complete segment file at `path` (not fsynced, not committed).

    Returns the number of payload bytes written (sum of dataset sizes).
    """
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r}")
    for r in records:
        if r.kind != kind:
            raise ValueError(f"a {r.kind!r} record in a {kind!r} segment")
    cols = records_to_columns(kind, records)
    nbytes = 0
    with h5py.File(path, "w", libver=LIBVER) as f:
        f.attrs.update({
            "schema_version": SCHEMA_VERSION, "kind": kind, "writer": writer,
            "step_start": step_start, "step_end": step_end, "num_records": len(records),
            "created": time.time(), "producer": f"rft-hpc {__version__}",
        })
        for name, values in cols.items():
            if isinstance(values, list):
                ds = f.create_dataset(name, shape=(len(values),), dtype=_STR)
                if values:
                    ds[...] = values
                ds.attrs["crc32"] = np.uint32(_crc_strings(values))
                nbytes += sum(len(v) for v in values)
            else:
                ds = f.create_dataset(name, data=values)
                ds.attrs["crc32"] = np.uint32(_crc_array(values))
                nbytes += values.nbytes
    return nbytes


@dataclass
class Segment:
    """A committed segment read fully into memory and checked."""

    path: Path
    kind: str
    writer: str
    step_start: int
    step_end: int
    columns: dict[str, Any]

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
        kwargs: dict[str, Any] = {}
        for g in schema.groups:
            off = cols[g.offsets]
            s, e = off[i], off[i + 1]
            for name, _ in g.columns:
                kwargs[name] = cols[name][s:e]
        for name, _ in schema.scalars:
            kwargs[name] = cols[name][i].item()
        for name in schema.strings:
            kwargs[name] = json.loads(cols[name][i]) if name == "info" else cols[name][i]
        return RECORD_TYPES[self.kind](**kwargs)

    def records(self) -> list[Record]:
        return [self.record(i) for i in range(self.num_records)]


def read_segment_attrs(path: Path) -> dict[str, Any]:
    """The file attributes of a segment, without reading or checking its data."""
    try:
        with h5py.File(path, "r") as f:
            return {k: _py(v) for k, v in f.attrs.items()}
    except Exception as exc:
        raise CorruptSegment(path, f"cannot open: {exc}") from exc


def _py(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8")
    return v.item() if isinstance(v, np.generic) else v


def read_segment(path: Path, *, fields: Sequence[str] | None = None) -> Segment:
    """Read a committed segment and check its structure and every checksum.

    With `fields`, only those datasets (plus what they need) are read and checked.
    Raises `CorruptSegment` for anything unreadable or inconsistent, `UnsupportedSegment`
    for a file from a newer schema.
    """
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _py(v) for k, v in f.attrs.items()}
            version = int(attrs["schema_version"])
            if version > SCHEMA_VERSION:
                raise UnsupportedSegment(
                    f"{path} has schema_version {version}; this rft-hpc reads up to "
                    f"{SCHEMA_VERSION}: upgrade rft-hpc")
            kind = attrs["kind"]
            if kind not in SCHEMAS:
                raise ValueError(f"unknown kind {kind!r}")
            columns = _read_columns(f, SCHEMAS[kind], int(attrs["num_records"]), fields)
    except (UnsupportedSegment, CorruptSegment):
        raise
    except Exception as exc:  # any failure to read a committed file means it is damaged
        raise CorruptSegment(path, f"{type(exc).__name__}: {exc}") from exc
    return Segment(path, kind, str(attrs["writer"]), int(attrs["step_start"]),
                   int(attrs["step_end"]), columns)


def _read_columns(f: h5py.File, schema: KindSchema, n: int,
                  fields: Sequence[str] | None) -> dict[str, Any]:
    wanted = set(schema.dataset_names() if fields is None else fields)
    cols: dict[str, Any] = {}
    for g in schema.groups:
        names = [c for c, _ in g.columns if c in wanted]
        if not names:
            continue
        off = _read_numeric(f, g.offsets, "<i8", n + 1)
        if off[0] != 0 or np.any(np.diff(off) < 0):
            raise ValueError(f"{g.offsets} not increasing from 0")
        cols[g.offsets] = off
        for name, dtype in g.columns:
            if name in wanted:
                cols[name] = _read_numeric(f, name, dtype, int(off[-1]))
    for name, dtype in schema.scalars:
        if name in wanted:
            cols[name] = _read_numeric(f, name, dtype, n)
    for name in schema.strings:
        ds = f[name]
        if ds.shape != (n,):
            raise ValueError(f"{name} has shape {ds.shape}, expected ({n},)")
        values = ds.asstr()[()].tolist() if n else []
        if _crc_strings(values) != int(ds.attrs["crc32"]):
            raise ValueError(f"checksum mismatch in {name}")
        cols[name] = values
    return cols


def _read_numeric(f: h5py.File, name: str, dtype: str, length: int) -> np.ndarray:
    ds = f[name]
    if ds.shape != (length,) or ds.dtype != np.dtype(dtype):
        raise ValueError(f"{name} is {ds.dtype}{ds.shape}, expected {dtype}({length},)")
    arr = np.empty(length, dtype=dtype)
    if length:
        ds.read_direct(arr)
    if _crc_array(arr) != int(ds.attrs["crc32"]):
        raise ValueError(f"checksum mismatch in {name}")
    return arr


def committed_segments(writer_dir: Path) -> list[int]:
    """First steps of the committed segments in one writer's folder, in order (one listing)."""
    starts = [s for s in (parse_segment_name(e) for e in os.listdir(writer_dir)) if s is not None]
    return sorted(starts)
