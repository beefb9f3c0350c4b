"""Imported first by the fork server (`rft_hpc.core.forkserver`), never by a role: the server
and every worker forked from it ignore the stop signals from here on.

The server starts with them blocked, so that none kills it before this runs; unblocking them
once they are ignored discards any that came meanwhile.
"""

from __future__ import annotations

import signal

from rft_hpc.core.forkserver import STOP_SIGNALS

for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
