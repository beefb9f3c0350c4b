"""Runs submitted to the local Slurm cluster: the CLI with the cluster's variables, status
polling, heartbeats, and the chaos cases' shrunken demo (tests/cluster/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from helpers.paths import DEMO, ROOT
from helpers.runs import short
from helpers.slurm_cluster import slurm


def rft(env: dict[str, str], *args: object, timeout: float = 180,
        **extra_env: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a separate process, with the cluster's variables."""
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=ROOT,
                          env={**os.environ, **env, **extra_env}, capture_output=True,
                          text=True, timeout=timeout)


def unique(tag: str) -> str:
    """A run name no other test session sharing the cluster uses."""
    return f"{tag}-{os.getpid()}"


def jobs_in_queue(env: dict[str, str], run_name: str) -> list[str]:
    """squeue's jobs of a run (their names start with the run's name)."""
    names = slurm(["squeue", "--noheader", "--array", "--format=%j"], env).split()
    return [n for n in names if n.startswith(f"{run_name}.")]


def status(env: dict[str, str], run: Path) -> dict:
    """`rft-hpc status RUN --json`, which must succeed."""
    result = rft(env, "status", run, "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for_run(env: dict[str, str], run: Path, timeout: float = 300, every: float = 10,
                 ) -> tuple[dict, list[dict]]:
    """Poll `status --json` until the run is no longer running; (last, every answer).

    A status is a CLI process (about a second of CPU) and the run's roles need the cores:
    between two, squeue (cheap) is asked every 0.5 s whether a job of the run is still
    queued; the next status comes once none is, or after `every` seconds.
    """
    deadline = time.monotonic() + timeout
    seen = [status(env, run)]
    while seen[-1]["state"] in ("running", "resuming"):
        if time.monotonic() > deadline:
            logs = rft(env, "logs", run).stdout[-3000:]
            raise AssertionError(f"still running after {timeout} s: {seen[-1]}\n{logs}")
        time.sleep(1)
        next_status = min(time.monotonic() + every, deadline)
        while time.monotonic() < next_status and jobs_in_queue(env, run.name):
            time.sleep(0.5)
        seen.append(status(env, run))
    return seen[-1], seen


def chaos_args(tmp_path: Path, model: Path, *extra: str) -> list[str]:
    """One GRPO stage, 2 explorers, a trainer that saves every 5 steps."""
    return short(tmp_path, model, "--set", "stages=[]", "--set", "trainer.steps=40",
                 "--set", "trainer.save_interval=5", "--set", "eval.interval=0", *extra)


_SUBMITTED: list[tuple[dict[str, str], Path]] = []


def submit(env: dict[str, str], tmp_path: Path, model: Path, name: str, *extra: str) -> Path:
    """Submit the chaos cases' demo (`chaos_args`) as run `name`; its folder. The run is
    cancelled by `cancel_submitted` unless it finished."""
    result = rft(env, "submit", DEMO, *chaos_args(tmp_path, model, *extra), "--name", name)
    assert result.returncode == 0, result.stderr
    remember(env, tmp_path / name)
    return tmp_path / name


def remember(env: dict[str, str], run: Path) -> None:
    """Have `cancel_submitted` cancel this run's jobs."""
    _SUBMITTED.append((env, run))


def cancel_submitted() -> None:
    """Cancel every run `submit` made since the last call: a failed case must not leave its
    jobs waiting in the shared cluster's queue."""
    while _SUBMITTED:
        env, run = _SUBMITTED.pop()
        try:
            queued = bool(jobs_in_queue(env, run.name))  # squeue is cheap, the CLI is not
        except AssertionError:  # squeue failed: cancel to be sure
            queued = True
        if queued:
            rft(env, "cancel", run)


def heartbeat(run: Path, role: str) -> dict:
    """The role's heartbeat in the run's first stage ({} while there is none)."""
    try:
        return json.loads((run / "stages" / "0-main" / "state" / f"{role}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_until(predicate: Callable[[], bool], timeout: float = 180, what: str = "") -> None:
    """Poll `predicate` every 0.2 s until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def running_at(run: Path, role: str, step: int, restarts: int = 0,
               in_flight: int = 0) -> Callable[[], bool]:
    """A predicate: `role` runs, at `step` or later, in its `restarts`-th restart or later,
    with at least `in_flight` streamed steps submitted and not yet written (explorers)."""
    def check() -> bool:
        beat = heartbeat(run, role)
        return (beat.get("status") == "running" and beat.get("step", -1) >= step
                and beat.get("restarts", 0) >= restarts
                and beat.get("steps_in_flight", 0) >= in_flight)
    return check


def finished(env: dict[str, str], run: Path, timeout: float = 420, steps: int = 40) -> dict:
    """Wait for the run to end; it must be done, with no job left in the queue and every
    trainer step 1..steps in its metrics. Its last status."""
    final, _ = wait_for_run(env, run, timeout=timeout)
    assert final["state"] == "done", (final, rft(env, "logs", run).stdout[-4000:])
    assert jobs_in_queue(env, run.name) == []
    trained = [json.loads(line)["step"] for line in
               (run / "stages" / "0-main" / "metrics" / "trainer.jsonl").read_text().splitlines()
               if "loss" in line]
    assert sorted(set(trained)) == list(range(1, steps + 1))
    return final
