"""The colocated placement's segment tap (`buffer.segment_tap`): a reader in the writer's
process takes a committed segment's columns as the file holds them, without reading it; a
segment not yet committed is not handed out, and a reader elsewhere (an empty tap) reads."""

from __future__ import annotations

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
    monkeypatch.setattr(segment_tap, "_offered", {})
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


def test_a_reader_takes_only_committed_segments_and_reads_without_an_offer(tmp_path, tap):
    (tmp_path / "explorer-0").mkdir()
    ghost = read_segment_like(tmp_path / "explorer-0" / "00000000.h5", tmp_path / "x")
    tap.offer(ghost)  # offered, never committed: nothing to hand out
    assert BufferReader(tmp_path).poll() == 0

    tap._offered.clear()
    (tmp_path / "x").rename(tmp_path.with_name(tmp_path.name + "-scratch"))
    writer = SegmentWriter(tmp_path, "explorer-0", "rl", background_commit=True)
    for step in range(2):
        writer.write_step(step, _records(8))
        writer.wait()
    reader = BufferReader(tmp_path)
    assert reader.poll() == 16 and tap._offered == {}  # both taken from the tap
    other = BufferReader(tmp_path)  # another process's reader: nothing offered, it reads
    assert other.poll() == 16
    assert sorted(r.task_id for r in reader.take(16).records) == \
        sorted(r.task_id for r in other.take(16).records)


def read_segment_like(path, scratch):
    """A segment object for `path` with one record (written to `scratch`, not to `path`)."""
    writer = SegmentWriter(scratch, "explorer-0", "rl")
    written = writer.write_step(0, _records(1))
    writer.close()
    segment_tap.take(written)
    seg = read_segment(written)
    return Segment(path, seg.kind, seg.writer, seg.step_start, seg.step_end, seg.columns)
