"""Chaos on the local Slurm cluster: signals, killed processes, requeues, time limits and
cancelled jobs. Every case ends with a passing `rft-hpc audit`: every experience trained on
exactly once, no trainer step done twice, versions in order, restarts counted."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers.paths import DEMO
from helpers.slurm_cluster import slurm
from helpers.slurm_runs import (
    chaos_args,
    finished,
    heartbeat,
    jobs_in_queue,
    remember,
    rft,
    running_at,
    status,
    submit,
    unique,
    wait_until,
)

WALLTIME_STEPS = 64


def job_id(env: dict[str, str], run: Path, name: str) -> str:
    return next(j["id"] for j in status(env, run)["jobs"] if j["name"] == name)


def submissions(run: Path) -> int:
    """How many times the run was submitted, as state/jobs.json records it (0 before)."""
    try:
        return len(json.loads((run / "state" / "jobs.json").read_text())["submissions"])
    except (OSError, ValueError, KeyError):
        return 0


def audit(env: dict[str, str], run: Path) -> dict:
    result = rft(env, "audit", run, "--json")
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    assert result.returncode == 0 and report.get("ok"), result.stdout[-4000:] + result.stderr
    stage = report["stages"][0]
    print(json.dumps({"trainer": stage["trainer"], "explorers": stage["explorers"]}, indent=1))
    return stage


@pytest.mark.timeout(900)  # ~120 s here, 170 s loaded
def test_trainer_signals_killed_explorers_and_a_requeued_array_lose_nothing(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    # 48 steps: the events below need ~16 (the trainer's 3 lives end at steps 2, 5 and 8;
    # each explorer outage holds it back), the rest is margin: a step of this run takes
    # ~0.1 s, and under a loaded suite the trainer was at step 16 before the first signal
    # reached it and the run ended before explorer 0's second life (24 steps, 2026-12-06)
    run = submit(slurm_env, tmp_path, tiny_model, unique("chaos"), "--set", "trainer.steps=48")
    trainer = job_id(slurm_env, run, "main.trainer")
    explorers = job_id(slurm_env, run, "main.explorer")
    # (a) Slurm's warning signal to the trainer, 3 times: it saves and requeues itself
    for n in range(3):
        wait_until(running_at(run, "trainer", 3 * n + 2, restarts=n), what=f"trainer life {n}")
        slurm(["scancel", "--signal=USR2", trainer], slurm_env)
    wait_until(running_at(run, "trainer", 0, restarts=3), what="trainer after 3 signals")
    # (b) explorer 0's process SIGKILLed with requests in flight (a step written, the next
    # submitted, at one step ahead of the weights), twice: its job requeues itself and redoes
    # the uncommitted steps
    for n in range(2):
        wait_until(running_at(run, "explorer-0", 1, restarts=n, in_flight=1),
                   what=f"explorer life {n} with a step in flight")
        os.kill(heartbeat(run, "explorer-0")["pid"], signal.SIGKILL)
    # (c) the whole explorer array requeued by the operator, both tasks running
    wait_until(running_at(run, "explorer-0", 1, restarts=2), what="explorer 0 back")
    wait_until(running_at(run, "explorer-1", 1), what="explorer 1")
    slurm(["scontrol", "requeue", explorers], slurm_env)
    wait_until(lambda: heartbeat(run, "explorer-1").get("restarts", 0) >= 1
               or not jobs_in_queue(slurm_env, run.name), what="explorer 1 requeued")

    finished(slurm_env, run, steps=48)
    stage = audit(slurm_env, run)
    assert stage["trainer"]["restarts"] == 3
    assert stage["trainer"]["causes"] == ["requeue"] * 3
    assert stage["explorers"]["explorer-0"]["restarts"] >= 3  # 2 kills + the requeue
    assert stage["explorers"]["explorer-0"]["causes"][:2] == ["crash", "crash"]
    assert stage["explorers"]["explorer-1"]["restarts"] >= 1
    beats = {r["role"]: r for r in status(slurm_env, run)["roles"]}
    assert beats["trainer"]["restarts"] == 3 and beats["explorer-0"]["restarts"] >= 3


@pytest.mark.timeout(1500)  # its own wait for the run is 1200 s
def test_a_one_minute_time_limit_finishes_through_requeues(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    # Jobs of 1 minute for ~2.5 minutes of work: each role stops before its limit and requeues
    # itself. The work is mostly waiting (a reward that sleeps 0.1 s: 64 steps x 16 rollouts,
    # ~100 s per explorer, 2 explorers one step ahead of the trainer), so the number of lives
    # follows the clock, not the machine's speed, and the case costs few CPU-seconds (each
    # life's start-up is most of them).
    run = submit(slurm_env, tmp_path, tiny_model, unique("walltime"),
                 "--set", f"trainer.steps={WALLTIME_STEPS}",
                 "--set", "tasks.reward=tests.helpers.rewards:slow_exact_match",
                 "--set", "launch.slurm.trainer.time=1", "--set", "launch.slurm.explorer.time=1",
                 "--set", "launch.slurm.signal_delay=10",
                 "--set", "launch.slurm.walltime_margin=10")
    finished(slurm_env, run, timeout=1200, steps=WALLTIME_STEPS)
    stage = audit(slurm_env, run)
    assert stage["trainer"]["restarts"] >= 2, stage["trainer"]  # 3+ lives of <= 1 minute
    assert set(stage["trainer"]["causes"]) <= {"walltime", "requeue"}, stage["trainer"]
    timeouts = slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--format=State",
                      f"--name={run.name}.main.trainer"], slurm_env).split()
    assert "TIMEOUT" not in timeouts, timeouts


def test_a_cancelled_job_is_brought_back_by_resume(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    run = submit(slurm_env, tmp_path, tiny_model, unique("resume"), "--set", "trainer.steps=16")
    trainer = job_id(slurm_env, run, "main.trainer")  # before: a status takes a second or two
    wait_until(running_at(run, "trainer", 3), what="trainer at step 3")
    slurm(["scancel", trainer], slurm_env)
    wait_until(lambda: heartbeat(run, "trainer").get("status") == "stopped"
               and f"{run.name}.main.trainer" not in jobs_in_queue(slurm_env, run.name),
               what="the trainer cancelled")
    assert heartbeat(run, "trainer")["status"] == "stopped"

    resumed = rft(slurm_env, "resume", run)
    assert resumed.returncode == 0, resumed.stderr
    # the explorers, still running, are kept; the trainer and what waited for it come back
    assert "main.trainer" in resumed.stdout and "finalize" in resumed.stdout
    assert "main.explorer " not in resumed.stdout, resumed.stdout
    finished(slurm_env, run, steps=16)
    stage = audit(slurm_env, run)
    assert stage["trainer"]["restarts"] == 1 and stage["trainer"]["causes"] == ["stopped"]
    assert status(slurm_env, run)["submissions"] == 2
    again = rft(slurm_env, "resume", run)
    assert again.returncode == 0 and "nothing to resume" in again.stdout


def test_auto_resume_brings_back_a_cancelled_trainer_without_a_person(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    name = unique("auto")
    result = rft(slurm_env, "submit", DEMO, *chaos_args(tmp_path, tiny_model),
                 "--set", "trainer.steps=16", "--name", name, "--auto-resume")
    assert result.returncode == 0 and "afternotok" in result.stdout, result.stderr
    run = tmp_path / name
    remember(slurm_env, run)
    trainer = job_id(slurm_env, run, "main.trainer")  # before: a status takes a second or two
    wait_until(running_at(run, "trainer", 3), what="trainer at step 3")
    slurm(["scancel", trainer], slurm_env)
    # state/jobs.json lists the submissions that `status` counts: read here, not through a
    # status process every 0.2 s (the CPU the run's roles need)
    wait_until(lambda: submissions(run) == 2, timeout=120,
               what="the watcher's resubmission")
    finished(slurm_env, run, steps=16)
    assert status(slurm_env, run)["submissions"] == 2
    stage = audit(slurm_env, run)
    assert stage["trainer"]["restarts"] == 1
    watch_log = (run / "jobs" / "watch.log").read_text()
    assert "resubmitted: main.trainer" in watch_log, watch_log


def test_explorers_whose_trainer_is_gone_stop_instead_of_requeueing(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    run = submit(slurm_env, tmp_path, tiny_model, unique("orphan"), "--set", "trainer.steps=16")
    trainer = job_id(slurm_env, run, "main.trainer")  # before: a status takes a second or two
    for role in ("trainer", "explorer-0", "explorer-1"):
        wait_until(running_at(run, role, 1), what=f"{role} at step 1")
    slurm(["scancel", trainer], slurm_env)
    wait_until(lambda: f"{run.name}.main.trainer" not in jobs_in_queue(slurm_env, run.name),
               what="the trainer cancelled")
    # the warning of the explorers' time limit: they save and would requeue themselves
    slurm(["scancel", "--signal=USR2", job_id(slurm_env, run, "main.explorer")], slurm_env)
    wait_until(lambda: f"{run.name}.main.explorer" not in jobs_in_queue(slurm_env, run.name),
               what="the explorers gone from the queue")
    for i in (0, 1):
        log = (run / "stages" / "0-main" / "jobs" / f"explorer-{i}.log").read_text()
        assert f"not requeued: no job {run.name}.main.trainer is queued" in log, log[-3000:]
        assert "requeueing job" not in log, log[-3000:]

    resumed = rft(slurm_env, "resume", run)
    assert resumed.returncode == 0, resumed.stderr
    assert "main.trainer" in resumed.stdout and "main.explorer" in resumed.stdout
    finished(slurm_env, run, steps=16)
    stage = audit(slurm_env, run)
    assert stage["trainer"]["restarts"] == 1
    assert all(stage["explorers"][f"explorer-{i}"]["restarts"] == 1 for i in (0, 1))
