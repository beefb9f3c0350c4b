"""Filesystem faults on real files, raised by the opener wrapper of tests/helpers/faults:
passing I/O errors are read again and never taken for damage; damage still is."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from helpers.buffer_workers import check_record, read_new, write_steps
from helpers.faults.injector import Schedule, fired, install

from rft_hpc.buffer import BufferReader
from rft_hpc.buffer.archive import list_writer
from rft_hpc.buffer.compact import compact_buffer
from rft_hpc.buffer.layout import QUARANTINE
from rft_hpc.buffer.segment import segment_name
from rft_hpc.config.buffer import CompactConfig
from rft_hpc.core.retry import PROCESS_COUNTERS, RetryPolicy
from rft_hpc.core.rundir import RunDir
from rft_hpc.ledger.log import LedgerWriter
from rft_hpc.ledger.replay import read_events
from rft_hpc.runtime.common import StopFlag
from rft_hpc.runtime.signals import STOP_SIGNALS
from rft_hpc.sync.follower import WeightFollower
from rft_hpc.sync.weight_files import load_weights, publish_weights

RECORDS = 4


@pytest.fixture
def faults(tmp_path: Path) -> Iterator[Any]:
    """`faults(*entries)` installs a schedule in this process until the test ends; the
    firings are read back with `fired(tmp_path / "faults.jsonl")`."""
    undo: list[Any] = []

    def start(*entries: dict[str, Any]) -> Path:
        log = tmp_path / "faults.jsonl"
        undo.append(install(Schedule.from_json(json.dumps({"seed": 0, "log": str(log),
                                                            "faults": list(entries)}))))
        return log

    yield start
    for u in reversed(undo):
        u()


def steps_read(reader: BufferReader) -> Counter[int]:
    """Steps of the records read now, each record's content checked, with multiplicity."""
    return Counter(check_record(r)["step"] for r in read_new(reader))


def quarantined(buffer: Path) -> list[str]:
    return sorted(p.name for p in (buffer / QUARANTINE).rglob("*") if p.is_file())


def segment_fault(step: int, code: str, nth: list[int]) -> dict[str, Any]:
    return {"call": "h5py.File", "path": f"w0/{segment_name(step)}$", "nth": nth,
            "errno": code}


def test_one_eio_and_one_estale_on_segment_reads_lose_nothing(buffer_dir: Path, faults) -> None:
    write_steps(buffer_dir, range(6), RECORDS)
    log = faults(segment_fault(1, "EIO", [1]), segment_fault(3, "ESTALE", [1]))
    reader = BufferReader(buffer_dir, quarantine=True)
    seen = steps_read(reader)
    assert [(f["path"].split("/")[-1], f["errno"]) for f in fired(log)] == [
        ("00000001.h5", "EIO"), ("00000003.h5", "ESTALE")]
    assert seen == {step: RECORDS for step in range(6)}  # every record, once
    assert quarantined(buffer_dir) == [] and reader.skipped == []
    assert reader.counters["corrupt_segments"] == 0
    assert reader.io_metrics() == {"io_retries": 2, "io_recovered": 2, "io_gave_up": 0,
                                   "io_late": 0, "reads_deferred": 0}


def test_an_error_that_outlasts_the_retries_leaves_the_segment_for_a_later_poll(
        buffer_dir: Path, faults, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    w = write_steps(buffer_dir, range(4), RECORDS)
    faults(segment_fault(2, "EIO", [1, 2, 3]))
    policy = RetryPolicy(tries=3, first_delay_s=0.01, later_s=0.3)
    reader = BufferReader(buffer_dir, quarantine=True, retry=policy)
    assert steps_read(reader) == {0: RECORDS, 1: RECORDS}  # stops at step 2 for now
    write_steps(buffer_dir, range(4, 6), RECORDS, into=w)
    assert steps_read(reader) == {}  # still waiting: later segments do not jump the queue
    assert reader.pending == 1  # not out of data: a trainer keeps waiting for it
    pending = str(buffer_dir / "w0" / segment_name(2))
    assert any(pending in r.getMessage() and "left pending" in r.getMessage()
               for r in caplog.records)
    time.sleep(policy.later_s)
    assert steps_read(reader) == {step: RECORDS for step in range(2, 6)}
    assert reader.pending == 0
    assert quarantined(buffer_dir) == [] and reader.skipped == []
    assert reader.counters["reads_deferred"] == 1 and reader.counters["io_gave_up"] == 1


def flip_a_data_byte(path: Path) -> None:
    """Flip one bit in the middle of the `tokens` dataset's bytes."""
    with h5py.File(path, "r") as f:
        offset, size = f["tokens"].id.get_offset(), f["tokens"].id.get_storage_size()
    with open(path, "r+b") as fh:
        fh.seek(offset + size // 2)
        b = fh.read(1)
        fh.seek(offset + size // 2)
        fh.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_byte_is_quarantined_at_once(buffer_dir: Path) -> None:
    write_steps(buffer_dir, range(4), RECORDS)
    flip_a_data_byte(buffer_dir / "w0" / segment_name(1))
    reader = BufferReader(buffer_dir, quarantine=True)
    assert steps_read(reader) == {0: RECORDS, 2: RECORDS, 3: RECORDS}
    assert quarantined(buffer_dir) == ["00000001.h5", "00000001.h5.reason.txt"]
    reason = (buffer_dir / QUARANTINE / "w0" / "00000001.h5.reason.txt").read_text()
    assert "checksum mismatch in tokens" in reason
    assert reader.counters["io_retries"] == 0  # proof on the first read: no second one


def test_a_malformed_hdf5_file_is_quarantined_once_it_fails_alike_twice(
        buffer_dir: Path) -> None:
    write_steps(buffer_dir, range(4), RECORDS)
    path = buffer_dir / "w0" / segment_name(2)
    os.truncate(path, path.stat().st_size // 2)
    reader = BufferReader(buffer_dir, quarantine=True)
    assert steps_read(reader) == {0: RECORDS, 1: RECORDS, 3: RECORDS}
    assert "00000002.h5" in quarantined(buffer_dir)
    assert reader.counters["io_retries"] == 1  # read a second time before the verdict


def test_an_eio_on_an_archive_read_loses_nothing(buffer_dir: Path, faults) -> None:
    write_steps(buffer_dir, range(6), RECORDS)
    consumer = BufferReader(buffer_dir)
    assert sum(steps_read(consumer).values()) == 6 * RECORDS
    compact_buffer(buffer_dir, consumer.state_dict(), CompactConfig(min_segments=2, fanout=2),
                   durable=False)
    [(start, end)] = list_writer(buffer_dir / "w0").archives
    log = faults({"call": "h5py.File", "path": "archive-", "nth": [1], "errno": "EIO"})
    reader = BufferReader(buffer_dir, quarantine=True)
    assert steps_read(reader) == {step: RECORDS for step in range(6)}
    assert len(fired(log)) == 1 and (start, end) == (0, 6)
    assert quarantined(buffer_dir) == [] and reader.counters["io_recovered"] == 1


def test_weights_and_ledgers_are_read_through_an_eio(tmp_path: Path, faults) -> None:
    weights = tmp_path / "weights"
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    publish_weights(weights, state, 1)
    ledger = LedgerWriter(tmp_path / "ledger", "trainer")
    ledger.append("step", step=1)
    ledger.close()
    before = PROCESS_COUNTERS["io_recovered"]
    log = faults({"call": "open", "path": r"model\.safetensors$", "nth": [1], "errno": "EIO"},
                 {"call": "open", "path": r"manifest\.json$", "nth": [1], "errno": "ESTALE"},
                 {"call": "open", "path": r"LATEST$", "nth": [1], "errno": "EAGAIN"},
                 {"call": "open", "path": r"trainer\.jsonl$", "nth": [1], "errno": "EIO"})
    from rft_hpc.sync.weight_files import latest_weights_version

    assert latest_weights_version(weights) == 1
    assert torch.equal(load_weights(weights, 1)["w"], state["w"])
    assert [e.kind for e in read_events(tmp_path / "ledger" / "trainer.jsonl")] == [
        "ledger", "step"]
    assert sorted(f["errno"] for f in fired(log)) == ["EAGAIN", "EIO", "EIO", "ESTALE"]
    assert PROCESS_COUNTERS["io_recovered"] - before == 4


def test_the_injector_counts_per_fault_and_leaves_other_paths_alone(
        tmp_path: Path, faults) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a")
    b.write_text("b")
    faults({"call": "open", "path": r"a\.txt$", "mode": "read", "nth": [2], "errno": "EIO"})
    assert a.read_text() == "a" and b.read_text() == "b"
    with pytest.raises(OSError) as caught:
        a.read_text()
    assert caught.value.errno == errno.EIO
    a.write_text("written")  # a write is not a read
    assert a.read_text() == "written"


def test_a_restored_reader_keeps_records_whose_segment_is_unreadable_for_now(
        buffer_dir: Path, faults) -> None:
    write_steps(buffer_dir, range(3), RECORDS)
    first = BufferReader(buffer_dir)
    first.poll()
    handed = [check_record(r)["step"] for r in first.take(2).records]
    state = json.loads(json.dumps(first.state_dict()))
    faults(segment_fault(1, "ESTALE", [1, 2]))
    policy = RetryPolicy(tries=2, first_delay_s=0.01, later_s=0.3)
    restored = BufferReader(buffer_dir, state=state, retry=policy)
    now = Counter(check_record(r)["step"] for r in restored.take(100).records)
    assert now == {0: RECORDS - 2, 2: RECORDS}  # step 1's records wait ...
    assert restored.pending == RECORDS + 1 and restored.counters["lost_records"] == 0
    time.sleep(policy.later_s)
    later = Counter(check_record(r)["step"] for r in restored.take(100).records)
    assert later == {1: RECORDS}  # ... and come once their segment reads again
    assert Counter(handed) + now + later == {step: RECORDS for step in range(3)}


def test_an_os_error_that_says_nothing_of_the_bytes_is_no_verdict(buffer_dir: Path,
                                                                  faults) -> None:
    write_steps(buffer_dir, range(3), RECORDS)
    faults(segment_fault(1, "EMFILE", [1]), segment_fault(2, "EACCES", [1]))
    policy = RetryPolicy(later_s=0.2)
    reader = BufferReader(buffer_dir, quarantine=True, retry=policy)
    seen = steps_read(reader)
    assert seen == {0: RECORDS}
    assert reader.counters["io_retries"] == 0  # not retried on the spot ...
    for _ in range(2):
        time.sleep(policy.later_s)
        seen += steps_read(reader)
    assert quarantined(buffer_dir) == [] and reader.skipped == []  # ... nor judged
    assert seen == {step: RECORDS for step in range(3)}


class Sink:
    """What an explorer's follower loads versions into (the `WeightSink` seam): it keeps
    the versions and tensors it was given."""

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[int, torch.Tensor]] = []

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.loaded.append((version, state_dict["w"].clone()))
        self.version = version


def test_an_explorer_keeps_its_weights_while_a_new_version_is_unreadable(
        tmp_path: Path, faults, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    run = RunDir(tmp_path / "run")
    states = {v: {"w": torch.full((3, 4), float(v))} for v in (1, 2)}
    publish_weights(run.weights, states[1], 1)
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    follower = WeightFollower(run, Sink(), StopFlag())
    try:
        assert follower.refresh() == 1
        publish_weights(run.weights, states[2], 2)
        # every try of the default retries fails: the version stays unreadable for now
        log = faults({"call": "open", "path": r"v0*2/model\.safetensors$", "nth": [1, 2, 3, 4],
                      "errno": "EIO"})
        assert follower.refresh() == 1  # no crash: it keeps what it holds
        assert len(fired(log)) == 4
        assert any("keeping version 1" in r.getMessage() for r in caplog.records)
        assert follower.refresh() == 2  # the fault passed: the next refresh takes it
        assert [(v, float(w[0, 0])) for v, w in follower.engine.loaded] == [(1, 1.0), (2, 2.0)]
    finally:
        follower.close()
        for s, h in handlers.items():
            signal.signal(s, h)
