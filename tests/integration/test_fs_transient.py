"""The demo's GRPO stage (shrunk) on a filesystem that fails as a shared one does under load
(tests/helpers/faultfs): EIO or ESTALE on opens, creates and reads, short reads, or renames
that other processes see late. Each class strikes every process at a seeded rate; the run
must finish, `rft-hpc audit` pass, and the buffer counted with plain h5py must be exactly
what the trainer consumed: nothing lost, nothing doubled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.fault_runs import assert_nothing_lost, demo_on
from helpers.faultfs import FaultMount

from rft_hpc.monitor.metrics import read_metrics

ROLES = ("trainer", "explorer-0", "explorer-1")
WRITTEN = 2 * 6 * 2 * 8  # explorers x steps x tasks x repeat


def errors(code: str, rate: float) -> dict[str, Any]:
    """`code` on a share `rate` of the opens, creates and reads of every process."""
    return {"seed": 0, "faults": [{"ops": ["open", "create", "read"], "errno": code,
                                   "rate": rate}]}


CLASSES = {
    "eio": errors("EIO", 0.03),
    # Linux opens again once after ESTALE, and a failed read-ahead is read again: fewer
    # reach the program than strike, so a higher rate
    "estale": errors("ESTALE", 0.1),
    "short_reads": {"seed": 0, "faults": [{"ops": ["read"], "short": 0.2}]},
    "late_renames": {"seed": 0, "rename_lag": 2.0},
}


LONG = ("estale", "short_reads")
"""Classes left to `pytest -m long` (the suite's time): EIO and late renames run in CI."""


def last_io(stage: Path, role: str) -> dict[str, int]:
    """The retry counts in the role's last metrics row (they add up over the process)."""
    rows = [r for r in read_metrics(stage / "metrics" / f"{role}.jsonl") if "io_retries" in r]
    return {k: rows[-1][k] for k in ("io_retries", "io_late")} if rows else {}


@pytest.mark.needs_program("fusermount3")
@pytest.mark.needs_module("mfusepy")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.long) if f in LONG else f
                                   for f in CLASSES])
def test_a_run_on_a_failing_shared_filesystem_trains_every_record_once(
        tmp_path: Path, tiny_model: Path, fault: str) -> None:
    schedule = CLASSES[fault]
    with FaultMount(tmp_path / "fs", schedule) as fs:
        result = demo_on(fs, tiny_model)
        assert result.returncode == 0, result.stderr[-4000:]
        struck = fs.fired()
    stage = fs.backing / "demo" / "stages" / "0-main"
    assert assert_nothing_lost(fs)["in_buffer"] == WRITTEN

    io = {role: last_io(stage, role) for role in ROLES}
    if "faults" in schedule:
        roles_struck = {s["process"] for s in struck}
        assert roles_struck & set(ROLES), struck[:5]
    if fault in ("eio", "estale"):  # errors are retried, and counted where the role says
        assert {s["errno"] for s in struck if not s["short"]} == {fault.upper()}
        assert sum(c.get("io_retries", 0) for c in io.values()) > 0, io
    elif fault == "short_reads":  # a short read is no error: read on, nothing to retry
        assert all(s["short"] for s in struck)
    else:  # explorers waited for weights LATEST named before they could see them
        assert sum(io[r].get("io_late", 0) for r in ROLES[1:]) > 0, io
