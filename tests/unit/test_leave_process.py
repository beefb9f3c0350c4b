"""`leave_process` ends a process as a normal exit would, minus the C++ teardown: its thread
exit hooks (an idle ThreadPoolExecutor's workers), other threads and atexit functions run,
and the status is the one asked for; it does not hang on an executor's idle workers."""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import ROOT

SCRIPT = """
import atexit, concurrent.futures, threading, time
from rft_hpc.runtime.exit import leave_process
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(time.sleep, 0.05).result()  # its workers stay, idle, until exit
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
atexit.register(lambda: print("atexit ran"))
print("leaving", flush=True)
leave_process(3)
print("never")
"""


def test_a_process_left_runs_its_threads_and_exit_functions_and_keeps_its_status():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout.split("\n")[:3] == ["leaving", "thread finished", "atexit ran"]
    assert "never" not in result.stdout
