"""Polling cost does not grow with what was consumed: syscalls counted under strace.

"With 10,000 segments already consumed, a poll for new data costs about what it costs with
10": a reader restored from its cursor finds new data with one listing of the buffer folder
and one `stat` per writer, whatever the number of segments behind it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from multiprocessing.context import BaseContext
from pathlib import Path

import pytest
from helpers.buffer_workers import MARK_BEGIN, MARK_END, tiny_writer_main, write_steps
from helpers.paths import HELPERS

from rft_hpc.buffer import BufferReader
from rft_hpc.buffer.layout import ensure_buffer_dir

STRACE = shutil.which("strace") or "strace"
WORKERS = HELPERS / "buffer_workers.py"
POLLS = 200
BIG = 10_000

pytestmark = pytest.mark.needs_program("strace")


def consume_all(buffer: Path, reader: BufferReader | None = None) -> BufferReader:
    """Take every record now in the buffer; the reader, with nothing left pending."""
    reader = reader or BufferReader(buffer)
    while reader.poll() or reader.pending:
        reader.take(1 << 20)
    return reader


def save_cursor(reader: BufferReader, path: Path) -> Path:
    """Write the reader's cursor as JSON to `path`; the path."""
    path.write_text(json.dumps(reader.state_dict()))
    return path


def build_big(buffer: Path, mp: BaseContext) -> BufferReader:
    """Two writer processes commit BIG tiny segments while a reader consumes them."""
    writers = ["w0", "w1"]
    procs = [mp.Process(target=tiny_writer_main, args=(str(buffer), w, BIG // len(writers)))
             for w in writers]
    for p in procs:
        p.start()
    reader = BufferReader(buffer)
    while any(p.is_alive() for p in procs):
        reader.poll()
        reader.take(1 << 20)
        time.sleep(0.01)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return consume_all(buffer, reader)


def count_syscalls(log: Path, cases: int) -> list[int]:
    """Syscall lines between each begin marker and the end marker after it."""
    lines = log.read_text().splitlines()
    begins = [i for i, line in enumerate(lines) if MARK_BEGIN in line]
    ends = [i for i, line in enumerate(lines) if MARK_END in line]
    assert len(begins) == len(ends) == cases, (begins, ends)
    return [e - b - 1 for b, e in zip(begins, ends, strict=True)]


@pytest.mark.timeout(600)  # 10,000 segments: 60-200 s loaded
def test_poll_cost_independent_of_consumed_segments(tmp_path: Path, mp: BaseContext) -> None:
    t0 = time.monotonic()
    big = ensure_buffer_dir(tmp_path / "big")
    big_reader = build_big(big, mp)
    build_secs = time.monotonic() - t0
    assert big_reader.counters["segments_read"] == BIG
    assert big_reader.counters["taken"] == BIG

    # Small buffers: 10 segments over 2 writers, and 1 / 4 writers for the per-writer cost.
    layouts = {"small": (2, 5), "one-writer": (1, 10), "four-writers": (4, 10)}
    cursors = {"big": save_cursor(big_reader, tmp_path / "big.json")}
    for name, (n_writers, n_segments) in layouts.items():
        buf = ensure_buffer_dir(tmp_path / name)
        for k in range(n_writers):
            write_steps(buf, range(n_segments), 1, writer=f"w{k}", sizes=[1])
        reader = consume_all(buf)
        assert reader.counters["segments_read"] == n_writers * n_segments
        cursors[name] = save_cursor(reader, tmp_path / f"{name}.json")

    names = list(cursors)
    log = tmp_path / "strace.log"
    cmd = [STRACE, "-f", "-e", "trace=%file,%desc", "-o", str(log), sys.executable,
           str(WORKERS), "probe-poll", "--polls", str(POLLS)]
    for name in names:
        cmd += ["--case", str(tmp_path / name), str(cursors[name])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert all(r == {"warm_up_added": 0, "added": 0, "pending": 0} for r in results), results
    counts = dict(zip(names, count_syscalls(log, len(names)), strict=True))
    print(f"\nbuilt and consumed {BIG} segments in {build_secs:.1f} s; syscalls for "
          f"{POLLS} polls: {counts}")

    # 10,000 consumed segments cost what 10 cost (same writers): not one call more.
    assert counts["big"] == counts["small"]
    # One stat per writer per poll, on top of a fixed cost per poll.
    assert counts["small"] - counts["one-writer"] == POLLS
    assert counts["four-writers"] - counts["one-writer"] == 3 * POLLS
    per_poll_fixed = (counts["one-writer"] - POLLS) / POLLS
    assert per_poll_fixed == int(per_poll_fixed) and per_poll_fixed <= 5, counts
