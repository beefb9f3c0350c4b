"""Starting processes that must outlive a stop signal meant for the role that starts them.

Slurm sends its warning (USR2) and, at the time limit, TERM to every process of a job step.
A helper process started by a role (its fork server, an inference engine's own processes)
must not die of a signal its role handles: the role stops them itself. Signals blocked in
the starting thread stay blocked in every process it starts, across `exec` too, until the
process unblocks them itself; the starting thread takes any that arrived meanwhile once it
unblocks them again.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def signals_blocked(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Block `signals` in the calling thread while the body runs; processes (and threads) it
    starts inherit them blocked. On leaving, the thread's earlier mask is back and a blocked
    signal that came meanwhile is delivered to it then, not lost."""
    earlier = signal.pthread_sigmask(signal.SIG_BLOCK, list(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, earlier)
