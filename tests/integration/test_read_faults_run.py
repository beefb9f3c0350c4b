"""A real run whose trainer meets an EIO and an ESTALE reading two of its segments (raised by
the tests/helpers/faults preload in the trainer process alone): nothing is quarantined and
every record written is trained on exactly once, as `rft-hpc audit` checks."""

from __future__ import annotations

import json

import pytest
from helpers.faults import environment
from helpers.faults.injector import fired
from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.buffer.layout import QUARANTINE
from rft_hpc.monitor.metrics import read_metrics

TRAINER = r"\brole trainer\b"


@pytest.mark.timeout(600)
def test_a_trainer_reads_through_an_eio_and_an_estale_and_trains_every_record_once(
        tmp_path, tiny_model):
    log = tmp_path / "faults.jsonl"
    segments = r"/stages/0-main/buffer/explorer-{}/{:08d}\.h5$"
    schedule = {"seed": 0, "log": str(log), "faults": [
        {"call": "h5py.File", "path": segments.format(0, 1), "process": TRAINER, "nth": [1],
         "errno": "EIO"},
        {"call": "h5py.File", "path": segments.format(1, 3), "process": TRAINER, "nth": [1],
         "errno": "ESTALE"}]}
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "eval.interval=0"),
                 env=environment(schedule), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "demo" / "stages" / "0-main"

    hits = fired(log)
    assert [(h["path"].rsplit("/", 2)[-2:], h["errno"]) for h in hits] == [
        (["explorer-0", "00000001.h5"], "EIO"), (["explorer-1", "00000003.h5"], "ESTALE")]
    assert not list((stage / "buffer" / QUARANTINE).rglob("*"))
    written = len(rollouts(stage))
    assert written == 2 * 6 * 2 * 8  # explorers x steps x tasks x repeat

    report = rft("audit", tmp_path / "demo", "--json", timeout=300)
    assert report.returncode == 0, report.stdout[-3000:]
    records = json.loads(report.stdout)["stages"][0]["records"]
    assert records["consumed"] == records["in_buffer"] == written, records
    assert records["lost"] == 0 and records["unconsumed"] == 0, records
    last = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r][-1]
    assert (last["io_retries"], last["io_recovered"], last["io_gave_up"]) == (2, 2, 0)
