"""`rft-hpc status RUN [--json] [--watch]`: a run's jobs (Slurm) and roles (Slurm or local)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from rft_hpc.core.console import console
from rft_hpc.monitor.progress import format_eta, format_rate, format_step

WATCH_SECONDS = 2.0


def status(
    run: Path = typer.Argument(..., help="Run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    watch: bool = typer.Option(False, "--watch", help="Refresh every few seconds until the "
                               "run ends (Ctrl-C stops watching, not the run)."),
) -> None:
    """State of each role (step/total, version, time left) and, for a submitted run, of
    each Slurm job; a local run's roles from their heartbeats and processes."""
    from rft_hpc.launch.status import run_status

    info = run_status(run)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    if not watch:
        console.print(status_view(info))
        return
    with Live(status_view(info), console=console, refresh_per_second=1) as live:
        while info["state"] in ("running", "resuming"):
            time.sleep(WATCH_SECONDS)
            info = run_status(run)
            live.update(status_view(info))


def status_view(info: dict[str, Any]) -> Group:
    """The job table and the role table of `rft-hpc status` (a local run: the roles only)."""
    if info.get("local"):
        return local_view(info)
    resubmitted = f", resubmitted {info['submissions'] - 1}x" if info["submissions"] > 1 else ""
    jobs = Table(title=f"run {Path(info['run']).name}: {info['state']}{resubmitted}")
    for col in ("job", "slurm id", "state", "tasks"):
        jobs.add_column(col)
    for job in info["jobs"]:
        tasks = ", ".join(f"{k}: {v}" for k, v in job["tasks"].items()) if len(
            job["tasks"]) > 1 else ""
        jobs.add_row(job["name"], job["id"], job["state"], tasks)
    roles = Table(title="roles (heartbeats)")
    columns = ("stage", "role", "status", "step", "version", "age", "backlog", "restarts",
               "redone")
    for col in columns:
        roles.add_column("age (s)" if col == "age" else col,
                         justify="left" if col in ("stage", "role", "status") else "right")
    for r in info["roles"]:
        roles.add_row(*(("-" if r.get(k) is None else str(r[k])) for k in columns))
    parts: list[Table | str] = [jobs, roles]
    if info["summary"]:
        parts.append(f"summary: {info['summary']}")
    return Group(*parts)


def local_view(info: dict[str, Any]) -> Group:
    """One row per role of a local run: state, step/total, version, rate, time left."""
    where = f" on {info['host']}" if info.get("host") else ""
    roles = Table(title=f"run {Path(info['run']).name} (local{where}): {info['state']}")
    for col in ("stage", "role", "state", "step", "version", "rate", "left", "age (s)",
                "restarts"):
        roles.add_column(col, justify="left" if col in ("stage", "role", "state") else "right")
    for r in info["roles"]:
        roles.add_row(r["stage"], r["role"], r["state"], format_step(r["step"], r["total"]),
                      "-" if r["version"] is None else str(r["version"]),
                      format_rate(r["rate"]), format_eta(r["eta"]),
                      "-" if r["age"] is None else str(r["age"]), str(r["restarts"]))
    parts: list[Table | str] = [roles]
    if info["summary"]:
        parts.append(f"summary: {info['summary']}")
    return Group(*parts)
