"""How segment files are written: large records, odd arrays, short writes, failures, old files."""

import errno
import os
import threading
import time
import zlib

import h5py
import numpy as np
import pytest
from h5py import h5d

from rft_hpc.buffer import Experience, SegmentWriter, read_segment
from rft_hpc.buffer.segment import LIBVER, SCHEMA_VERSION


def _big_records(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [Experience(rng.integers(0, 150_000, length, dtype=np.int32), length // 4,
                       logprobs=-rng.random(length, dtype=np.float32), reward=(i % 4) / 4,
                       task_id=f"t{i}", group_id=i // 8, taskset="math", policy_version=2,
                       step=0, priority=i, created=1000.0 + i, info={"i": i})
            for i in range(n)]


def _check_plain_h5py(path, records):
    with h5py.File(path, "r") as f:
        off = f["offsets"][:]
        tok, mask, lp = f["tokens"][:], f["response_mask"][:], f["logprobs"][:]
        for i, r in enumerate(records):
            s, e = off[i], off[i + 1]
            assert np.array_equal(tok[s:e], r.tokens)
            assert np.array_equal(mask[s:e], r.response_mask)
            assert np.array_equal(lp[s:e], r.logprobs)
        for name, ds in f.items():
            assert ds.id.get_create_plist().get_layout() == h5d.CONTIGUOUS, name
            assert zlib.crc32(ds[:].tobytes()) == ds.attrs["crc32"], name


def test_large_records_are_written_whole_with_more_records_than_one_system_call_takes(tmp_path):
    records = _big_records(1100, 2500)  # > IOV_MAX arrays per field, > 4 MiB in all
    w = SegmentWriter(tmp_path, "explorer-0", "rl", background_commit=True)
    path = w.write_step(0, records)
    w.close()
    assert read_segment(path).records() == records
    _check_plain_h5py(path, records)


def test_arrays_replaced_after_construction_are_converted(tmp_path):
    records = _big_records(6, 3000)
    records[1].tokens = records[1].tokens.astype(np.int64)  # other dtype
    records[2].logprobs = np.repeat(records[2].logprobs, 2)[::2]  # not contiguous
    records[3].tokens = records[3].tokens.tolist()  # not an array
    expected = [Experience(np.asarray(r.tokens), r.prompt_length, r.response_mask,
                           np.ascontiguousarray(r.logprobs), r.reward, r.task_id, r.group_id,
                           r.taskset, r.policy_version, r.step, r.priority, r.created, r.info)
                for r in records]
    path = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, records)
    assert read_segment(path).records() == expected
    _check_plain_h5py(path, expected)


@pytest.mark.parametrize("length", [9, 3000])
def test_a_field_whose_length_differs_from_its_tokens_is_refused(tmp_path, length):
    records = _big_records(4, length)
    records[2].response_mask = records[2].response_mask[:-1]
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    with pytest.raises(ValueError, match="record 2: response_mask has"):
        w.write_step(0, records)
    assert list(w.dir.iterdir()) == []


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real = os.pwritev

    def short(fd, buffers, offset):  # at most 5000 bytes per call, as a slow filesystem may
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:5000]
        return real(fd, [data], offset)

    monkeypatch.setattr(os, "pwritev", short)
    records = _big_records(40, 3000)
    path = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, records)
    assert read_segment(path).records() == records


def test_a_failed_write_leaves_no_file_and_no_thread(tmp_path, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    before = threading.active_count()
    w = SegmentWriter(tmp_path, "explorer-0", "rl", background_commit=True)
    with pytest.raises(OSError, match="No space"):
        w.write_step(0, _big_records(600, 3000))
    assert list(w.dir.iterdir()) == []
    monkeypatch.undo()
    w.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_a_segment_written_with_plain_h5py_high_level_calls_is_read(tmp_path):
    """Files of earlier writers (h5py `create_dataset(data=...)`, space allocated late) and
    of any tool following docs/buffer-format.md read the same as the writer's own."""
    records = _big_records(5, 40)
    folder = tmp_path / "explorer-0"
    ref = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, records)
    with h5py.File(ref, "r") as f:
        data = {name: ds[:] for name, ds in f.items()}
    path = folder / "00000001.h5"
    with h5py.File(path, "w", libver=LIBVER) as f:
        attrs = {"schema_version": SCHEMA_VERSION, "kind": b"rl", "writer": b"explorer-0",
                 "step_start": 1, "step_end": 2, "num_records": 5, "created": 1.0,
                 "producer": b"hand"}
        for name, value in attrs.items():
            f.attrs[name] = np.bytes_(value) if isinstance(value, bytes) else value
        for name, values in data.items():
            f.create_dataset(name, data=values).attrs["crc32"] = np.uint32(
                zlib.crc32(values.tobytes()))
    seg = read_segment(path)
    assert (seg.step_start, seg.step_end) == (1, 2) and seg.records() == records


def test_info_is_encoded_as_sorted_compact_ascii_json():
    import json

    from rft_hpc.buffer.segment_write import _info_json

    infos = [{}, {"sample": 3}, {"b": [1, 2.5, None], "a": {"z": "é\n\u0000", "y": True}},
             {"nan": float("nan"), "big": 10**30, "neg": -0.0}]
    for info in infos:
        assert _info_json(info) == json.dumps(info, sort_keys=True, separators=(",", ":"),
                                              ensure_ascii=True)
    with pytest.raises(TypeError, match="not JSON serializable"):
        _info_json({"x": object()})
