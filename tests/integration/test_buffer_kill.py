"""Writers killed at random moments and damaged segment files: a reader never sees bad data."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import h5py
import pytest
from helpers.buffer_workers import (
    check_record,
    killable_writer_main,
    read_new,
    receive,
    record_from_id,
    step_records,
    write_steps,
)

from rft_hpc.buffer import BufferReader, SegmentWriter, read_segment
from rft_hpc.buffer.layout import QUARANTINE, ensure_buffer_dir, stray_temporaries
from rft_hpc.buffer.segment import committed_segments, read_segment_attrs, segment_name

TRIALS = 30
RECORDS_PER_STEP = 4
MAX_TOKENS = 50_000
READER_LOG = "rft_hpc.buffer.reader"


def committed_end(writer_dir: Path) -> int:
    """The step after the writer's last committed segment (0 when it has none)."""
    starts = committed_segments(writer_dir) if writer_dir.exists() else []
    if not starts:
        return 0
    return int(read_segment_attrs(writer_dir / segment_name(starts[-1]))["step_end"])


def logged_end(log: Path) -> int:
    """The end step of the last segment the writer reported as committed (0 if none)."""
    lines = log.read_text().split() if log.exists() else []
    return int(lines[-1]) if lines else 0


def assert_steps_exactly_once(seen: Counter[tuple[int, int]], end: int) -> None:
    """Every record of steps [0, end) was seen exactly once, and nothing else."""
    expected = {(s, i) for s in range(end) for i in range(RECORDS_PER_STEP)}
    assert set(seen) == expected, (f"steps seen {sorted({s for s, _ in seen})[-3:]}..., "
                                   f"expected up to {end - 1}")
    assert max(seen.values(), default=1) == 1, "a record was handed out twice"


def collect(reader: BufferReader, seen: Counter[tuple[int, int]]) -> int:
    """Read everything new, check every record's content, count it; the number read."""
    records = read_new(reader)
    for r in records:
        parts = check_record(r)
        seen[parts["step"], parts["index"]] += 1
    return len(records)


def test_writer_killed_at_random_moments(buffer_dir: Path, tmp_path: Path, mp: BaseContext,
                                         rng: random.Random) -> None:
    writer = "w0"
    wdir = buffer_dir / writer
    log = tmp_path / "committed.log"
    reader = BufferReader(buffer_dir)
    seen: Counter[tuple[int, int]] = Counter()
    trials_with_leftovers = 0
    for trial in range(TRIALS + 1):  # the last start is a clean run, not killed
        leftovers = stray_temporaries(wdir) if wdir.exists() else []
        expected_next = committed_end(wdir)
        conn, child = mp.Pipe()
        durable = trial % 3 == 0
        last = trial == TRIALS
        proc = mp.Process(target=killable_writer_main, args=(
            child, str(buffer_dir), writer, str(log), rng.randrange(1 << 30), durable,
            1 + trial % 2, RECORDS_PER_STEP, MAX_TOKENS, 5 if last else None))
        proc.start()
        hello = receive(conn, proc)
        # The restarted writer removed its predecessor's temporary files, and said so...
        assert hello["removed_temporaries"] == leftovers
        assert stray_temporaries(wdir) == []
        trials_with_leftovers += bool(leftovers)
        # ... and continues right after the last committed segment.
        assert hello["next_step"] == expected_next
        conn.send("go")
        if last:
            proc.join(30)
            assert proc.exitcode == 0
        else:
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
        conn.close()

        collect(reader, seen)
        end = committed_end(wdir)
        reported = logged_end(log)
        # Everything reported committed is on disk; at most one more segment (committed
        # just before the kill, not yet logged).
        assert end >= reported
        assert len([s for s in committed_segments(wdir) if s >= reported]) <= 1
        # The reader saw exactly the committed steps: no gap, no duplicate, nothing torn.
        assert_steps_exactly_once(seen, end)
        assert reader.counters["corrupt_segments"] == 0
    assert stray_temporaries(wdir) == []
    # Most kills land inside a segment write; these must have happened at least a few times.
    assert trials_with_leftovers >= 3, trials_with_leftovers
    print(f"{TRIALS} kills, {trials_with_leftovers} left a temporary file, "
          f"{committed_end(wdir)} steps committed")


# -- damaged segment files ---------------------------------------------------------------


def flip_tokens(path: Path, rng: random.Random) -> None:
    """Flip a few bytes inside the data of the `tokens` dataset."""
    with h5py.File(path, "r") as f:
        ds = f["tokens"].id
        offset, size = ds.get_offset(), ds.get_storage_size()
    assert offset is not None and size > 0
    with open(path, "r+b") as fh:
        for _ in range(rng.randint(1, 4)):
            pos = offset + rng.randrange(size)
            fh.seek(pos)
            b = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def truncate_half(path: Path, rng: random.Random) -> None:
    """Cut the file to half its size."""
    os.truncate(path, path.stat().st_size // 2)


CORRUPTIONS: dict[str, Callable[[Path, random.Random], None]] = {
    "flip-tokens": flip_tokens, "truncate": truncate_half}


SIZES = [40, 80, 120, 160]


def read_steps(reader: BufferReader) -> list[int]:
    """Steps of the records read now (each record checked against its id)."""
    return sorted({check_record(r)["step"] for r in read_new(reader)})


def warnings_naming(caplog: pytest.LogCaptureFixture, path: Path) -> int:
    """How many captured warnings name `path`."""
    return sum(1 for r in caplog.records
               if r.levelno == logging.WARNING and str(path) in r.getMessage())


@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_corrupt_segment_is_skipped(buffer_dir: Path, caplog: pytest.LogCaptureFixture,
                                    rng: random.Random, damage: str) -> None:
    caplog.set_level(logging.WARNING, logger=READER_LOG)
    w = write_steps(buffer_dir, range(6), sizes=SIZES)
    middle = buffer_dir / "w0" / segment_name(2)
    CORRUPTIONS[damage](middle, rng)
    reader = BufferReader(buffer_dir)
    assert read_steps(reader) == [0, 1, 3, 4, 5]
    assert warnings_naming(caplog, middle) == 1
    assert reader.skipped == [{"writer": "w0", "segment": 2, "reason": reader.skipped[0]["reason"]}]
    assert middle.exists()  # without quarantine the file stays where it is

    # The writer's later segments keep coming.
    write_steps(buffer_dir, range(6, 8), into=w, sizes=SIZES)
    assert read_steps(reader) == [6, 7]

    # The newest segment damaged: the reader waits (one warning, not one per poll) and
    # moves on as soon as the writer commits the next one.
    newest = buffer_dir / "w0" / segment_name(8)
    write_steps(buffer_dir, range(8, 9), into=w, sizes=SIZES)
    CORRUPTIONS[damage](newest, rng)
    for _ in range(3):
        assert read_steps(reader) == []
    assert warnings_naming(caplog, newest) == 1
    write_steps(buffer_dir, range(9, 10), into=w, sizes=SIZES)
    assert read_steps(reader) == [9]
    assert [s["segment"] for s in reader.skipped] == [2, 8]
    assert reader.counters["corrupt_segments"] == 2


def test_restarted_writer_redoes_a_truncated_newest_segment(
        buffer_dir: Path, caplog: pytest.LogCaptureFixture, rng: random.Random) -> None:
    caplog.set_level(logging.WARNING)
    write_steps(buffer_dir, range(4), sizes=SIZES)
    newest = buffer_dir / "w0" / segment_name(3)
    reader = BufferReader(buffer_dir)
    truncate_half(newest, rng)
    assert read_steps(reader) == [0, 1, 2]
    # A new writer process sets the damaged segment aside and writes its steps again.
    w = SegmentWriter(buffer_dir, "w0", "rl", durable=False)
    assert w.next_step == 3
    moved = buffer_dir / QUARANTINE / "w0" / newest.name
    assert moved.exists() and not newest.exists()
    assert "found by restarted writer" in Path(f"{moved}.reason.txt").read_text()
    write_steps(buffer_dir, range(3, 5), into=w, sizes=SIZES)
    assert read_steps(reader) == [3, 4]
    assert reader.skipped == []


def test_reader_quarantines_corrupt_segment(buffer_dir: Path, rng: random.Random,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=READER_LOG)
    w = write_steps(buffer_dir, range(1), sizes=SIZES)
    early = BufferReader(buffer_dir)
    assert read_steps(early) == [0]
    saved = json.loads(json.dumps(early.state_dict()))
    write_steps(buffer_dir, range(1, 5), into=w, sizes=SIZES)
    bad = buffer_dir / "w0" / segment_name(1)
    flip_tokens(bad, rng)
    reader = BufferReader(buffer_dir, quarantine=True)
    assert read_steps(reader) == [0, 2, 3, 4]
    assert warnings_naming(caplog, bad) == 1
    moved = buffer_dir / QUARANTINE / "w0" / bad.name
    assert moved.exists() and not bad.exists()
    reason = Path(f"{moved}.reason.txt").read_text()
    assert "checksum mismatch in tokens" in reason
    # The quarantine folder is not taken for a writer; reading goes on normally.
    assert read_steps(reader) == []
    # A new reader, and one restored from before the damage, read around the hole.
    assert read_steps(BufferReader(buffer_dir)) == [0, 2, 3, 4]
    restored = BufferReader(buffer_dir, state=saved)
    assert read_steps(restored) == [2, 3, 4]
    assert [s["segment"] for s in restored.skipped] == [1]


def global_heap_ranges(data: bytes) -> list[range]:
    """Byte ranges of the file's global heap collections (where vlen strings live)."""
    out = []
    for m in re.finditer(b"GCOL\x01", data):
        size = int.from_bytes(data[m.start() + 8:m.start() + 16], "little")
        out.append(range(m.start(), m.start() + size))
    return out


def tiny_segment(folder: Path) -> tuple[bytes, list[Any]]:
    """A one-segment buffer's file content and the records it holds."""
    source = ensure_buffer_dir(folder)
    w = SegmentWriter(source, "w0", "rl", durable=False)
    sizes = [1, 7, 300, 64, 2, 150]
    w.write_step(0, step_records("w0", 0, len(sizes), sizes))
    original = source / "w0" / segment_name(0)
    expected = [record_from_id(r.task_id) for r in read_segment(original).records()]
    return original.read_bytes(), expected


def flip_trials(folder: str, trials: int, seed: int) -> dict[str, int]:
    """Flip random bits anywhere in a segment, `trials` times; count the outcomes.

    Each damaged file must be skipped by the reader or give exactly the original records.
    """
    rng = random.Random(seed)
    data, expected = tiny_segment(Path(folder) / "source")
    outcomes: Counter[str] = Counter()
    for trial in range(trials):
        buf = ensure_buffer_dir(Path(folder) / f"trial-{trial}")
        (buf / "w0").mkdir()
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        (buf / "w0" / segment_name(0)).write_bytes(bytes(damaged))
        reader = BufferReader(buf)
        got = read_new(reader)
        if reader.counters["corrupt_segments"]:
            assert got == [], f"trial {trial}: a corrupt segment yielded records"
            outcomes["skipped"] += 1
        else:
            assert got == expected, f"trial {trial}: damaged file gave different records"
            outcomes["identical"] += 1
        shutil.rmtree(buf)
    return dict(outcomes)


def _flip_trials_main(folder: str, trials: int, seed: int, out: str) -> None:
    Path(out).write_text(json.dumps(flip_trials(folder, trials, seed)))


def test_random_byte_flips_never_hang_or_give_wrong_records(tmp_path: Path,
                                                            rng: random.Random,
                                                            mp: BaseContext) -> None:
    """Anywhere in the file: segments keep no data in HDF5's unchecked global heap, whose
    damage could make HDF5 loop for ever, so every flip is caught or harmless."""
    data, _ = tiny_segment(tmp_path / "probe")
    assert global_heap_ranges(data) == []
    out = tmp_path / "outcomes.json"
    proc = mp.Process(target=_flip_trials_main,
                      args=(str(tmp_path), 1000, rng.randrange(1 << 30), str(out)))
    proc.start()
    proc.join(120)  # 1000 healthy trials take a few seconds
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    assert not hung, "reading a damaged segment hung"
    assert proc.exitcode == 0, "a damaged segment gave wrong records (see the child's output)"
    outcomes = json.loads(out.read_text())
    print(f"byte flips: {outcomes}")
    assert outcomes.get("skipped", 0) > 0
