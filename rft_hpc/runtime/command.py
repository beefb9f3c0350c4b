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

REPORT_FD_ENV = "RFT_REPORT_FD"
"""File descriptor of the pipe on which a local role tells its launcher why it stopped (set
by `rft-hpc run` for the roles it forks; absent in Slurm jobs)."""
REPORT_MAX_BYTES = 4000
"""The longest report: one write to a pipe up to PIPE_BUF (4096 on Linux) is atomic."""


def report_to_launcher(text: str) -> None:
    """Send `text` (one message: why this role stops) to the launcher that started this
    role, when it gave it a pipe (`REPORT_FD_ENV`): the message reaches the user even when
    the role's log cannot be written (a full disk). Best effort, never raises."""
    fd = os.environ.get(REPORT_FD_ENV)
    with contextlib.suppress(OSError, ValueError):
        if fd and stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            # one write below PIPE_BUF: whole on the other side, never interleaved
            os.write(int(fd), text.encode("utf-8")[:REPORT_MAX_BYTES])


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
