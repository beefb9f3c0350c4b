"""The demo's GRPO stage, shrunk, on a fault filesystem (tests/helpers/faultfs), and the checks
every fault class ends with: `rft-hpc audit` passes and the buffer, counted with plain h5py,
holds exactly the samples the trainer trained on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import yaml

from helpers.faultfs import FaultMount
from helpers.paths import DEMO
from helpers.runs import rft, short
from rft_hpc.monitor.metrics import read_metrics

STAGE = Path("demo") / "stages" / "0-main"


def demo_on(fs: FaultMount, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`rft-hpc run` of the demo's GRPO stage, shrunk (tests/helpers/runs.py), with its run
    directory on the fault filesystem; the same command each time it is called."""
    return rft("run", DEMO, *short(fs.path, model, "--set", "stages=[]",
                                   "--set", "eval.interval=0", *extra), timeout=600)


def h5py_rows(buffer: Path) -> int:
    """Records in the committed segments and archives under `buffer`, read with plain h5py
    (docs/buffer-format.md), not with rft-hpc's reader."""
    rows = 0
    for path in sorted(buffer.glob("explorer-*/*.h5")):
        if path.name.startswith(".tmp-"):  # not committed: never read
            continue
        with h5py.File(path, "r") as f:
            rows += int(f.attrs["num_records"])
    return rows


def trained_samples(stage: Path) -> int:
    """Samples in the trained weights: the trainer's steps (metrics rows with a loss; a step
    redone after a restart from an earlier checkpoint counts once, as its last row) times the
    stage's batch size, less the records dropped as stale."""
    steps = {r["step"]: r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
             if "loss" in r}
    batch = yaml.safe_load((stage / "config.yaml").read_text())["trainer"]["batch_size"]
    return sum(int(batch) - int(r.get("stale_dropped", 0)) for r in steps.values())


def assert_nothing_lost(fs: FaultMount) -> dict:
    """`rft-hpc audit` passes on the run and every record in the buffer (plain h5py, read from
    the backing folder: the checks meet no faults) was trained on once; the audit's records."""
    report = rft("audit", fs.backing / "demo", "--json", timeout=300)
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-2000:]
    records = json.loads(report.stdout)["stages"][0]["records"]
    stage = fs.backing / STAGE
    rows = h5py_rows(stage / "buffer")
    assert records["lost"] == 0 and records["unconsumed"] == 0, records
    assert records["consumed"] == records["in_buffer"] == rows, (records, rows)
    assert trained_samples(stage) == rows, (trained_samples(stage), rows)
    return records
