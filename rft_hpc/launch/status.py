"""Watching a run: Slurm state of its jobs, heartbeats of its roles, cancel, logs.

Job states come from squeue (fresh) and sacct (after a job left the queue); role state from
the heartbeats in each stage's `state/`. A run of `rft-hpc run` has no jobs: its status
comes from heartbeats and processes (`rft_hpc.run.status`). Log files are those of
`rft-hpc run` too, so `logs` serves local runs as well.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import open_run_dir, read_json
from rft_hpc.launch.submit import JOBS_FILE, latest_job_ids, queued_jobs, submissions
from rft_hpc.monitor.heartbeats import heartbeats
from rft_hpc.run.status import local_status

FAILED = frozenset({"BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL",
                    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})


def _slurm(args: list[str]) -> str:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise UserError(f"{args[0]} not found: Slurm's commands are not on PATH") from None
    if result.returncode != 0 and "Invalid job id" not in result.stderr:
        raise UserError(f"{args[0]} failed: {result.stderr.strip()}")
    return result.stdout


def job_states(ids: list[str]) -> dict[str, str]:
    """State of each job and array task (`12`, `13_0`; `13_[1-3]` for tasks sacct lists as
    pending together): squeue's for those still queued, sacct's for the others."""
    if not ids:
        return {}
    joined = ",".join(ids)
    accounted = dict(line.split("|", 1) for line in _slurm(
        ["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State",
         f"--jobs={joined}"]).splitlines() if "|" in line)
    queued = dict(line.split("|", 1) for line in _slurm(
        ["squeue", "--noheader", "--array", "--format=%i|%T", f"--jobs={joined}"]).splitlines()
        if "|" in line)
    # squeue lists every queued task of an array: sacct's "13_[1-3]" is then out of date.
    in_queue = {job.split("_")[0] for job in queued}
    states = {job: (state.split() or ["UNKNOWN"])[0] for job, state in accounted.items()
              if not ("[" in job and job.split("_")[0] in in_queue)}
    return {**states, **queued}


def run_status(path: Path) -> dict[str, Any]:
    """Jobs, roles and overall state of a run. Submitted to Slurm: `running` while a job is
    queued (or not yet in accounting), then `done` (summary.json written), `failed` or
    `cancelled`. Run by `rft-hpc run` (its last launch the newer): `local_status`."""
    run = open_run_dir(path)
    jobs_file = run.jobs_record
    local = run.processes.exists() and (
        not jobs_file.exists() or run.processes.stat().st_mtime > jobs_file.stat().st_mtime)
    if local:
        return local_status(run)
    if not jobs_file.exists():
        raise UserError(f"{path} was neither submitted to Slurm (no state/{JOBS_FILE}) nor "
                        "run by `rft-hpc run` (no state/processes.json)")
    history = submissions(run)
    entries = history[-1]["jobs"]
    states = job_states([e["id"] for e in entries])
    jobs, watchers = [], []
    for entry in entries:
        mine = {k: v for k, v in states.items()
                if k == entry["id"] or k.startswith(entry["id"] + "_")}
        job = {"name": entry["name"], "id": entry["id"], "role": entry["role"],
               "stage": entry["stage"], "state": _overall(list(mine.values())), "tasks": mine}
        (watchers if entry["role"] == "watch" else jobs).append(job)
    roles = list(heartbeats(run))
    summary = run.summary
    active = any(j["state"] not in FAILED | {"COMPLETED"} for j in jobs)
    failed = any(j["state"] in FAILED for j in jobs)
    cancelled = failed and all(j["state"] in ("CANCELLED", "COMPLETED") for j in jobs)
    # a failed job's watcher is about to resubmit (those of succeeded jobs are dropped)
    resuming = failed and any(j["state"] in ("PENDING", "RUNNING") for j in watchers)
    state = ("running" if active else "done" if summary.exists() else "resuming" if resuming
             else "cancelled" if cancelled else "failed" if failed else "running")
    return {"run": str(run.root), "state": state, "jobs": jobs, "roles": roles,
            "summary": str(summary) if summary.exists() else None,
            "submissions": len(history), "auto_resume": bool(history[-1].get("auto_resume")),
            "watchers": len(watchers), "local": False}


def _overall(states: list[str]) -> str:
    if not states:
        return "UNKNOWN"  # not yet in sacct (it lags squeue) or long forgotten
    for state in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED", "SUSPENDED"):
        if state in states:
            return state
    failed = [s for s in states if s in FAILED]
    if failed:
        return failed[0]
    return "COMPLETED" if all(s == "COMPLETED" for s in states) else states[0]


def cancel_run(path: Path, timeout: float = 60.0) -> list[str]:
    """scancel every job of the run's latest submission; wait until squeue lists none of
    them. Returns the ids that were still queued."""
    run = open_run_dir(path)
    ids = latest_job_ids(run)
    queued = queued_jobs(ids)
    if queued:
        _slurm(["scancel", *ids])
    deadline = time.monotonic() + timeout
    while queued_jobs(ids):
        if time.monotonic() > deadline:
            raise UserError(f"jobs of {run.root} still queued {timeout:.0f} s after scancel: "
                            f"{', '.join(queued_jobs(ids))}")
        time.sleep(0.2)
    return queued


def log_files(path: Path, role: str | None = None) -> list[Path]:
    """The log files of a run (`rft-hpc run` or `submit`), or of one role (`trainer`,
    `explorer` for all explorers, `explorer-1`, `finalize`, `<stage>.prepare`), including
    those of submitted jobs that have not started yet."""
    run = open_run_dir(path)
    logs = {*run.root.glob("stages/*/jobs/*.log"), *run.jobs.glob("*.log")}
    if run.jobs_record.exists():
        for job in read_json(run.jobs_record)["submissions"][-1]["jobs"]:
            logs.update(Path(p) for p in job["logs"])
    if role is not None:
        logs = {p for p in logs if p.stem == role or p.stem.startswith(f"{role}-")
                or p.stem.endswith(f".{role}")}
        if not logs:
            raise UserError(f"no log of {role!r} in {run.root}")
    return sorted(logs)


def show_logs(paths: list[Path], follow: bool = False, poll: float = 0.5) -> None:
    """Print each log with a `==> path <==` header; with `follow`, keep printing what is
    appended (and logs that appear) until interrupted."""
    offsets: dict[Path, int] = {}
    while True:
        for path in paths:
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                data = f.read()
            if data or path not in offsets:
                if len(paths) > 1:
                    sys.stdout.write(f"==> {path} <==\n")
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
            offsets[path] = offsets.get(path, 0) + len(data)
        if not follow:
            return
        time.sleep(poll)
