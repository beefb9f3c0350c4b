"""Compaction folds consumed segments into archives: no record lost or doubled, ever.

Real segment files, a real reader and cursor, real processes killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections import Counter
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import h5py
from helpers.buffer_workers import (
    check_record,
    compacting_writer_main,
    read_new,
    receive,
    write_steps,
)

from rft_hpc.buffer import (
    BufferConfig,
    BufferReader,
    DPOPair,
    SegmentWriter,
    SFTSample,
    read_segment,
)
from rft_hpc.buffer.archive import list_writer, read_archive
from rft_hpc.buffer.check import summarize_buffer, verify_buffer
from rft_hpc.buffer.compact import Compactor, compact_buffer, recover_writer
from rft_hpc.buffer.jsonl import export_jsonl
from rft_hpc.buffer.segment import segment_name
from rft_hpc.config.buffer import CompactConfig
from rft_hpc.ledger.buffer_scan import scan_buffer

WRITERS = ("w0", "w1", "w2")
STEPS = 20
SMALL = CompactConfig(min_segments=4, fanout=3)


def consumed_to(step: int) -> dict[str, Any]:
    """A cursor's compaction-relevant part: every writer read up to `step`, nothing pending."""
    return {"next_segment": dict.fromkeys(WRITERS, step), "pool": {"items": []}, "stuck": {}}


def refs_and_ids(reader: BufferReader) -> Counter[tuple[str, int, int, str]]:
    """(writer, segment, index, task id) of every record the reader hands out from now on,
    each record checked against its id."""
    out: Counter[tuple[str, int, int, str]] = Counter()
    while reader.poll() or reader.pending:
        batch = reader.take(1 << 20)
        for ref, record in zip(batch.refs, batch.records, strict=True):
            check_record(record)
            out[ref.writer, ref.segment, ref.index, record.task_id] += 1
    return out


def fill(buffer: Path, steps: range = range(STEPS)) -> None:
    for w in WRITERS:
        into = SegmentWriter(buffer, w, "rl", durable=False) if steps.start else None
        write_steps(buffer, steps, 2 + (steps.start % 3), writer=w, into=into)


def test_archives_hold_every_record_under_its_segment_identity(buffer_dir: Path,
                                                              tmp_path: Path) -> None:
    fill(buffer_dir)
    before = refs_and_ids(BufferReader(buffer_dir))
    scan_before = scan_buffer(buffer_dir)
    # The trainer's reader (fifo: w0, w1, then w2) consumed all but w2's last 3 segments.
    reader = BufferReader(buffer_dir)
    reader.poll()
    reader.take(len(before) - 3 * 2)
    cursor = json.loads(json.dumps(reader.state_dict()))
    result = compact_buffer(buffer_dir, cursor, SMALL, durable=False)

    for w in WRITERS:
        files = list_writer(buffer_dir / w)
        # One call folds every consumed segment; the still pending ones stay segments.
        end = 17 if w == "w2" else STEPS
        assert files.archives == [(0, end)] and files.segments == list(range(end, STEPS))
        assert not files.covered_segments and not files.covered_archives
    assert result.segments_folded == 3 * STEPS - 3
    # A fresh reader, the cursor's reader and every tool see the same records, once each.
    assert refs_and_ids(BufferReader(buffer_dir)) == before
    assert set(refs_and_ids(BufferReader(buffer_dir, state=cursor))) == \
        {k for k in before if k[0] == "w2" and k[1] >= 17}
    scan = scan_buffer(buffer_dir)
    assert {k: v.num_records for k, v in scan.segments.items()} == \
        {k: v.num_records for k, v in scan_before.segments.items()}
    assert scan.segment_path("w2", 3) == f"{buffer_dir.name}/w2/archive-00000000-00000017.h5#3"
    report = verify_buffer(buffer_dir)
    assert (report.segments, report.records, report.archives) == \
        (STEPS * len(WRITERS), len(before), len(WRITERS))
    summary = summarize_buffer(buffer_dir)
    assert [(s.segments, s.archives, s.records, s.steps) for s in summary] == \
        [(STEPS, 1, len(before) // 3, [0, STEPS])] * len(WRITERS)
    assert export_jsonl(buffer_dir, tmp_path / "out.jsonl", warn=print) == len(before)
    # A plain h5py reader sees an archive as one big segment plus its index.
    with h5py.File(buffer_dir / "w2" / "archive-00000000-00000017.h5", "r") as f:
        assert f.attrs["schema_version"] == 2 and f.attrs["num_segments"] == 17
        assert list(f["segment_start"][:]) == list(range(17))
        assert len(f["offsets"]) == f.attrs["num_records"] + 1

    # A restarted writer continues after the archive and its segments; more steps fold
    # and merge: three archives of the lowest tier become one.
    fill(buffer_dir, range(STEPS, 3 * STEPS))
    everything = refs_and_ids(BufferReader(buffer_dir))
    for below in (30, 40, 50, 60):
        compact_buffer(buffer_dir, consumed_to(below), SMALL, durable=False)
    files = list_writer(buffer_dir / "w1")
    assert files.segments == [] and len(files.archives) < 4, files
    assert files.archives[0][0] == 0 and files.archives[-1][1] == 3 * STEPS
    assert refs_and_ids(BufferReader(buffer_dir)) == everything
    assert SegmentWriter(buffer_dir, "w1", "rl").next_step == 3 * STEPS


def test_interrupted_compaction_leftovers_are_never_read_twice(buffer_dir: Path,
                                                               tmp_path: Path) -> None:
    fill(buffer_dir)
    before = refs_and_ids(BufferReader(buffer_dir))
    saved = tmp_path / "saved"
    shutil.copytree(buffer_dir, saved)
    compact_buffer(buffer_dir, consumed_to(STEPS), SMALL, durable=False)
    # As if killed after the rename, before the deletes: the sources are back, beside the
    # archive, plus a temporary archive of a later run.
    wdir = buffer_dir / "w0"
    for name in os.listdir(saved / "w0"):
        shutil.copy(saved / "w0" / name, wdir / name)
    (wdir / ".tmp-archive-00000000-00000020.h5.1").write_bytes(b"partial")
    files = list_writer(wdir)
    assert files.segments == [] and len(files.covered_segments) == STEPS
    assert refs_and_ids(BufferReader(buffer_dir)) == before
    _, removed = recover_writer(wdir, durable=False)
    assert removed == STEPS + 1
    assert sorted(os.listdir(wdir)) == ["archive-00000000-00000020.h5"]
    assert refs_and_ids(BufferReader(buffer_dir)) == before


def test_restored_reader_finds_pending_records_in_archives(buffer_dir: Path) -> None:
    """An older cursor (its pending records since folded by a later one) still gets each of
    its records exactly once."""
    fill(buffer_dir)
    everything = refs_and_ids(BufferReader(buffer_dir))
    reader = BufferReader(buffer_dir, BufferConfig(), max_pending=10)
    reader.poll()
    first = reader.take(5)
    old = json.loads(json.dumps(reader.state_dict()))
    assert old["pool"]  # records gathered but not yet handed out
    compactor = Compactor(buffer_dir, SMALL, durable=False)
    done = compactor.run(consumed_to(12))
    assert done.segments_folded == 12 * len(WRITERS)
    # Nothing moved since: the compactor does not look again.
    assert compactor.run(consumed_to(12)).archives == 0
    restored = BufferReader(buffer_dir, BufferConfig(), state=old, max_pending=10)
    rest = refs_and_ids(restored)
    got = Counter({(r.writer, r.segment, r.index, x.task_id): 1
                   for r, x in zip(first.refs, first.records, strict=True)}) + rest
    assert got == everything


def committed_end(wdir: Path) -> int:
    """The step after the writer's last committed step, from its files."""
    files = list_writer(wdir)
    if files.segments:
        with h5py.File(wdir / segment_name(files.segments[-1]), "r") as f:
            return int(f.attrs["step_end"])
    return files.end


def test_compaction_killed_at_random_moments(buffer_dir: Path, tmp_path: Path,
                                            mp: BaseContext, rng: random.Random) -> None:
    """30 SIGKILLs at random moments of a process that writes and compacts; after each, a
    restarted process and a full read find every committed record exactly once."""
    wdir = buffer_dir / "w0"
    log = tmp_path / "committed.log"
    interrupted = 0
    archives_seen = 0
    for trial in range(30):
        files = list_writer(wdir)
        interrupted += bool(files.covered_segments or files.covered_archives or any(
            n.startswith(".tmp-archive-") for n in (os.listdir(wdir) if wdir.exists() else [])))
        end = committed_end(wdir)
        conn, child = mp.Pipe()
        proc = mp.Process(target=compacting_writer_main, args=(
            child, str(buffer_dir), "w0", str(log), rng.randrange(1 << 30), trial % 3 == 0,
            2, 2))
        proc.start()
        # The restarted writer goes on right after the last committed step, archived or not.
        assert receive(conn, proc)["next_step"] == end
        conn.send("go")
        time.sleep(rng.uniform(0.02, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        conn.close()

        end = committed_end(wdir)
        # 0 first: a writer killed before its first report leaves the log empty (or absent)
        reported = [0] + ([int(x) for x in log.read_text().split()] if log.exists() else [])
        assert end >= reported[-1], "a step reported committed is gone"
        seen = Counter()
        for r in read_new(BufferReader(buffer_dir)):
            parts = check_record(r)
            seen[parts["step"], parts["index"]] += 1
        assert set(seen) == {(s, i) for s in range(end) for i in range(3)}, trial
        assert max(seen.values(), default=1) == 1, f"trial {trial}: a record read twice"
        archives_seen += len(list_writer(wdir).archives)
    assert archives_seen > 0
    print(f"30 kills, {interrupted} left an interrupted compaction, {end} steps committed")
    # Most kills land in a compaction (it is most of the child's work); some must have.
    assert interrupted >= 3, interrupted
    # A last clean pass removes every leftover; what is left reads the same.
    recover_writer(wdir, durable=False)
    files = list_writer(wdir)
    assert not files.covered_segments and not files.covered_archives
    assert all(not n.startswith(".tmp-archive-") for n in os.listdir(wdir))
    parts = [p for s in files.archives for p in read_archive(wdir / f"archive-{s[0]:08d}-"
                                                              f"{s[1]:08d}.h5")]
    assert sum(p.num_records for p in parts) + 3 * len(files.segments) == 3 * end


def test_every_kind_round_trips_through_an_archive_and_version_1_files_still_read(
        buffer_dir: Path) -> None:
    kinds = {
        "sft": lambda s: [SFTSample([1, 2, 3, s], 2, task_id=f"a{s}"), SFTSample([5], 0)],
        "dpo": lambda s: [DPOPair([1, 2, s], [1, 2, 9, 9], 2, info={"s": s})],
    }
    for kind, make in kinds.items():
        w = SegmentWriter(buffer_dir, f"w-{kind}", kind, durable=False)
        for s in range(5):
            w.write_step(s, make(s))
    # A segment of an older writer (schema_version 1) reads as before, and folds.
    with h5py.File(buffer_dir / "w-sft" / segment_name(0), "r+") as f:
        f.attrs["schema_version"] = 1
    before = {k: [x.records() for x in map(read_segment, sorted((buffer_dir / f"w-{k}")
                                                                  .glob("0*.h5")))]
              for k in kinds}
    compact_buffer(buffer_dir, {"next_segment": {"w-sft": 5, "w-dpo": 5},
                                "pool": {"items": []}, "stuck": {}},
                   CompactConfig(min_segments=2), durable=False)
    for k in kinds:
        [span] = list_writer(buffer_dir / f"w-{k}").archives
        parts = read_archive(buffer_dir / f"w-{k}" / f"archive-{span[0]:08d}-{span[1]:08d}.h5")
        assert [p.records() for p in parts] == before[k]
