"""How a role process is started: its command line and environment, the same locally and
in Slurm jobs (`python -m rft_hpc.cli role ROLE STAGE_DIR [--index I]`)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path

from rft_hpc.runtime.logs import LOG_LEVEL_ENV, log_level
from rft_hpc.runtime.placement import THREADS_ENV

REPORT_MAX_BYTES = 4000
"""The longest report: one write to a pipe up to PIPE_BUF (4096 on Linux) is atomic."""

_report_fd: list[int] = []
"""The pipe on which this role tells its launcher why it stopped (`report_pipe`)."""


def report_pipe(fd: int) -> None:
    """Make `fd` (a pipe's writing end) where `report_to_launcher` writes: set by
    `rft-hpc run` in each role process it forks; never inherited by the role's own
    children (it is no environment variable), and absent in Slurm jobs."""
    _report_fd[:] = [fd]


def report_to_launcher(text: str) -> None:
    """Send `text` (one message: why this role stops) to the launcher that started this
    role, when it gave it a pipe (`report_pipe`): the message reaches the user even when the
    role's log cannot be written (a full disk). Best effort, never raises."""
    with contextlib.suppress(OSError, ValueError):
        for fd in _report_fd:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                # one write below PIPE_BUF: whole on the other side, never interleaved
                os.write(fd, text.encode("utf-8")[:REPORT_MAX_BYTES])


def role_command(role: str, folder: Path, index: int | str | None = None, *,
                 python: str = sys.executable) -> list[str]:
    """The command line that runs one role on a stage directory (local or in a Slurm job).

    In a Slurm array, `index` is the shell text that expands to the array task's index.
    """
    cmd = [python, "-m", "rft_hpc.cli", "role", role, str(folder)]
    return cmd + (["--index", str(index)] if index is not None else [])


def role_env(threads: int | None, *, shared: bool = False) -> dict[str, str]:
    """Environment variables every role process gets (locally and in Slurm jobs), with
    the log level (`--log-level`) when one was set. `threads`: the role's CPU threads, None
    to let the role take its allocation's cores; `shared`: they are its share of a machine
    that roles share (`runtime.placement`)."""
    # PYTHONFAULTHANDLER: a role that dies of a signal (a native library's abort, a segfault)
    # leaves every thread's Python stack in its log, not just the signal's name
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        if shared:
            env[THREADS_ENV] = str(threads)
    if os.environ.get(LOG_LEVEL_ENV):
        env[LOG_LEVEL_ENV] = log_level()  # checked: a bad value fails here, not in a job
    return env
