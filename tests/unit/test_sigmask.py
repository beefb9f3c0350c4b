"""`signals_blocked`: processes started inside it outlive the blocked signal; the starting
thread gets a signal that came meanwhile once the block ends."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from rft_hpc.core.sigmask import signals_blocked


def _blocked(pid: int) -> int:
    """The blocked-signal mask of process `pid` (Linux's /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))


def test_a_process_started_with_usr2_blocked_outlives_it_and_the_caller_gets_it_after():
    got: list[int] = []
    old = signal.signal(signal.SIGUSR2, lambda signum, _frame: got.append(signum))
    child = None
    try:
        with signals_blocked([signal.SIGUSR2]):
            # spawn: a new interpreter, exec'd, as vLLM starts its engine and workers
            child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            child.start()
            # to this thread (one directed at the process may go to another, unblocked one)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
            time.sleep(0.05)
            assert got == []  # held while blocked
        assert got == [signal.SIGUSR2]  # and taken, not lost, once unblocked
        assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGUSR2}
        assert _blocked(child.pid) & 1 << (signal.SIGUSR2 - 1)
        os.kill(child.pid, signal.SIGUSR2)  # USR2's default action would end it
        child.join(0.5)
        assert child.is_alive()
    finally:
        signal.signal(signal.SIGUSR2, old)
        if child is not None and child.is_alive():
            child.kill()
            child.join()
