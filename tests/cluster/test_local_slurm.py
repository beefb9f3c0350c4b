"""The local Slurm cluster (tools/local-slurm.sh) is a real one: batch jobs, multi-node steps,
arrays, cancellation, QOS preemption and accounting all behave as on a site's cluster, and
submitit drives it unchanged.

These tests fail (never skip) when the cluster cannot start: the failure shows the script's
message and the log tail that explains it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
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


NODE_FREE_S = 300.0
"""How long a job that needs all of n1 may wait to start: the cluster is shared with the other
test files' runs (xdist workers), whose jobs on n1 must end first (a minute or two)."""


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


@pytest.mark.timeout(2 * NODE_FREE_S + 60)
def test_urgent_qos_preempts_and_requeues_a_preemptible_job(slurm_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    # A job that needs the room of a --qos=preemptible job requeues it (it is not killed):
    # what the roles' save-and-requeue logic meets on a site with a scavenger QOS.
    low = sbatch(["--qos=preemptible", "--nodelist=n1", "--exclusive", "--output=low.txt",
                  "--wrap", "sleep 300"], slurm_env, cwd=tmp_path)
    try:
        wait_until_running(low, slurm_env, timeout=NODE_FREE_S)
        high = sbatch(["--qos=urgent", "--nodelist=n1", "--exclusive", "--output=high.txt",
                       "--wrap", "echo urgent"], slurm_env, cwd=tmp_path)
        # other files' jobs that came to n1 since are not preemptible: they end first
        assert wait_for_states(high, slurm_env, timeout=NODE_FREE_S) == {high: "COMPLETED"}
        info = slurm(["scontrol", "show", "job", "--oneliner", low], slurm_env)
        assert "Restarts=1" in info and "Requeue=1" in info, info
    finally:
        slurm(["scancel", low], slurm_env)
    assert (tmp_path / "high.txt").read_text() == "urgent\n"


@pytest.mark.timeout(2 * NODE_FREE_S + 60)
def test_jobs_of_the_default_qos_are_never_preempted(slurm_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    # Test sessions that share the cluster must not requeue each other's jobs.
    normal = sbatch(["--nodelist=n1", "--exclusive", "--output=normal.txt", "--wrap",
                     "sleep 300"], slurm_env, cwd=tmp_path)
    high = None
    try:
        wait_until_running(normal, slurm_env, timeout=NODE_FREE_S)
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
# A cluster of its own, for what the shared one must not go through


def free_port_run(length: int) -> int:
    """The first of ``length`` consecutive free TCP ports."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + length > 65535:
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + length):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


def kill_every_process_of(slurm_conf: str) -> int:
    """SIGKILL the processes whose environment names this SLURM_CONF (daemons' jobs and steps).

    What a machine or sandbox that stops without `tools/local-slurm.sh stop` does.
    """
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_CONF={slurm_conf}".encode() in environ:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def test_a_killed_cluster_restarts_without_the_jobs_it_had(tmp_path: Path) -> None:
    # CI once ran the suite on a cluster whose daemons had been killed with jobs on n1: the
    # controller recovered them from its saved state as running, with no process left, and
    # every two-node job of the suite waited behind them until its timeout.
    state = Path(tempfile.mkdtemp(prefix="rsk", dir="/tmp"))  # sockets: short paths
    state.chmod(0o755)  # munged's socket folder must be searchable by all
    ctld, dbd, slurmd = free_port_run(1), free_port_run(1), free_port_run(2)
    env = {"RFT_SLURM_DIR": str(state), "RFT_SLURM_CTLD_PORT": str(ctld),
           "RFT_SLURM_DBD_PORT": str(dbd), "RFT_SLURM_SLURMD_PORT": str(slurmd),
           "SLURM_CONF": str(state / "etc" / "slurm.conf")}
    try:
        slurm([str(SCRIPT), "start"], env, timeout=300)
        jobs = [sbatch(["-N2", "-n2", "--wrap", "srun sleep 300"], env, cwd=tmp_path),
                sbatch(["--wrap", "sleep 300"], env, cwd=tmp_path)]
        for job in jobs:
            wait_until_running(job, env)
        time.sleep(6)  # the controller saves its state within ~5 s of a change
        for daemon in (state / "run").glob("*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(daemon.read_text()), signal.SIGKILL)
        assert kill_every_process_of(env["SLURM_CONF"]) >= 2  # the steps and the sleeps

        started = subprocess.run([str(SCRIPT), "start"], env={**os.environ, **env},
                                 capture_output=True, text=True, timeout=300, check=False)
        assert started.returncode == 0, started.stderr
        assert f"cancelling 2 job(s) left from before the cluster was last killed: " \
               f"{' '.join(sorted(jobs))}" in started.stderr, started.stderr
        assert slurm(["squeue", "--noheader", "--all"], env).strip() == ""
        both = sbatch(["-N2", "-n2", "--wrap", "srun true"], env, cwd=tmp_path)
        assert wait_for_states(both, env) == {both: "COMPLETED"}
    finally:
        subprocess.run([str(SCRIPT), "stop", "--purge"], env={**os.environ, **env},
                       capture_output=True, timeout=300, check=False)


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
