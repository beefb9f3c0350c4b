"""The colocated placement's segment tap (`buffer.segment_tap`): a reader in the writer's
process takes a segment's columns as the file holds them, before the file is committed, and
without reading it; its position (a checkpoint's cursor) waits for the commit and fails
with the writer's error when the commit fails; a reader elsewhere (an empty tap) reads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rft_hpc.buffer import BufferReader, Experience, SegmentWriter, read_segment, segment_tap
from rft_hpc.buffer.segment import Segment


def _records(n: int) -> list[Experience]:
    rng = np.random.default_rng(0)
    return [Experience(rng.integers(0, 500, 6 + i % 3, dtype=np.int32), 3,
                       logprobs=-rng.random(6 + i % 3, dtype=np.float32), reward=i / n,
                       task_id=f"t{i}", group_id=i // 4, taskset="math", policy_version=1,
                       step=0, info={"i": i, "text": "é"}) for i in range(n)]


@pytest.fixture
def tap(monkeypatch):
    monkeypatch.setattr(segment_tap, "_enabled", True)
    monkeypatch.setattr(segment_tap, "_offers", {})
    return segment_tap


def test_the_tapped_columns_are_what_the_file_holds(tmp_path, tap):
    writer = SegmentWriter(tmp_path, "explorer-0", "rl")
    path = writer.write_step(0, _records(9))
    writer.close()
    offered = tap.take(path)
    assert isinstance(offered, Segment) and tap.take(path) is None  # taken once
    read = read_segment(path)
    assert (offered.kind, offered.writer, offered.step_start, offered.step_end) == \
        (read.kind, read.writer, read.step_start, read.step_end)
    assert offered.columns.keys() == read.columns.keys()
    for name, want in read.columns.items():
        got = offered.columns[name]
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        else:
            assert got == want, name
    for i in range(9):
        a, b = offered.record(i), read.record(i)
        assert np.array_equal(a.tokens, b.tokens) and a.info == b.info and a.reward == b.reward


def test_a_reader_takes_a_segment_before_its_commit_and_its_cursor_waits_for_it(tmp_path,
                                                                              tap):
    writer = SegmentWriter(tmp_path, "explorer-0", "rl", background_commit=True)
    writer.write_step(0, _records(8))
    writer.wait()
    reader = BufferReader(tmp_path)
    assert reader.poll() == 8  # the first segment: seen on disk, taken from the tap
    reader.state_dict()

    release = threading.Event()
    commit = writer._commit

    def held_commit(*args):  # the fsync and rename of step 1 wait for the test's signal
        release.wait()
        commit(*args)

    writer._commit = held_commit
    path = writer.write_step(1, _records(8))
    assert not path.exists() and reader.poll() == 8  # handed out before its file is there
    cursor: list[dict] = []
    waiter = threading.Thread(target=lambda: cursor.append(reader.state_dict()))
    waiter.start()
    time.sleep(0.2)
    assert not cursor  # a checkpoint of the reader waits for the commit
    release.set()
    waiter.join(10)
    assert cursor and path.exists() and cursor[0]["next_segment"] == {"explorer-0": 2}
    writer.close()

    other = BufferReader(tmp_path)  # another process's reader: nothing offered, it reads
    assert other.poll() == 16
    assert sorted(r.task_id for r in reader.take(16).records) == \
        sorted(r.task_id for r in other.take(16).records)


def test_a_failed_commit_fails_the_cursor_of_a_reader_that_took_the_segment(tmp_path, tap):
    writer = SegmentWriter(tmp_path, "explorer-0", "rl")
    writer.write_step(0, _records(4))
    reader = BufferReader(tmp_path)
    assert reader.poll() == 4

    def broken_commit(tmp, final, durable):
        raise OSError(5, "Input/output error", str(final))

    import rft_hpc.buffer.writer as writer_module

    original, writer_module.commit_file = writer_module.commit_file, broken_commit
    try:
        with pytest.raises(OSError, match="Input/output error"):
            writer.write_step(1, _records(4))
    finally:
        writer_module.commit_file = original
    assert reader.poll() == 0  # withdrawn: never handed out after the failure
    assert not (tmp_path / "explorer-0" / "00000001.h5").exists()


def test_a_taken_segment_whose_commit_failed_raises_from_the_cursor(tmp_path, tap):
    seg = read_segment_like(tmp_path / "explorer-0" / "00000000.h5", tmp_path / "x")
    tap.offer(seg)
    assert tap.take(seg.path) is seg and tap.take(seg.path) is None  # once
    tap.failed(seg.path, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        tap.wait_committed([seg.path])
    tap.offer(seg)
    tap.committed(seg.path)
    assert tap.take(seg.path) is seg
    tap.wait_committed([seg.path])  # taken after its commit: nothing to wait for
    assert tap._offers == {}


def read_segment_like(path, scratch):
    """A segment object for `path` with one record (written to `scratch`, not to `path`)."""
    writer = SegmentWriter(scratch, "explorer-0", "rl")
    written = writer.write_step(0, _records(1))
    writer.close()
    segment_tap.take(written)
    seg = read_segment(written)
    return Segment(path, seg.kind, seg.writer, seg.step_start, seg.step_end, seg.columns)
