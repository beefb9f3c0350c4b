"""The status of a run of `rft-hpc run`: each role's state from its heartbeat and process.

A role is `running` while its process lives, `finished` once its heartbeat says done,
`stopped` when it stopped at a safe point (Ctrl-C; the same command resumes it) and `dead`
when its process is gone without either (killed, crashed). The run is `running` while its
launcher lives, then `done`, `stopped` or `failed` as the launcher recorded when it ended, or
`dead` if it was killed before it could. On another machine than the launcher's, pids cannot
be checked and the heartbeats and the record alone tell.
"""

from __future__ import annotations

from typing import Any

from rft_hpc.core.rundir import RunDir
from rft_hpc.monitor.heartbeats import heartbeats
from rft_hpc.run.processes import alive, on_this_host, read_processes

ROLE_STATES = ("running", "finished", "stopped", "dead")


def role_state(status: str | None, lives: bool | None) -> str:
    """A role's state from its heartbeat's `status` and whether its process `lives` (None:
    cannot tell, on another machine)."""
    if status == "done":
        return "finished"
    if lives or (lives is None and status != "stopped"):
        return "running"
    return "stopped" if status == "stopped" else "dead"


def local_status(run: RunDir) -> dict[str, Any]:
    """Roles and overall state of a local run, in the shape of `launch.status.run_status`
    (no jobs): each role's stage, state, step, total, version, rate, eta, age, restarts."""
    record = read_processes(run) or {}
    here = on_this_host(record)
    started = record.get("roles", {})

    def lives(entry: dict[str, Any] | None) -> bool | None:
        if not here:
            return None
        return entry is not None and alive(entry["pid"], entry.get("token"))

    roles = []
    for beat in heartbeats(run):
        entry = started.pop(f"{beat['stage']}/{beat['role']}", None)
        roles.append({**beat, "pid": entry["pid"] if entry else beat["pid"],
                      "state": role_state(beat["status"], lives(entry))})
    for entry in started.values():  # started, no heartbeat yet
        roles.append({"stage": entry["stage"], "role": entry["role"], "status": None,
                      "pid": entry["pid"], "step": None, "total": None, "version": None,
                      "age": None, "rate": None, "eta": None, "backlog": None,
                      "restarts": 0, "redone": 0, "state": role_state(None, lives(entry))})
    roles.sort(key=lambda r: (r["stage"], r["role"]))
    launcher = record.get("launcher")
    if launcher is not None and lives(launcher):
        state = "running"
    else:
        state = record.get("outcome") or ("running" if not here else "dead")
    summary = run.summary
    return {"run": str(run.root), "state": state, "local": True, "host": record.get("host"),
            "launcher": launcher["pid"] if launcher else None, "jobs": [], "roles": roles,
            "summary": str(summary) if summary.exists() else None, "submissions": 0,
            "auto_resume": False, "watchers": 0}
