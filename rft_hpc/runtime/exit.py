"""Ending a role process that used torch.distributed without its C++ teardown.

A trainer rank that ran a gloo process group sometimes aborts after its last line of Python,
while the interpreter is being torn down ("terminate called without an active exception",
a C++ thread object destroyed while still joinable): 1 run in 6 of
tests/cluster/test_trainer_reshard.py, in a rank that had finished, saved and left the group.
Slurm then reports the finished task as failed. `leave_process` ends the process the way a
program would, minus that teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def leave_process(code: int = 0) -> NoReturn:
    """End this process with `code` as a normal exit would (thread exit hooks run, other
    non-daemon threads joined, `atexit` functions run, logs and standard streams flushed),
    but skip the interpreter's and the C++ runtime's teardown. Call it from the main thread."""
    # What the interpreter does first at exit: its own exit hooks (which stop idle
    # ThreadPoolExecutor workers; joining those first would wait forever), then joins the
    # other non-daemon threads.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or unwritable: nothing to say
            stream.flush()
    os._exit(code)
