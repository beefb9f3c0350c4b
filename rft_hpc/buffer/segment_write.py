"""Writing one segment file (docs/buffer-format.md): HDF5 lays out the file, `pwritev` fills it.

HDF5 creates the file, its attributes and one contiguous dataset per field, with the space
of each dataset allocated at creation. The payload then goes straight from the records'
own arrays into that space with `os.pwritev` (no copy into one big array first, no HDF5
call per record), while a helper thread computes the checksums over the same arrays; the
`crc32` attributes are written last and HDF5 closes the file. The result is an ordinary
HDF5 file: contiguous datasets, as `h5py.File.create_dataset(name, data=...)` makes them
(bar the allocation-time setting, which readers ignore).
"""

from __future__ import annotations

import json
import json.encoder
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5p, h5s, h5t

from rft_hpc import __version__
from rft_hpc.buffer.records import Record
from rft_hpc.buffer.segment import (
    LIBVER,
    SCHEMAS,
    KindSchema,
    needed_version,
    unpack_strings,
)

# Records at least this large per field are written from their own arrays; smaller ones
# are first joined by numpy, which costs less than a Python check of each little array.
_DIRECT_MIN_BYTES = 8192
# Checksums of segments at least this large are computed on a helper thread.
_THREADED_MIN_BYTES = 4 << 20
_IOV_MAX = 1024  # buffers per pwritev call: Linux's and macOS's IOV_MAX
_DTYPE = attrgetter("dtype")
_C_CONTIGUOUS = attrgetter("flags.c_contiguous")
# h5py's low-level API: one HDF5 call per dataset and attribute, without the high-level
# layer's per-call overhead.
_T_CRC = h5t.py_create(np.dtype("<u4"))
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True)
# The C encoder behind `_JSON`, built once: `JSONEncoder.encode` builds a new one per call,
# which costs more than encoding a small `info` (~1.2 of 2.6 us a record). Same output.
_C_ENCODE = None if json.encoder.c_make_encoder is None else json.encoder.c_make_encoder(
    None, _JSON.default, json.encoder.encode_basestring_ascii, None, ":", ",", True, False,
    True)


@dataclass
class _Column:
    """One dataset's contents: `parts` written one after another, `length` elements."""

    name: str
    dtype: np.dtype
    length: int
    parts: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize


def _pack_strings(name: str, values: Sequence[str]) -> np.ndarray:
    """Strings as one uint8 array: each value's UTF-8 bytes followed by a NUL byte.

    Flat bytes rather than HDF5 variable-length strings: those live in HDF5's global heap,
    which has no checksum, and a damaged heap can make HDF5 loop forever while reading.
    """
    if not values:
        return np.zeros(0, dtype=np.uint8)
    joined = "\0".join(values) + "\0"
    if joined.count("\0") != len(values):
        raise ValueError(f"a {name} value contains a NUL character")
    return np.frombuffer(joined.encode("utf-8"), dtype=np.uint8)


def _info_json(info: dict[str, Any]) -> str:
    if not info:
        return "{}"
    return "".join(_C_ENCODE(info, 0)) if _C_ENCODE is not None else _JSON.encode(info)


def _scalar_columns(schema: KindSchema, records: Sequence[Record]) -> dict[str, np.ndarray]:
    """Per-record number columns, gathered in one pass over the records."""
    names = [name for name, _ in schema.scalars]
    if not records:
        return {name: np.zeros(0, dtype=dtype) for name, dtype in schema.scalars}
    get = attrgetter(*names)
    rows = [get(r) for r in records] if len(names) > 1 else [(get(r),) for r in records]
    # One structured array from the rows (one conversion per value), then one column each.
    table = np.array(rows, dtype=[(name, dtype) for name, dtype in schema.scalars])
    return {name: np.ascontiguousarray(table[name]) for name in names}


def _write_attr(obj: h5g.GroupID | h5d.DatasetID, name: str, value: np.ndarray,
                tid: h5t.TypeID) -> None:
    attr = h5a.create(obj, name.encode(), tid, h5s.create(h5s.SCALAR))
    attr.write(value)
    attr.close()


def _attr_value(v: int | float | str) -> tuple[np.ndarray, h5t.TypeID]:
    """A file attribute: int64, float64, or a string as fixed-length UTF-8 bytes (stored in
    the checksummed object header, never in HDF5's unchecked global heap)."""
    if isinstance(v, str):
        raw = v.encode("utf-8")
        arr = np.array(raw, dtype=f"S{max(1, len(raw))}")
    else:
        arr = np.array(v)
    return arr, h5t.py_create(arr.dtype)


def _whole(name: str, values: np.ndarray) -> _Column:
    return _Column(name, values.dtype, len(values), [values])


def _sequence_column(name: str, dtype: str, parts: Sequence[Any],
                     lengths: np.ndarray, total: int) -> _Column:
    """A token-aligned field: each record's array (`parts`), checked to match its record's
    length."""
    dt = np.dtype(dtype)
    parts = list(parts)
    got = np.fromiter(map(len, parts), np.int64, count=len(parts))
    if not np.array_equal(got, lengths):
        bad = int(np.flatnonzero(got != lengths)[0])
        raise ValueError(f"record {bad}: {name} has {got[bad]} entries, its sequence has "
                         f"{lengths[bad]}")
    if parts and total * dt.itemsize >= _DIRECT_MIN_BYTES * len(parts) and \
            set(map(type, parts)) == {np.ndarray} and set(map(_DTYPE, parts)) == {dt} and \
            all(map(_C_CONTIGUOUS, parts)):
        return _Column(name, dt, total, parts)
    joined = np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt)
    return _Column(name, dt, total, [np.ascontiguousarray(joined)])


def _sequence_columns(schema: KindSchema, records: Sequence[Record]) -> list[_Column]:
    """The offsets and token-aligned datasets of a segment holding `records`, in file order."""
    n = len(records)
    cols: list[_Column] = []
    for g in schema.groups:
        first = g.columns[0][0]
        lengths = np.fromiter((len(getattr(r, first)) for r in records), np.int64, count=n)
        offsets = np.zeros(n + 1, dtype="<i8")
        np.cumsum(lengths, out=offsets[1:])
        cols.append(_whole(g.offsets, offsets))
        total = int(offsets[-1])
        cols += [_sequence_column(name, dtype, [getattr(r, name) for r in records], lengths,
                                  total) for name, dtype in g.columns]
        cols += [_optional_column(name, dtype, records, lengths, total)
                 for name, dtype in g.optional
                 if any(getattr(r, name) is not None for r in records)]
    return cols


def _optional_column(name: str, dtype: str, records: Sequence[Record], lengths: np.ndarray,
                     total: int) -> _Column:
    """An optional token-aligned field that some record has: NaN for those without."""
    parts = [np.full(int(n), np.nan, dtype) if getattr(r, name) is None else getattr(r, name)
             for r, n in zip(records, lengths, strict=True)]
    return _sequence_column(name, dtype, parts, lengths, total)


def _record_columns(schema: KindSchema, records: Sequence[Record]) -> list[_Column]:
    """The per-record number and string datasets of a segment holding `records`."""
    cols = [_whole(name, v) for name, v in _scalar_columns(schema, records).items()]
    for name in schema.strings:
        values = ([_info_json(r.info) for r in records] if name == "info"
                  else [getattr(r, name) for r in records])
        cols.append(_whole(name, _pack_strings(name, values)))
    return cols


def _crc(col: _Column) -> int:
    crc = 0
    for part in col.parts:
        crc = zlib.crc32(part, crc)
    return crc


def _beside(work: Callable[[], None], nbytes: int) -> Callable[[], None]:
    """Run `work` on a helper thread when it moves at least `_THREADED_MIN_BYTES`, else now;
    the returned call waits for it and raises what it raised.

    `pwritev` and zlib release the GIL, so the caller's own work runs meanwhile. A fresh
    thread each time, not a pool: a pool's thread would not survive a fork of the process.
    """
    if nbytes < _THREADED_MIN_BYTES:
        work()
        return lambda: None
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="segment-crc", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure.pop()

    return wait


def _pwrite_all(fd: int, parts: list[np.ndarray], offset: int, nbytes: int) -> None:
    """Write `parts` (`nbytes` in all) back to back at `offset`, in few system calls."""
    # Usually one call writes everything, with no Python loop over the parts (which would
    # hold the GIL the checksum thread needs).
    if len(parts) <= _IOV_MAX and os.pwritev(fd, parts, offset) == nbytes:
        return
    pos = 0  # else from the start again: rewriting bytes already written is harmless
    while pos < len(parts):
        batch = parts[pos:pos + _IOV_MAX]
        done = os.pwritev(fd, batch, offset)
        offset += done
        for p in batch:
            if done < p.nbytes:
                break
            done -= p.nbytes
            pos += 1
        else:
            continue
        # A short write (rare on a local disk) stopped inside parts[pos]: finish that part.
        rest = memoryview(parts[pos]).cast("B")[done:]
        while rest:
            k = os.pwrite(fd, rest, offset)
            offset += k
            rest = rest[k:]
        pos += 1


def _dcpl() -> h5p.PropDCID:
    """Contiguous layout, space allocated when the dataset is made (so that its offset is
    known before any data is written), never filled by HDF5, no timestamps."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    dcpl.set_layout(h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    return dcpl


def write_segment_file(path: os.PathLike[str] | str, kind: str, records: Sequence[Record], *,
                       writer: str, step_start: int, step_end: int,
                       offer: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Write `records` as a complete segment file at `path` (not fsynced, not committed).
    With `offer`, first call it with the datasets as `segment.read_segment` would read them
    back (`segment_tap`).

    Returns the number of payload bytes written (sum of dataset sizes).
    """
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r}")
    for r in records:
        if r.kind != kind:
            raise ValueError(f"a {r.kind!r} record in a {kind!r} segment")
    schema = SCHEMAS[kind]
    cols = _sequence_columns(schema, records) + _record_columns(schema, records)
    if offer is not None:
        offer(_as_read(schema, cols))
    # The checksums are computed on a helper thread while this one writes the same bytes.
    crcs: list[int] = []
    wait = _beside(lambda: crcs.extend(_crc(c) for c in cols), sum(c.nbytes for c in cols))
    try:
        _write_file(path, cols, crcs, wait, {
            "schema_version": needed_version(kind, [c.name for c in cols]), "kind": kind,
            "writer": writer,
            "step_start": step_start, "step_end": step_end, "num_records": len(records),
            "created": time.time(), "producer": f"rft-hpc {__version__}"})
    finally:
        wait()
    return sum(c.nbytes for c in cols)


def _as_read(schema: KindSchema, cols: list[_Column]) -> dict[str, Any]:
    """The datasets of `cols` as a reader gets them: one array each, strings as a list."""
    out: dict[str, Any] = {}
    for col in cols:
        whole = col.parts[0] if len(col.parts) == 1 else np.concatenate(col.parts)
        if col.name in schema.strings:
            out[col.name] = unpack_strings(whole) if col.length else []
        else:
            out[col.name] = whole.astype(col.dtype, copy=False)
    return out


def _write_file(path: os.PathLike[str] | str, cols: list[_Column], crcs: list[int],
                crcs_done: Callable[[], None],
                attrs: dict[str, int | float | str]) -> None:
    dcpl = _dcpl()
    # The data goes in through HDF5's own file descriptor while HDF5 holds the file open:
    # safe because HDF5 never writes (or caches) a byte of a dataset it is given no data
    # for (fill time "never"). sec2, plain POSIX I/O, whatever HDF5_DRIVER says: no other
    # driver may keep its own image of the file.
    with h5py.File(path, "w", libver=LIBVER, driver="sec2") as f:
        root = f["/"].id
        for name, value in attrs.items():
            _write_attr(root, name, *_attr_value(value))
        placed = [(_create(f, c, dcpl), c) for c in cols]
        _fill(f.id.get_vfd_handle(), placed)
        crcs_done()
        for (ds, _), crc in zip(placed, crcs, strict=True):
            _write_attr(ds, "crc32", np.array(crc, dtype="<u4"), _T_CRC)
            ds.close()


def _create(f: h5py.File, col: _Column, dcpl: h5p.PropDCID) -> h5d.DatasetID:
    return h5d.create(f.id, col.name.encode(), h5t.py_create(col.dtype),
                      h5s.create_simple((col.length,)), dcpl=dcpl)


def _fill(fd: int, placed: list[tuple[h5d.DatasetID, _Column]]) -> None:
    """Write each column's data into the space HDF5 allocated for its dataset."""
    for ds, col in placed:
        if col.length:
            _pwrite_all(fd, col.parts, ds.get_offset(), col.nbytes)
