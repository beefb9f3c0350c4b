"""A real single-host Slurm cluster for the tests: ``tools/local-slurm.sh``, once per session.

``ensure_cluster()`` starts the cluster (munged, MariaDB, slurmdbd, slurmctld, two logical
nodes ``n1`` and ``n2``) unless it already runs, and returns the environment variables that
Slurm clients need (``SLURM_CONF`` ...). Test sessions that run side by side share the
cluster; when the last of them exits, a cluster that a test session started is stopped (set
``RFT_SLURM_KEEP=1`` to keep it for the next run), while one started by hand is left
running. A cluster that cannot start is an error, never a skip.

Usage in a test module (the session fixture `slurm_env` in conftest.py calls
`ensure_cluster`)::

    from helpers.slurm_cluster import sbatch, wait_for_states

    def test_job(slurm_env, tmp_path):
        job = sbatch(["--wrap", "true"], slurm_env, cwd=tmp_path)
        assert wait_for_states(job, slurm_env) == {job: "COMPLETED"}

Code that calls Slurm in-process (submitit) reads ``os.environ``: put the variables there
with ``monkeypatch.setenv(name, value)`` for each item.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.paths import ROOT

SCRIPT = ROOT / "tools" / "local-slurm.sh"

# Job states after which a job never runs again (sacct's names, without a "by <uid>" suffix).
FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
})


class ClusterError(RuntimeError):
    """The local Slurm cluster could not be started; the message holds the script's output."""


_cluster: dict[str, str] | ClusterError | None = None

# Bounds on the script's steps when a session joins. Generous for `start`: on a fresh machine
# it installs the Debian packages (~30 s).
QUERY_TIMEOUT_S = 60
START_TIMEOUT_S = 600
JOIN_BOUND_S = 2 * QUERY_TIMEOUT_S + START_TIMEOUT_S
"""The longest that `ensure_cluster` can take (env, status, start)."""


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def ensure_cluster() -> dict[str, str]:
    """Start the local cluster if it does not run; return the clients' environment variables.

    Runs the script once per process: later calls return the first answer (or raise the
    first error again) at no cost.
    """
    global _cluster
    if _cluster is None:
        try:
            _cluster = _join()
        except (OSError, subprocess.TimeoutExpired) as exc:
            _cluster = ClusterError(f"tools/local-slurm.sh: {exc}")
    if isinstance(_cluster, ClusterError):
        raise _cluster
    return dict(_cluster)


# Several test sessions may share one cluster (engineers run the suite side by side). Each
# session that uses it leaves a file in <state>/test-sessions; the last one to leave stops a
# cluster that a session started (a cluster started by hand is left running). One lock
# serialises joining and leaving, so that no session starts using a cluster being stopped.
_STARTED_MARK = "started-for-tests"


def _join() -> dict[str, str] | ClusterError:
    env = _script("env", timeout=QUERY_TIMEOUT_S)
    variables = _parse_exports(env.stdout)
    if "SLURM_CONF" not in variables or "RFT_SLURM_DIR" not in variables:
        return ClusterError(f"tools/local-slurm.sh env gave no SLURM_CONF:\n{env.stdout}")
    state = Path(variables["RFT_SLURM_DIR"])
    with _sessions_lock(state):
        if _script("status", timeout=QUERY_TIMEOUT_S).returncode != 0:
            started = _script("start", timeout=START_TIMEOUT_S)
            if started.returncode != 0:
                return ClusterError(
                    f"tools/local-slurm.sh start failed (exit {started.returncode}):\n"
                    f"{started.stdout}{started.stderr}"
                )
            (state / _STARTED_MARK).touch()
        sessions = state / "test-sessions"
        sessions.mkdir(exist_ok=True)
        (sessions / str(os.getpid())).write_text(_process_start_time(os.getpid()))
    atexit.register(_leave, state)
    return variables


def _leave(state: Path) -> None:
    with _sessions_lock(state):
        sessions = state / "test-sessions"
        if not sessions.is_dir():
            return  # someone removed the state folder (stop --purge): nothing left to stop
        (sessions / str(os.getpid())).unlink(missing_ok=True)
        live = [f for f in sessions.iterdir()
                if f.name.isdigit() and _process_start_time(int(f.name)) == f.read_text()]
        for f in sessions.iterdir():
            if f not in live:
                f.unlink(missing_ok=True)  # a session that died without leaving
        if not live and (state / _STARTED_MARK).exists() and os.environ.get(
                "RFT_SLURM_KEEP") != "1":
            _script("stop", timeout=180)
            (state / _STARTED_MARK).unlink(missing_ok=True)


@contextlib.contextmanager
def _sessions_lock(state: Path) -> Iterator[None]:
    with open(f"{state}.tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _process_start_time(pid: int) -> str:
    """A process's start time (clock ticks since boot): with the pid, it names one process.

    Empty for a process that has exited (a zombie counts as exited: this sandbox reaps late).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()
    return "" if fields[0] in {"Z", "X", "x"} else fields[19]  # state; starttime is field 22


def _parse_exports(text: str) -> dict[str, str]:
    variables = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            variables[name] = value
    return variables


# ---------------------------------------------------------------------------------------------
# Small clients for tests


def slurm(args: list[str], env: dict[str, str], **kwargs) -> str:
    """Run a Slurm client command with the cluster's variables; return its stdout."""
    kwargs.setdefault("timeout", 60)
    result = subprocess.run(
        args, env={**os.environ, **env}, capture_output=True, text=True, check=False, **kwargs
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{shlex.join(args)} failed (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    return result.stdout


def sbatch(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Submit a batch job (output files land in ``cwd``); return its job id."""
    out = slurm(["sbatch", "--parsable", f"--chdir={cwd}", *args], env, cwd=cwd)
    return out.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def sacct_states(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """Accounting state of a job's allocations: ``{"12": "COMPLETED"}``, ``{"13_0": ...}``."""
    out = slurm(["sacct", "--noheader", "--parsable2", "--allocations",
                 "--format=JobID,State", f"--jobs={job_id}"], env)
    states = {}
    for line in out.splitlines():
        if "|" in line:
            job, state = line.split("|", 1)
            states[job] = state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    return states


def wait_for_states(job_id: str, env: dict[str, str], count: int = 1,
                    timeout: float = 30.0) -> dict[str, str]:
    """Wait until sacct lists ``count`` allocations of the job, all in a final state.

    sacct lags squeue by ~0.1 s for a job and by seconds for an array: poll it.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = sacct_states(job_id, env)
        if len(states) >= count and all(s in FINAL_STATES for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not finished after {timeout} s: {states}")
        time.sleep(0.1)


def queued(job_id: str, env: dict[str, str]) -> list[str]:
    """squeue's lines for a job (an array counts as one job): empty once it left the queue."""
    result = subprocess.run(
        ["squeue", "--noheader", "--format=%i %T", f"--jobs={job_id}"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
    )
    if result.returncode != 0 and "Invalid job id" in result.stderr:
        return []  # the controller has already forgotten the job
    if result.returncode != 0:
        raise AssertionError(f"squeue failed (exit {result.returncode}): {result.stderr}")
    return result.stdout.splitlines()
