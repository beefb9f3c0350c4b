"""Slow metadata (a busy metadata server): every stat, open, create, rename, listdir and unlink
of every process of a run waits 20 ms (tests/helpers/faultfs). The demo's GRPO stage still
finishes with nothing lost, and no role's metadata calls per step run away: a loop that polled
without pause, or redid a commit per retry, would make thousands. tools/bench/metadata.py
prints the figures beside an undelayed run."""

from __future__ import annotations

import pytest
from helpers.fault_runs import STAGE, assert_nothing_lost, demo_on
from helpers.faultfs import FaultMount
from helpers.faultfs.fs import METADATA

from rft_hpc.monitor.metrics import read_metrics

pytestmark = [pytest.mark.needs_program("fusermount3"), pytest.mark.needs_module("mfusepy")]

CALLS_PER_STEP = 200
"""Ceiling on a role's metadata calls per step of the shrunk run (measured 2026-12-07 on 20
trainer steps: trainer 122, explorers 72; the shrunk run's start-up adds a share per step)."""


@pytest.mark.long
@pytest.mark.timeout(600)
def test_the_demo_finishes_on_slow_metadata_without_polls_running_away(tmp_path, tiny_model):
    with FaultMount(tmp_path / "fs", {"faults": [], "metadata_delay": 0.02}) as fs:
        result = demo_on(fs, tiny_model)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_nothing_lost(fs)
    stage = fs.backing / STAGE
    calls = fs.stats()["calls"]
    for role in ("trainer", "explorer-0", "explorer-1"):
        steps = max(r["step"] for r in read_metrics(stage / "metrics" / f"{role}.jsonl"))
        made = sum(n for op, n in calls[role].items() if op in METADATA)
        assert 0 < made <= CALLS_PER_STEP * steps, (role, made, steps, calls[role])
