"""The fork server that a role's worker processes (environments, rewards) are forked from.

A role holds torch threads, so its workers are never forked from it: they come from one fork
server per process (a clean interpreter started once), which imports the modules the
workers need before it forks them. Every kind of worker adds its modules here, so that they
share the one server whichever starts first.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Sequence
from multiprocessing.context import BaseContext

_LOCK = threading.Lock()
_PRELOAD: list[str] = []


def forkserver_context(preload: Sequence[str] = ()) -> BaseContext:
    """The fork-server context, with `preload` added to the modules its server imports. The
    server starts with the first worker; modules named after that are imported by each
    worker itself instead (slower to start, the same otherwise)."""
    with _LOCK:
        ctx = multiprocessing.get_context("forkserver")
        _PRELOAD.extend(m for m in preload if m not in _PRELOAD)
        ctx.set_forkserver_preload(list(_PRELOAD))
        return ctx
