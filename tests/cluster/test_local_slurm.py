"""The local Slurm cluster (tools/local-slurm.sh) is a real one: batch jobs, multi-node steps,
arrays, cancellation, QOS preemption and accounting all behave as on a site's cluster, and
submitit drives it unchanged.

These tests fail (never skip) when the cluster cannot start: the failure shows the script's
message and the log tail that explains it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import submitit
from helpers.slurm_cluster import (
    SCRIPT,
    queued,
    sbatch,
    slurm,
    wait_for_states,
)


@pytest.fixture
def slurm_environ(slurm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The cluster's variables in os.environ, for code that runs Slurm clients itself."""
    for name, value in slurm_env.items():
        monkeypatch.setenv(name, value)
    yield


def wait_until_running(job_id: str, env: dict[str, str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (lines := queued(job_id, env)) != [f"{job_id} RUNNING"]:
        assert time.monotonic() < deadline, f"job {job_id} not running after {timeout} s: {lines}"
        time.sleep(0.1)


def test_status_reports_every_daemon_healthy(slurm_env: dict[str, str]) -> None:
    result = slurm([str(SCRIPT), "status"], slurm_env)  # fails unless the script exits 0
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"):
        assert any(line.split()[:2] == [daemon, "running"] for line in result.splitlines()), result
    assert "DOWN" not in result, result


def test_batch_job_completes_and_is_accounted(slurm_env: dict[str, str], tmp_path: Path) -> None:
    start = time.monotonic()
    job = sbatch(["--output=out.txt", "--wrap", "echo hello from $SLURM_JOB_ID"],
                 slurm_env, cwd=tmp_path)
    assert wait_for_states(job, slurm_env) == {job: "COMPLETED"}
    print(f"submit to COMPLETED in sacct: {time.monotonic() - start:.2f} s")
    assert (tmp_path / "out.txt").read_text() == f"hello from {job}\n"


def test_two_task_step_spans_both_nodes(slurm_env: dict[str, str], tmp_path: Path) -> None:
    # Both logical nodes are this host, so hostname cannot tell them apart: Slurm's own
    # per-task variables can.
    job = sbatch(["-N2", "-n2", "--output=out.txt", "--wrap",
                  "srun bash -c 'echo $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME'"],
                 slurm_env, cwd=tmp_path)
    assert wait_for_states(job, slurm_env) == {job: "COMPLETED"}
    lines = sorted((tmp_path / "out.txt").read_text().splitlines())
    assert lines == ["0 0 n1", "1 1 n2"]


def test_array_job_runs_every_task(slurm_env: dict[str, str], tmp_path: Path) -> None:
    job = sbatch(["--array=0-2", "--output=out-%a.txt", "--wrap", "echo $SLURM_ARRAY_TASK_ID"],
                 slurm_env, cwd=tmp_path)
    states = wait_for_states(job, slurm_env, count=3)
    assert states == {f"{job}_{i}": "COMPLETED" for i in range(3)}
    for i in range(3):
        assert (tmp_path / f"out-{i}.txt").read_text() == f"{i}\n"


def test_scancel_removes_a_running_job(slurm_env: dict[str, str], tmp_path: Path) -> None:
    job = sbatch(["--output=out.txt", "--wrap", "sleep 300"], slurm_env, cwd=tmp_path)
    wait_until_running(job, slurm_env)
    slurm(["scancel", job], slurm_env)
    deadline = time.monotonic() + 20
    while lines := queued(job, slurm_env):
        assert time.monotonic() < deadline, f"job {job} still queued after scancel: {lines}"
        time.sleep(0.1)
    assert wait_for_states(job, slurm_env) == {job: "CANCELLED"}


def test_urgent_qos_preempts_and_requeues_a_preemptible_job(slurm_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    # A job that needs the room of a --qos=preemptible job requeues it (it is not killed):
    # what the roles' save-and-requeue logic meets on a site with a scavenger QOS.
    low = sbatch(["--qos=preemptible", "--nodelist=n1", "--exclusive", "--output=low.txt",
                  "--wrap", "sleep 300"], slurm_env, cwd=tmp_path)
    try:
        wait_until_running(low, slurm_env)
        high = sbatch(["--qos=urgent", "--nodelist=n1", "--exclusive", "--output=high.txt",
                       "--wrap", "echo urgent"], slurm_env, cwd=tmp_path)
        assert wait_for_states(high, slurm_env) == {high: "COMPLETED"}
        info = slurm(["scontrol", "show", "job", "--oneliner", low], slurm_env)
        assert "Restarts=1" in info and "Requeue=1" in info, info
    finally:
        slurm(["scancel", low], slurm_env)
    assert (tmp_path / "high.txt").read_text() == "urgent\n"


def test_jobs_of_the_default_qos_are_never_preempted(slurm_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    # Test sessions that share the cluster must not requeue each other's jobs.
    normal = sbatch(["--nodelist=n1", "--exclusive", "--output=normal.txt", "--wrap",
                     "sleep 300"], slurm_env, cwd=tmp_path)
    high = None
    try:
        wait_until_running(normal, slurm_env)
        high = sbatch(["--qos=urgent", "--nodelist=n1", "--exclusive", "--output=high.txt",
                       "--wrap", "echo urgent"], slurm_env, cwd=tmp_path)
        time.sleep(3)  # preemption happens within ~1 s (sched_interval=1) when it happens
        assert queued(normal, slurm_env) == [f"{normal} RUNNING"]
        assert queued(high, slurm_env) == [f"{high} PENDING"]
        info = slurm(["scontrol", "show", "job", "--oneliner", normal], slurm_env)
        assert "Restarts=0" in info, info
    finally:
        slurm(["scancel", normal, *([high] if high else [])], slurm_env)


# ---------------------------------------------------------------------------------------------
# submitit, as the launcher will use it

# Jobs unpickle the submitted function in a fresh interpreter, where this test module is not
# importable: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def job_info(x: int) -> tuple[int, str, str]:
    """Runs inside a Slurm job: a value plus where it ran."""
    return x * x, submitit.JobEnvironment().job_id, os.environ["SLURMD_NODENAME"]


def final_submitit_state(job: submitit.Job, timeout: float = 20.0) -> str:
    """The job's state as submitit reads it from sacct, once it is final."""
    deadline = time.monotonic() + timeout
    while (state := job.get_info(mode="force").get("State", "UNKNOWN")) in (
            "UNKNOWN", "PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"submitit sees {job.job_id} as {state}"
        time.sleep(0.2)
    return state


def executor(folder: Path) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder=folder / "%j")
    assert ex.cluster == "slurm"  # found srun: the cluster's clients are on PATH
    ex.update_parameters(timeout_min=5, slurm_partition="debug", cpus_per_task=1)
    return ex


@pytest.mark.usefixtures("slurm_environ")
def test_submitit_job_returns_its_value(tmp_path: Path) -> None:
    job = executor(tmp_path).submit(job_info, 7)
    value, job_id, node = job.result()
    assert (value, job_id) == (49, job.job_id)
    assert node in {"n1", "n2"}
    assert final_submitit_state(job) == "COMPLETED"


@pytest.mark.usefixtures("slurm_environ")
def test_submitit_map_array(tmp_path: Path) -> None:
    jobs = executor(tmp_path).map_array(job_info, [2, 3])
    results = [job.result() for job in jobs]
    assert [value for value, _, _ in results] == [4, 9]
    array_id = jobs[0].job_id.split("_")[0]
    assert [job_id for _, job_id, _ in results] == [f"{array_id}_0", f"{array_id}_1"]
    assert [final_submitit_state(job) for job in jobs] == ["COMPLETED", "COMPLETED"]
