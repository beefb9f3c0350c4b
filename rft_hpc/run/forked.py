"""Local role processes forked from one interpreter that has imported torch and transformers.

Each role process of a local run would otherwise import torch and transformers itself,
seconds of CPU per process and per restart, on the same cores the other roles train and
generate on. `rft-hpc run` starts them instead from one fork server (multiprocessing's
forkserver: a clean interpreter, no threads, no torch work done) that imports them once.
A forked role runs its command line `python -m MODULE ARGS...` as that command would
(`runpy`, `sys.argv`), in a session of its own, with its output going to its log file.
`ForkedProcess` answers like `subprocess.Popen`, so the launcher treats both alike.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from rft_hpc.core.retry import open_append
from rft_hpc.core.storage import StorageFull, advice, exit_status, storage_full
from rft_hpc.runtime.command import REPORT_MAX_BYTES, report_pipe, report_to_launcher

PRELOAD = ("torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.generation.utils", "rft_hpc.cli.app", "rft_hpc.cli.run_cmd",
           "rft_hpc.trainer.role", "rft_hpc.explorer.role", "rft_hpc.colocate.role",
           "rft_hpc.eval.evaluator")
"""What the fork server imports before it forks roles (a missing one is skipped)."""


def forkable(cmd: Sequence[str]) -> bool:
    """Whether `cmd` is `python -m MODULE ...` of this very interpreter (what can be forked
    from the server; anything else, e.g. under mpiexec, is started as a new program)."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"


_REPORT: list[Connection] = []
"""The role's end of its report pipe, kept open for the process's life."""


def _run_command(cmd: list[str], env: dict[str, str], log: str, report: Connection) -> None:
    """Fork-server side: become `cmd` with `env`, writing to `log`; `report` is the pipe on
    which the role tells the launcher why it stopped (`runtime.command.report_to_launcher`)."""
    os.setsid()  # as Popen(start_new_session=True): Ctrl-C reaches only the launcher
    os.environ.update(env)
    _REPORT.append(report)
    report_pipe(report.fileno())
    try:
        fd = open_append(log, mode=0o644, what="log")
    except OSError as exc:  # a full disk: said on the pipe, as the role itself would
        full = storage_full(exc)
        if full is None:
            raise
        full = StorageFull(int(full.errno), log)
        report_to_launcher(f"{Path(log).stem} stopped: {full.describe()}: {advice(full)}")
        os._exit(exit_status(full))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # unbuffered, as PYTHONUNBUFFERED=1 makes it
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [cmd[2], *cmd[3:]]
    try:
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
    finally:  # multiprocessing ends its children with os._exit: run what a program would
        atexit._run_exitfuncs()


class ForkedProcess:
    """A role forked from the fork server; the parts of `subprocess.Popen` the launcher
    uses (`pid`, `returncode`, `poll`, `wait`, `send_signal`, `kill`)."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        self.args = list(cmd)
        self._report, theirs = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_run_command,
                                    args=(self.args, dict(env), str(log), theirs),
                                    name=cmd[2], daemon=False)
        self._process.start()
        theirs.close()
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the process ended (negative: killed by that signal)."""
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; `subprocess.TimeoutExpired` when it outlasts `timeout`."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the process unless it already ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def reported(self) -> str | None:
        """What the role said, on its report pipe, about why it stopped; None if nothing."""
        try:
            if self._report.poll(0):  # the role's one raw write (report_to_launcher)
                data = os.read(self._report.fileno(), REPORT_MAX_BYTES)
                return data.decode("utf-8", errors="replace") or None
        except (OSError, EOFError):
            pass
        return None

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)
