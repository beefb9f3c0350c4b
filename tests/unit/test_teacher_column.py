"""The optional `teacher_logprobs` dataset of rollout segments (schema 3,
docs/buffer-format.md): present only in a segment where a record carries it, NaN in it for
the records without, kept through archives and JSONL, and absent from older files."""

import json

import h5py
import numpy as np

from rft_hpc.buffer import Experience, SegmentWriter, read_segment
from rft_hpc.buffer.archive import read_archive, write_archive_file
from rft_hpc.buffer.jsonl import export_jsonl, import_jsonl, iter_segments


def _rollouts(step: int, teacher: bool, n: int = 3) -> list[Experience]:
    out = []
    for i in range(n):
        length = 5 + i
        lp = np.r_[np.zeros(2), -np.linspace(0.2, 1.0, length - 2)].astype(np.float32)
        out.append(Experience(np.arange(length) + i, 2, logprobs=lp, reward=float(i),
                              group_id=step, step=step, task_id=f"t{step}-{i}",
                              teacher_logprobs=lp - 0.5 if teacher and i != 1 else None))
    return out


def test_a_segment_holds_the_dataset_only_when_a_record_has_it(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    with_teacher, without = _rollouts(0, True), _rollouts(1, False)
    first, second = w.write_step(0, with_teacher), w.write_step(1, without)
    with h5py.File(first, "r") as f:
        assert f.attrs["schema_version"] == 3
        teacher, off = f["teacher_logprobs"][:], f["offsets"][:]
        # record 1 has none: NaN over its tokens; record 2's values as written
        assert np.isnan(teacher[off[1]:off[2]]).all()
        assert np.array_equal(teacher[off[2]:off[3]], with_teacher[2].teacher_logprobs)
    with h5py.File(second, "r") as f:  # readable whole by rft-hpc before schema 3
        assert "teacher_logprobs" not in f and f.attrs["schema_version"] == 2
    assert read_segment(first).records() == with_teacher
    assert read_segment(second).records() == without
    assert [r.teacher_logprobs is None for r in read_segment(first).records()] == [
        False, True, False]


def test_a_schema_2_file_reads_without_teacher_logprobs(tmp_path):
    records = _rollouts(0, False)
    path = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, records)
    with h5py.File(path, "r+") as f:  # what rft-hpc before schema 3 wrote
        f.attrs["schema_version"] = 2
    assert read_segment(path).records() == records


def test_an_archive_of_segments_with_and_without_keeps_each_record(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    records = [_rollouts(0, False), _rollouts(1, True), _rollouts(2, False)]
    parts = [read_segment(w.write_step(s, recs)) for s, recs in enumerate(records)]
    archive = tmp_path / "archive.h5"
    write_archive_file(archive, parts, writer="explorer-0")
    with h5py.File(archive, "r") as f:
        assert f.attrs["schema_version"] == 3
    back = read_archive(archive)
    assert [seg.records() for seg in back] == records
    none = tmp_path / "none.h5"
    write_archive_file(none, [parts[0], parts[2]], writer="explorer-0")
    with h5py.File(none, "r") as f:
        assert "teacher_logprobs" not in f and f.attrs["schema_version"] == 2


def test_jsonl_export_and_import_carry_teacher_logprobs(tmp_path):
    records = _rollouts(0, True)
    SegmentWriter(tmp_path / "a", "explorer-0", "rl").write_step(0, records)
    export_jsonl(tmp_path / "a", tmp_path / "a.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert ["teacher_logprobs" in x for x in lines] == [True, False, True]
    import_jsonl(tmp_path / "a.jsonl", "rl", tmp_path / "b")
    back = [r for _, p in iter_segments(tmp_path / "b") for r in read_segment(p).records()]
    assert [r.teacher_logprobs is None for r in back] == [False, True, False]
    assert all(np.array_equal(a.teacher_logprobs, b.teacher_logprobs)
               for a, b in zip(records, back, strict=True) if a.teacher_logprobs is not None)
