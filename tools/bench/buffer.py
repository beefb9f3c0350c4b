#!/usr/bin/env python
"""Benchmark the HDF5 experience buffer against the raw disk, in one run, on one folder.

    python tools/bench/buffer.py [--dir DIR] [--gb 1] [--records-per-segment 1024] [--json]

Measures, all inside one fresh subfolder of DIR (default: the current folder):

1. raw disk: `dd if=/dev/zero bs=1M conv=fdatasync` write of exactly as many bytes as the
   4096-token segment files take, then a `dd` read of that file;
2. buffer writes with `SegmentWriter(durable=True)` (an fsync per segment, committed in the
   background as explorers do, and, for reference, in the foreground): 4096-token
   `Experience` records (bytes/s of segment files on disk) and 256-token records (records/s);
3. buffer reads with `BufferReader` (poll + take everything) of the 4096-token segments
   (bytes/s of segment files) and of the 256-token segments (records/s).

and checks the targets: 4096-token writes >= 0.8 x dd write, >= 100k 256-token records/s
written, reads >= 1 GB/s. Each figure is the median of `--repeat` runs; dd, the buffer and a
reference of plain files (same sizes, same write/fsync/rename protocol, no HDF5) take turns,
and the write ratio is the median of the ratios of runs made back to back, because a shared
or virtual disk's speed drifts. Each timed write starts on a synced disk right after as many
bytes were deleted (with online discard, a disk's speed depends on that). Reads come from
the page cache (the files were just written), as does dd's read, unless `--drop-caches` is
given (root only); "fresh memory fill" shows what filling new memory costs here, which
bounds any reader. Record construction is not timed: the records are built before the clock
starts, as an explorer builds them anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rft_hpc.buffer import BufferReader, Experience, SegmentWriter

GB = 1e9
WRITE_VS_DD = 0.8
RECORDS_PER_S_256 = 100_000.0
READ_BYTES_PER_S = 1e9


@dataclass
class Figure:
    """One measured figure, with its target when it has one."""

    name: str
    value: float
    unit: str
    target: str = ""
    passed: bool | None = None


def _dd(args: list[str]) -> tuple[int, float]:
    """Run dd; return (bytes copied, seconds) as dd reports them."""
    t0 = time.perf_counter()
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    m = re.search(r"^(\d+) bytes.*copied, ([\d.,eE+-]+) s", proc.stderr, re.MULTILINE)
    if m is None:  # unusual dd: fall back on our own clock
        raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
    secs = float(m.group(2).replace(",", "."))
    return int(m.group(1)), secs if secs > 0 else wall


def drop_caches() -> None:
    """Drop the page cache so that the next read comes from the disk (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def make_records(n: int, n_tokens: int, seed: int = 0) -> list[Experience]:
    """`n` realistic RL records of `n_tokens` tokens (a quarter prompt), content varied.

    Token arrays are views into one shared random array, so building many large records
    costs little memory; every record still has its own content.
    """
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 150_000, n_tokens + 4096, dtype=np.int32)
    lp = -rng.random(n_tokens + 4096, dtype=np.float32)
    prompt = n_tokens // 4
    mask = np.ones(n_tokens, dtype=np.uint8)
    mask[:prompt] = 0
    now = time.time()
    out = []
    for i in range(n):
        o = (i * 97) % 4096
        out.append(Experience(
            tokens=pool[o:o + n_tokens], prompt_length=prompt, response_mask=mask,
            logprobs=lp[o:o + n_tokens], reward=float(i % 7) / 7, task_id=f"task-{i // 8}",
            group_id=i // 8, taskset="math", policy_version=3, step=i // 512, priority=0.0,
            created=now, info={"sample": i % 8}))
    return out


def write_records(buffer: Path, writer: str, records: list[Experience],
                  per_segment: int, background: bool = True) -> tuple[float, int]:
    """Write `records` as segments of `per_segment` records, fsync each; (seconds, bytes).

    `background` commits as explorers do (fsync and rename on a helper thread, overlapping
    the next segment); the clock stops only when the last segment is committed.
    """
    shutil.rmtree(buffer, ignore_errors=True)
    os.sync()  # start on a quiet disk: no write-back of an earlier phase
    w = SegmentWriter(buffer, writer, "rl", durable=True, background_commit=background)
    t0 = time.perf_counter()
    for step, start in enumerate(range(0, len(records), per_segment)):
        w.write_step(step, records[start:start + per_segment])
    w.close()
    secs = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in (buffer / writer).glob("*.h5"))
    return secs, size


def write_plain_files(folder: Path, n_files: int, file_bytes: int) -> float:
    """Bytes/s of the commit protocol alone: plain files of a segment's size, each written,
    fsynced, renamed and its folder fsynced, as `SegmentWriter(durable=True)` does."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    data = np.random.default_rng(0).integers(0, 255, file_bytes, dtype=np.uint8)
    os.sync()
    t0 = time.perf_counter()
    for i in range(n_files):
        tmp = folder / f".tmp-{i}"
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"{i:08d}.bin")
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
    secs = time.perf_counter() - t0
    shutil.rmtree(folder)
    return n_files * file_bytes / secs


def read_all(buffer: Path, batch: int, drop: bool = False) -> tuple[float, int]:
    """A trainer's loop (poll, take a batch) until the buffer is used up; (seconds, records).

    The reader has its default settings (at most 65536 records held in memory).
    """
    os.sync()
    if drop:
        drop_caches()
    t0 = time.perf_counter()
    reader = BufferReader(buffer)
    n = 0
    while True:
        reader.poll()
        got = len(reader.take(batch))
        if not got:
            break
        n += got
    return time.perf_counter() - t0, n


def fresh_memory_fill(nbytes: int, chunk: int) -> float:
    """GB/s of filling newly allocated memory in `chunk`-byte arrays (page-fault cost).

    Reading a segment fills new memory too (records handed out keep their arrays), so this
    bounds what any reader can reach on this machine.
    """
    keep = []
    t0 = time.perf_counter()
    for _ in range(max(1, nbytes // chunk)):
        keep.append(np.ones(chunk, dtype=np.uint8))
    return max(1, nbytes // chunk) * chunk / (time.perf_counter() - t0)


def median(values: list[float]) -> float:
    """The median (middle value; mean of the two middle ones for an even count)."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def run(folder: Path, gb: float, per_segment: int, records_256: int, drop: bool,
        repeat: int) -> tuple[list[Figure], dict[str, float | int | str]]:
    """Measure everything in `folder` (median of `repeat` runs); the figures and settings."""
    figs: list[Figure] = []
    dd_file = folder / "dd.bin"
    # 4096-token records: about `gb` of segment files.
    rec_bytes = 4096 * 9 + 64
    n_big = max(per_segment, round(gb * GB / rec_bytes / per_segment) * per_segment)
    big = make_records(n_big, 4096, seed=1)
    buf_big = folder / "buffer-4096"
    # A first, untimed write gives the exact size of the segment files: dd then writes as
    # many bytes (one file, one fdatasync) to the same folder.
    _, size = write_records(buf_big, "explorer-0", big, per_segment)
    # dd, the buffer and plain files take turns, so that each ratio compares runs made
    # under the same conditions (a shared or virtual disk's speed drifts a lot).
    dd_w, dd_r, buf_w, serial_w, plain_w = [], [], [], [], []
    for _ in range(repeat):
        dd_file.unlink(missing_ok=True)
        shutil.rmtree(buf_big, ignore_errors=True)
        os.sync()
        nbytes, secs = _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M", f"count={size}",
                            "iflag=count_bytes", "conv=fdatasync"])
        assert nbytes == size, (nbytes, size)
        dd_w.append(nbytes / secs)
        if drop:
            drop_caches()
        nbytes, secs = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])
        dd_r.append(nbytes / secs)
        dd_file.unlink()
        secs, size = write_records(buf_big, "explorer-0", big, per_segment)
        buf_w.append(size / secs)
        secs, size = write_records(buf_big, "explorer-0", big, per_segment, background=False)
        serial_w.append(size / secs)
        n_seg = n_big // per_segment
        # Every timed write starts right after as many bytes were deleted (how fast this
        # disk writes depends on that: online discard): here the buffer's.
        shutil.rmtree(buf_big)
        plain_w.append(write_plain_files(folder / "plain", n_seg, size // n_seg))
    write_records(buf_big, "explorer-0", big, per_segment)  # for the reads below
    del big
    dd_write, dd_read, write_big = median(dd_w), median(dd_r), median(buf_w)
    ratio = median([b / d for b, d in zip(buf_w, dd_w, strict=True)])
    figs.append(Figure("dd write (fdatasync)", dd_write / GB, "GB/s"))
    figs.append(Figure("dd read", dd_read / GB, "GB/s"))
    figs.append(Figure("plain files, fsync each (reference)", median(plain_w) / GB, "GB/s"))
    figs.append(Figure("buffer write, 4096-token records", write_big / GB, "GB/s"))
    figs.append(Figure("  ratio to dd write", ratio, "x", f">= {WRITE_VS_DD}",
                       ratio >= WRITE_VS_DD))
    figs.append(Figure("  ratio to plain files", median(
        [b / p for b, p in zip(buf_w, plain_w, strict=True)]), "x"))
    figs.append(Figure("  records/s", write_big / size * n_big, "rec/s"))
    figs.append(Figure("  without background commit", median(serial_w) / GB, "GB/s"))

    small = make_records(records_256, 256, seed=2)
    buf_small = folder / "buffer-256"
    runs = [write_records(buf_small, "explorer-0", small, per_segment)
            for _ in range(repeat)]
    del small
    size_small = runs[-1][1]
    rate_small = median([records_256 / s for s, _ in runs])
    figs.append(Figure("buffer write, 256-token records", rate_small, "rec/s",
                       f">= {RECORDS_PER_S_256:.0f} rec/s", rate_small >= RECORDS_PER_S_256))
    figs.append(Figure("  bytes/s", rate_small / records_256 * size_small / GB, "GB/s"))

    runs = [read_all(buf_big, per_segment, drop) for _ in range(repeat)]
    assert all(n == n_big for _, n in runs), f"read {runs} records of {n_big}"
    read_big = median([size / s for s, _ in runs])
    figs.append(Figure("buffer read, 4096-token records", read_big / GB, "GB/s",
                       f">= {READ_BYTES_PER_S / GB:.0f} GB/s", read_big >= READ_BYTES_PER_S))
    figs.append(Figure("  ratio to dd read", read_big / dd_read, "x"))
    figs.append(Figure("  records/s", read_big / size * n_big, "rec/s"))
    runs = [read_all(buf_small, per_segment, drop) for _ in range(repeat)]
    assert all(n == records_256 for _, n in runs), f"read {runs} of {records_256}"
    figs.append(Figure("buffer read, 256-token records", median([n / s for s, n in runs]),
                       "rec/s"))
    seg_big = size / (n_big // per_segment)
    figs.append(Figure("fresh memory fill (reference)", median(
        [fresh_memory_fill(size, round(seg_big / 2)) for _ in range(repeat)]) / GB, "GB/s"))
    settings: dict[str, float | int | str] = {
        "folder": str(folder), "records_per_segment": per_segment,
        "segment_mb_4096": round(seg_big / 2**20, 2),
        "segment_mb_256": round(size_small / (records_256 // per_segment) / 2**20, 2),
        "records_4096": n_big, "records_256": records_256, "bytes_4096": size,
        "repeat": repeat,
        "page_cache_dropped": str(drop),
    }
    return figs, settings


def print_table(figs: list[Figure], settings: dict[str, float | int | str]) -> None:
    """Print the figures as a plain-text table."""
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"{'figure':<38} {'value':>12} {'unit':<6} {'target':<16} result")
    for f in figs:
        result = "" if f.passed is None else ("PASS" if f.passed else "FAIL")
        value = f"{f.value:,.0f}" if f.unit == "rec/s" else f"{f.value:.3f}"
        print(f"{f.name:<38} {value:>12} {f.unit:<6} {f.target:<16} {result}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 1 when a target is missed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("."),
                   help="folder on the filesystem to measure (a subfolder is made and removed)")
    p.add_argument("--gb", type=float, default=1.0, help="GB written by dd and by the "
                   "4096-token buffer test (default 1)")
    p.add_argument("--records-per-segment", type=int, default=1024,
                   help="records per segment (= per explorer step, e.g. 128 prompts x 8 "
                        "rollouts), default 1024")
    p.add_argument("--records-256", type=int, default=262_144,
                   help="number of 256-token records written (default 262144)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each measurement; the median is reported (default 3)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before each read (root only)")
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="rft-hpc-bench-", dir=args.dir))
    try:
        figs, settings = run(folder, args.gb, args.records_per_segment, args.records_256,
                             args.drop_caches, args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps({"settings": settings, "figures": [asdict(f) for f in figs]},
                         indent=2))
    else:
        print_table(figs, settings)
    return 0 if all(f.passed is not False for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())
