"""A colocated stage under Slurm (`launch.colocate: true`): one job runs the trainer and
explorer 0 in one process, no explorer array. Hard-requeued (`scontrol requeue`) mid-run,
it resumes from its checkpoint: the run finishes, `rft-hpc audit` passes, and the final
weights equal those of the same config run without interruption (1e-6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.paths import DEMO
from helpers.runs import rft as rft_local
from helpers.runs import short
from helpers.slurm_cluster import slurm
from helpers.slurm_runs import finished, heartbeat, rft, status, submit, unique, wait_until

from rft_hpc.sync.weight_files import load_weights

STEPS = 30
SETTINGS = ("--set", "explorer.count=1", "--set", "sync.offset=0",
            "--set", "trainer.batch_size=16", "--set", "trainer.threads=1",
            "--set", "launch.colocate=true")
"""Strictly on-policy, one explorer step a batch, one thread: deterministic."""


@pytest.mark.long  # ~1 min; the requeue path is the trainer job's, which CI's chaos cases run
@pytest.mark.timeout(900)
def test_a_requeued_colocated_job_ends_with_the_weights_of_an_uninterrupted_run(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    run = submit(slurm_env, tmp_path, tiny_model, unique("colocated"),
                 "--set", f"trainer.steps={STEPS}", *SETTINGS)
    jobs = {j["name"]: j["id"] for j in status(slurm_env, run)["jobs"]}
    assert "main.trainer" in jobs and "main.explorer" not in jobs, jobs
    script = (run / "jobs").glob("*trainer*.sbatch")
    assert any("role colocated" in p.read_text() for p in script), list((run / "jobs").iterdir())

    def saved_and_running(restarts: int):
        def check() -> bool:
            beat = heartbeat(run, "trainer")
            return (beat.get("status") == "running" and beat.get("restarts", 0) >= restarts
                    and beat.get("step", 0) >= 6)
        return check

    wait_until(saved_and_running(0), what="the colocated job past its first checkpoint")
    slurm(["scontrol", "requeue", jobs["main.trainer"]], slurm_env)
    wait_until(saved_and_running(1), timeout=300, what="the colocated job back after the requeue")
    finished(slurm_env, run, steps=STEPS)
    assert heartbeat(run, "explorer-0")["status"] == "done"

    result = rft(slurm_env, "audit", run, "--json")
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    assert result.returncode == 0 and report.get("ok"), result.stdout[-4000:] + result.stderr
    assert report["stages"][0]["trainer"]["restarts"] >= 1

    straight = rft_local("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                             "--set", "run.name=straight",
                                             "--set", "eval.interval=0",
                                             "--set", "trainer.save_interval=5",
                                             "--set", f"trainer.steps={STEPS}", *SETTINGS),
                         timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    one = load_weights(tmp_path / "straight" / "stages" / "0-main" / "weights", STEPS)
    two = load_weights(run / "stages" / "0-main" / "weights", STEPS)
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"final weights, uninterrupted vs requeued colocated job: max |diff| {diff:.3g}")
    assert diff <= 1e-6
