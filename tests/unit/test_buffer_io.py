"""Segments, records, JSONL import/export, verify and inspect, on real HDF5 files."""

import json
import logging
import zlib

import h5py
import numpy as np
import pytest

from rft_hpc.buffer import (
    BufferReader,
    CorruptSegment,
    DPOPair,
    Experience,
    SegmentWriter,
    SFTSample,
    read_segment,
)
from rft_hpc.buffer.check import summarize_buffer, verify_buffer
from rft_hpc.buffer.jsonl import export_jsonl, import_jsonl, iter_segments
from rft_hpc.buffer.segment import SCHEMA_VERSION
from rft_hpc.core.errors import UserError
from rft_hpc.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def _experiences(step, n=4, length=9):
    return [Experience(np.arange(length) + i, 3, logprobs=-np.linspace(0.1, 1, length),
                       reward=0.5 * i, task_id=f"t{step}-{i}", group_id=step, taskset="math",
                       policy_version=step, step=step, priority=i, info={"i": i, "s": "é"})
            for i in range(n)]


def test_every_kind_round_trips_through_a_segment(tmp_path):
    records = {
        "rl": _experiences(0),
        "sft": [SFTSample([1, 2, 3, 4], 2, task_id="a"), SFTSample([5, 6], 0, [1, 0])],
        "dpo": [DPOPair([1, 2, 3], [1, 2, 9, 9], 2, info={"why": "shorter"})],
    }
    for kind, recs in records.items():
        w = SegmentWriter(tmp_path / "buf", f"w-{kind}", kind)
        path = w.write_step(0, recs)
        seg = read_segment(path)
        assert seg.kind == kind and seg.records() == recs
    empty = SegmentWriter(tmp_path / "buf", "w-empty", "rl").write_step(0, [])
    assert read_segment(empty).records() == []


def test_segment_is_readable_with_plain_h5py_as_documented(tmp_path):
    recs = _experiences(3)
    path = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, recs)
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == 2  # no optional dataset (test_teacher_column.py)
        assert f.attrs["kind"].decode() == "rl"
        off, tok = f["offsets"][:], f["tokens"][:]
        assert f.attrs["num_records"] == len(recs)
        infos = f["info"][:].tobytes().decode().split("\0")[:-1]
        task_ids = f["task_id"][:].tobytes().decode().split("\0")[:-1]
        for i, r in enumerate(recs):
            assert np.array_equal(tok[off[i]:off[i + 1]], r.tokens)
            assert f["prompt_length"][i] == r.prompt_length
            assert f["reward"][i] == np.float32(r.reward)
            assert json.loads(infos[i]) == r.info and task_ids[i] == r.task_id
        for name, ds in f.items():  # no variable-length data anywhere (no global heap)
            assert ds.dtype.kind in "iuf", name
            assert zlib.crc32(ds[:].tobytes()) == ds.attrs["crc32"], name


def test_writer_refuses_a_step_out_of_order_and_a_mixed_kind(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    with pytest.raises(ValueError, match="expected 0"):
        w.write_step(1, [])
    with pytest.raises(ValueError, match="'sft' record"):
        w.write_step(0, [SFTSample([1], 0)])
    assert list((tmp_path / "explorer-0").iterdir()) == []  # nothing half-written


def test_steps_per_segment_groups_steps_and_the_reader_follows(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl", steps_per_segment=3)
    paths = [w.write_step(s, _experiences(s, n=2)) for s in range(7)]
    assert [p is not None for p in paths] == [False, False, True] * 2 + [False]
    w.flush()
    assert [s for s in sorted(p.name for p in w.dir.iterdir())] == [
        "00000000.h5", "00000003.h5", "00000006.h5"]
    reader = BufferReader(tmp_path)
    reader.poll()
    batch = reader.take(100)
    assert [r.step for r in batch.records] == [s for s in range(7) for _ in range(2)]
    assert SegmentWriter(tmp_path, "explorer-0", "rl").next_step == 7


def test_reader_refuses_a_segment_from_a_newer_schema(tmp_path):
    path = SegmentWriter(tmp_path, "explorer-0", "rl").write_step(0, _experiences(0))
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(UserError, match="upgrade rft-hpc"):
        read_segment(path)


def _write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return path


TEXT_LINES = {
    "sft": [{"prompt": "12+30=", "response": "42", "task_id": "a", "info": {"src": "x"}},
            {"prompt": "1+1=", "response": "2", "taskset": "tiny"}],
    "rl": [{"prompt": "2+2=", "response": "4", "reward": 1.0, "group_id": 3},
           {"prompt": "2+2=", "response": "5", "reward": 0, "priority": 2.5}],
    "dpo": [{"prompt": "3+4=", "chosen": "7", "rejected": "8"}],
}


@pytest.mark.parametrize("kind", ["sft", "rl", "dpo"])
def test_import_export_import_gives_the_same_records(tmp_path, tokenizer, kind):
    src = _write_jsonl(tmp_path / f"{kind}.jsonl", TEXT_LINES[kind])
    first = import_jsonl(src, kind, tmp_path / "a", tokenizer=tokenizer)
    assert first.records == len(TEXT_LINES[kind])
    export_jsonl(tmp_path / "a", tmp_path / "a.jsonl")
    import_jsonl(tmp_path / "a.jsonl", kind, tmp_path / "b")  # token form: no tokenizer
    export_jsonl(tmp_path / "b", tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    recs_a = [r for _, p in iter_segments(tmp_path / "a") for r in read_segment(p).records()]
    recs_b = [r for _, p in iter_segments(tmp_path / "b") for r in read_segment(p).records()]
    assert recs_a == recs_b and len(recs_a) == len(TEXT_LINES[kind])
    first_line = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])
    assert first_line["kind"] == kind


def test_text_is_tokenized_prompt_then_response_then_eos(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "s.jsonl", TEXT_LINES["sft"][:1])
    import_jsonl(src, "sft", tmp_path / "buf", tokenizer=tokenizer)
    (rec,) = read_segment(next(iter_segments(tmp_path / "buf"))[1]).records()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    assert tok.decode(rec.tokens[:rec.prompt_length]) == "12+30="
    assert rec.tokens[-1] == tok.eos_token_id
    assert tok.decode(rec.tokens[rec.prompt_length:-1]) == "42"
    assert rec.response_mask.tolist() == [0] * 6 + [1] * 3


BAD_LINES = [
    ('{"prompt": "1+1=", "response": "2"', "line 2: not valid JSON"),
    ('{"prompt": "1+1="}', "line 2: missing field(s) response"),
    ('{"prompt": "1+1=", "response": "2", "rewad": 1}', "line 2: unknown field(s) rewad"),
    ('{"tokens": [1, "x"], "prompt_length": 1}', "line 2: field 'tokens' must be a list of int"),
    ('{"tokens": [1, 2], "prompt_length": 5}', "line 2: prompt_length 5 outside 0..2"),
    ('[1, 2]', "line 2: expected a JSON object"),
    ('{"prompt": 3, "response": "2"}', "line 2: field 'prompt' must be str"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_a_malformed_line_names_its_number_and_imports_nothing(tmp_path, tokenizer, bad,
                                                                message):
    src = _write_jsonl(tmp_path / "d.jsonl", [TEXT_LINES["sft"][0], bad, TEXT_LINES["sft"][1]])
    with pytest.raises(UserError) as info:
        import_jsonl(src, "sft", tmp_path / "buf", tokenizer=tokenizer)
    assert message in str(info.value) and str(src) in str(info.value)
    assert not (tmp_path / "buf").exists() or [
        p.name for p in (tmp_path / "buf").iterdir()] == ["FORMAT"]


def test_text_without_tokenizer_and_a_second_import_are_refused(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "d.jsonl", TEXT_LINES["rl"])
    with pytest.raises(UserError, match="line 1: text fields need a tokenizer"):
        import_jsonl(src, "rl", tmp_path / "buf")
    import_jsonl(src, "rl", tmp_path / "buf", tokenizer=tokenizer)
    with pytest.raises(UserError, match="already exists"):
        import_jsonl(src, "rl", tmp_path / "buf", tokenizer=tokenizer)


def test_a_folder_that_is_not_a_buffer_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    for path, message in ((tmp_path / "plain", "is not an rft-hpc buffer"),
                          (tmp_path / "missing", "does not exist"),
                          (tmp_path / "file", "is a file")):
        for call in (summarize_buffer, verify_buffer):
            with pytest.raises(UserError, match=message):
                call(path)


def _flip_token_bytes(path):
    with h5py.File(path, "r") as f:
        offset = f["tokens"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_fix_quarantines_corrupt_segments_and_reading_goes_on(tmp_path, caplog):
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    paths = [w.write_step(s, _experiences(s)) for s in range(4)]
    _flip_token_bytes(paths[1])
    paths[2].write_bytes(paths[2].read_bytes()[: paths[2].stat().st_size // 2])
    with pytest.raises(CorruptSegment, match="checksum mismatch in tokens"):
        read_segment(paths[1])

    with caplog.at_level(logging.WARNING):
        reader = BufferReader(tmp_path)
        reader.poll()
    assert [r.step for r in reader.take(100).records] == [0] * 4 + [3] * 4
    assert paths[1].name in caplog.text and paths[2].name in caplog.text

    report = verify_buffer(tmp_path)
    assert (report.segments, report.records, len(report.problems)) == (4, 8, 2)
    fixed = verify_buffer(tmp_path, fix=True)
    assert not fixed.unfixed and all(p.quarantined_to for p in fixed.problems)
    for p in paths[1:3]:
        moved = tmp_path / "quarantine" / "explorer-0" / p.name
        assert moved.exists() and not p.exists()
        assert "verify --fix" in moved.with_name(p.name + ".reason.txt").read_text()
    assert not verify_buffer(tmp_path).problems


def test_summary_counts_records_rewards_versions_and_tokens(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl")
    for s in range(3):
        w.write_step(s, _experiences(s, n=4, length=10))
    (row,) = summarize_buffer(tmp_path)
    rewards = np.array([0.5 * i for i in range(4)] * 3)
    assert (row.segments, row.records, row.tokens) == (3, 12, 120)
    assert row.policy_versions == [0, 2] and row.steps == [0, 3]
    assert row.reward_mean == pytest.approx(rewards.mean())
    assert row.reward_std == pytest.approx(rewards.std())
    assert row.tasksets == {"math": 12}


def test_background_commit_makes_segments_visible_in_order(tmp_path):
    w = SegmentWriter(tmp_path, "explorer-0", "rl", background_commit=True)
    paths = [w.write_step(s, _experiences(s, n=2)) for s in range(5)]
    assert w.next_step == 5
    w.close()
    assert w.committed_step == 5 and all(p.exists() for p in paths)
    reader = BufferReader(tmp_path)
    reader.poll()
    assert [r.step for r in reader.take(100).records] == [s for s in range(5) for _ in range(2)]
    assert not [p for p in w.dir.iterdir() if p.name.startswith(".tmp-")]
    assert SegmentWriter(tmp_path, "explorer-0", "rl").next_step == 5
