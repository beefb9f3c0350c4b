"""The stop signals of a role process, from its first instant to its last.

Slurm may send its warning signal (USR2) up to a minute before the time it was asked for
(`--signal=USR2@<delay>`; its timers are coarse), so it can arrive while a role is still
importing torch, or after the role has saved and is exiting. Both used to kill the process
(USR2's default action) and turn a clean requeue into a crash. `catch_early` records a
signal before the role's `StopFlag` exists (the flag takes it over), and
`ignore_warning_signal` keeps a late one from killing a role that has already stopped.
"""

from __future__ import annotations

import signal
from types import FrameType

from rft_hpc.core.forkserver import STOP_SIGNALS

_early: list[int] = []


def _record(signum: int, _frame: FrameType | None) -> None:
    _early.append(signum)


def catch_early() -> None:
    """Record the stop signals that arrive before the role installs its `StopFlag`."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def take_early() -> int | None:
    """The first stop signal recorded by `catch_early` (None if none), and forget it."""
    first = _early[0] if _early else None
    _early.clear()
    return first


def ignore_warning_signal() -> None:
    """Ignore USR2 from now on: the role has stopped, and Python restores the default
    (fatal) action of handled signals while the interpreter shuts down, but keeps ignored
    ones ignored."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
