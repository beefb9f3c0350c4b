"""The reward job on the local Slurm cluster: its own array job beside two explorers and a
trainer, SIGKILLed once and hard-requeued once (`scontrol requeue`) while the explorers wait
on it. The run finishes, `rft-hpc audit` passes (the reward ledger scored every request a
record names; no call is in the buffer twice), and every record of every explorer step is
in the buffer, each scored by the reward job: none lost, none twice. And how an explorer
tells a reward job Slurm still holds (waited for) from one it no longer does (gone)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from helpers.reward_models import reward_model
from helpers.slurm_cluster import slurm
from helpers.slurm_runs import finished, heartbeat, rft, status, submit, unique, wait_until

from rft_hpc.buffer.jsonl import iter_segments
from rft_hpc.buffer.segment import read_segment
from rft_hpc.tasks.remote_reward import HeartbeatWatch
from rft_hpc.tasks.reward_requests import job_folder, unanswered

STEPS = 20  # margin: the two events need ~4 of them; a loaded machine slows the test too
RECORDS_PER_STEP = 16
"""Of one explorer step of the chaos demo: 2 tasks x 8 rollouts."""


def reward_running(run: Path, restarts: int, scored: int = 1):
    """A predicate: reward job 0 runs in its `restarts`-th life (or later) and has answered
    `scored` requests in it, so explorers are sending it work."""
    def check() -> bool:
        beat = heartbeat(run, "reward-0")
        return (beat.get("status") == "running" and beat.get("restarts", 0) >= restarts
                and beat.get("step", 0) >= scored)
    return check


@pytest.mark.timeout(900)
def test_a_killed_and_requeued_reward_job_loses_and_doubles_nothing(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    rm = reward_model(tmp_path / "rm")
    reward = f"[{{name: exact_match, weight: 0.5}}, {{model: {rm}, weight: 2.0}}]"
    run = submit(slurm_env, tmp_path, tiny_model, unique("rewardjob"),
                 "--set", f"trainer.steps={STEPS}", "--set", f"tasks.reward={reward}",
                 "--set", "reward_job.count=1")
    folder = job_folder(run / "stages" / "0-main", 0)

    def waiting() -> bool:  # an explorer's request without a response
        return bool(unanswered(folder))

    reward_job = next(j["id"] for j in status(slurm_env, run)["jobs"]
                      if j["name"] == "main.reward")
    # (a) its process SIGKILLed while serving: the job script requeues it (a crash)
    wait_until(reward_running(run, 0), what="the reward job serving")
    os.kill(heartbeat(run, "reward-0")["pid"], signal.SIGKILL)
    wait_until(waiting, what="explorers waiting on the killed reward job")
    # (b) its second life requeued by the operator while serving
    wait_until(reward_running(run, 1), what="the reward job back after the kill")
    slurm(["scontrol", "requeue", reward_job], slurm_env)
    wait_until(waiting, what="explorers waiting on the requeued reward job")
    wait_until(reward_running(run, 2, scored=0), what="the reward job back after the requeue")

    finished(slurm_env, run, steps=STEPS)
    result = rft(slurm_env, "audit", run, "--json")
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    assert result.returncode == 0 and report.get("ok"), result.stdout[-4000:] + result.stderr
    stage = report["stages"][0]
    assert stage["reward_jobs"]["restarts"] >= 2, stage["reward_jobs"]
    checks = {c["check"]: c["result"] for c in stage["checks"]}
    assert checks["reward ledgers"] == checks["reward requests"] == "PASS", checks

    # every explorer step's records are in the buffer once, each scored by the reward job
    per_step = Counter[tuple[str, int]]()
    named = []
    for _, path in iter_segments(run / "stages" / "0-main" / "buffer"):
        for record in read_segment(path).records():
            per_step[path.parent.name, record.step] += 1
            named.append(record.info["reward_request"])
            assert "reward_failure" not in record.info, record.info
    for name, explorer in stage["explorers"].items():
        assert [per_step[name, s] for s in range(explorer["steps"])] \
            == [RECORDS_PER_STEP] * explorer["steps"], (name, per_step)
    assert len(named) == sum(per_step.values()) == stage["records"]["in_buffer"]
    assert len(named) >= STEPS * 32  # the trainer's batches of 32
    assert len(set(named)) == len(named)  # no call scored into the buffer twice


def test_a_reward_job_is_waited_for_while_slurm_holds_it_and_gone_once_it_does_not(
        slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in slurm_env.items():
        monkeypatch.setenv(name, value)
    state = tmp_path / "state"
    state.mkdir()
    job = slurm(["sbatch", "--parsable", "--array=0", f"--output={tmp_path}/%A.out",
                 "--wrap", "sleep 300"], slurm_env).strip().split(";")[0]
    try:
        (state / "reward-0.json").write_text(json.dumps({"status": "running",
                                                         "job": f"{job}_0"}))
        watch = HeartbeatWatch(tmp_path, 0)
        assert watch.gone() is None  # pending or running: waited for
        slurm(["scancel", job], slurm_env)
        wait_until(lambda: watch.gone() is not None, timeout=60, what="the job gone")
        assert watch.gone() == f"reward-0's Slurm job {job}_0 is no longer queued or running"
    finally:
        with contextlib.suppress(AssertionError):  # cancelled already
            slurm(["scancel", job], slurm_env)
