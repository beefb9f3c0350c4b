"""The processes of a local run: `state/processes.json`, and whether they still live.

`rft-hpc run` records its own pid and that of every role process it starts (again when it
restarts one), and how it ended, so that `rft-hpc status` can tell a running role from a
dead one. A pid is recorded with its process's start time (from /proc), so a pid the
kernel has since given to another process does not count as the role.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rft_hpc.core.rundir import RunDir, atomic_write_json, read_json
from rft_hpc.core.storage import StoppedOnFullStorage, advice, full_from_exit, storage_full

PROCESSES_VERSION = 1


def start_token(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), None where
    there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name may hold spaces and ")"


def alive(pid: int, token: str | None = None) -> bool:
    """Whether process `pid` runs on this machine (not a zombie) and, given the `token` it
    was recorded with, is still that process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and (token is None or fields[19] == token)


class ProcessRecord:
    """What the launcher of a local run writes: its pid, each role's pid, its outcome."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.processes
        pid = os.getpid()
        self.data: dict[str, Any] = {
            "format_version": PROCESSES_VERSION, "host": socket.gethostname(),
            "launcher": {"pid": pid, "token": start_token(pid), "started": time.time()},
            "outcome": None, "ended": None, "roles": {}}
        self._write()

    def started(self, stage: str, role: str, pid: int) -> None:
        """Role `role` of stage `stage` now runs as process `pid`."""
        self.data["roles"][f"{stage}/{role}"] = {"stage": stage, "role": role, "pid": pid,
                                                 "token": start_token(pid),
                                                 "started": time.time()}
        self._write()

    def ended(self, outcome: str) -> None:
        """The launcher ends: `done`, `stopped` (interrupted; the same command resumes) or
        `failed`."""
        self.data.update(outcome=outcome, ended=time.time())
        self._write()

    def _write(self) -> None:
        # best effort on a full disk: `rft-hpc status` then reads an older record, while
        # the run itself stops on the roles' writes (the launcher's bookkeeping alone never
        # stops a run)
        unless_full(atomic_write_json, self.path, self.data, durable=False)


def unless_full(write: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
    """`write(*args, **kwargs)`; False instead of its `StorageFull` (a full disk or an
    exceeded quota), for writes whose loss costs nothing but a stale record."""
    try:
        write(*args, **kwargs)
    except OSError as exc:
        if storage_full(exc) is None:
            raise
        return False
    return True


def role_stopped_full(role: str, status: int | None, log: Path,
                      said: str | None = None) -> StoppedOnFullStorage:
    """What the launcher says when role `role` exited with `status`, a full disk's or an
    exceeded quota's errno: the role's own message (`said` on its report pipe, else the last
    one in its log), which names the path, or else the error and the role's stage folder."""
    full = full_from_exit(status)
    assert full is not None, status
    if said is None:
        said = _last_line(log, f"error: {role} stopped: ")
    if said is not None:
        return StoppedOnFullStorage(said.removeprefix("error: "), full)
    return StoppedOnFullStorage(
        f"{role} stopped: {full.describe()} writing in {log.parent.parent} (its log {log} "
        f"could not hold the path): {advice(full)}", full)


def _last_line(log: Path, prefix: str) -> str | None:
    """The last line of `log` that starts with `prefix`, None if none (or no log)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line for line in reversed(lines) if line.startswith(prefix)), None)


def read_processes(run: RunDir) -> dict[str, Any] | None:
    """The record of the last local run in `run`, None if it never ran locally."""
    try:
        return read_json(run.processes)
    except (OSError, ValueError):
        return None


def on_this_host(record: dict[str, Any]) -> bool:
    """Whether the record's processes ran on this machine (only then can pids be checked)."""
    return record.get("host") == socket.gethostname()
