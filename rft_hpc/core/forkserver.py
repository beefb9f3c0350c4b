"""The fork server that a role's worker processes (environments, rewards) are forked from.

A role holds torch threads, so its workers are never forked from it: they come from one fork
server per process (a clean interpreter started once), which imports the modules the
workers need before it forks them. Every kind of worker adds its modules here, so that they
share the one server whichever starts first.

The server and its workers ignore the stop signals (`rft_hpc.core.forkserver_signals`).
Slurm sends its warning (USR2) and, at the time limit, TERM to every process of a job step,
not only to the role: a server or worker killed by one left a role that was stopping cleanly
unable to start a worker, and it crashed instead of requeueing. The role stops its workers
itself, and SIGKILL still ends them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import signal
import threading
from collections.abc import Sequence
from multiprocessing.context import BaseContext

from rft_hpc.core.sigmask import signals_blocked

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
"""Signals that ask a role to stop at its next safe point; its fork server ignores them."""

_SIGNALS_MODULE = "rft_hpc.core.forkserver_signals"
_LOCK = threading.Lock()
_PRELOAD: list[str] = []


def forkserver_context(preload: Sequence[str] = ()) -> BaseContext:
    """The fork-server context, with `preload` added to the modules its server imports, and
    its server running (started now if it is not, or no longer). Modules named after the
    server started are imported by each worker itself instead (slower to start, the same
    otherwise)."""
    with _LOCK:
        ctx = multiprocessing.get_context("forkserver")
        _PRELOAD.extend(m for m in preload if m not in _PRELOAD)
        ctx.set_forkserver_preload([_SIGNALS_MODULE, *_PRELOAD])
        _ensure_server()
        return ctx


def _ensure_server() -> None:
    # Blocked, a stop signal neither kills the new server before it ignores it nor is lost
    # here: it waits, and this thread takes it on unblocking.
    with signals_blocked(STOP_SIGNALS):
        multiprocessing.forkserver.ensure_running()
