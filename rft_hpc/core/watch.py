"""Waiting for a folder to change: woken at once by the kernel where it can tell, else by
the poll interval.

A role that waits for another role's files (the trainer for buffer segments, an explorer
for a new weights version) polls: that is the only thing every shared filesystem supports.
On Linux a `FolderWatch` also asks the kernel (inotify) to wake it when an entry is created
or renamed into a watched folder, so a writer on the same node (`rft-hpc run`, a one-node
job) is seen within a millisecond instead of half a poll interval later, and polls can stay
rare. inotify does not see changes made on other nodes of a parallel filesystem; there the
wait simply ends at its timeout, as a plain poll would. A wake-up means "look now", never
"something is there": the caller still polls, and a missed or spurious event costs at most
one poll interval. A thread of the same process can also wake the waiter (`poke`: a writer
that hands its data over in memory, `buffer.segment_tap`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import time
from typing import Protocol

_IN_CREATE = 0x00000100
_IN_MOVED_TO = 0x00000080
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENTS = _IN_CREATE | _IN_MOVED_TO


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):  # not Linux, or a libc without inotify
        return None


class Waitable(Protocol):
    """What a stop flag's sleep can be woken by (`FolderWatch`, an in-process handover)."""

    def wait(self, timeout: float) -> bool:
        """Block until there is something to look at or `timeout` seconds pass; True when
        there is."""
        ...


class FolderWatch:
    """Wakes a waiter when an entry appears in (is created in or renamed into) one of the
    watched folders; without inotify (or past its watch limit) it only sleeps."""

    _libc: ctypes.CDLL | None = None
    _looked = False

    def __init__(self, *folders: str | os.PathLike[str]) -> None:
        self._fd = -1
        self._watched: set[str] = set()
        self._pokes = self._poker = -1
        self._pokes, self._poker = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if not FolderWatch._looked:
            FolderWatch._libc, FolderWatch._looked = _libc(), True
        if FolderWatch._libc is not None:
            fd = FolderWatch._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            self._fd = fd if fd >= 0 else -1
        for folder in folders:
            self.add(folder)

    @property
    def active(self) -> bool:
        """Whether the kernel wakes this watch (False: waits are plain sleeps)."""
        return self._fd >= 0 and bool(self._watched)

    def add(self, folder: str | os.PathLike[str]) -> bool:
        """Watch `folder` too (once); False when it cannot be watched (missing, no
        inotify, the user's watch limit reached): waits then rely on their timeout."""
        key = os.fspath(folder)
        if key in self._watched:
            return True
        if self._fd < 0 or self._libc is None:
            return False
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(key), _EVENTS)
        if wd < 0:
            return False
        self._watched.add(key)
        return True

    def poke(self) -> None:
        """Wake the waiter now, or end its next wait at once (from any thread)."""
        with contextlib.suppress(OSError):  # full (already poked), or closed
            os.write(self._poker, b"!")

    def wait(self, timeout: float) -> bool:
        """Block until a watched folder changes, a `poke` or `timeout` seconds pass; True on
        a change or a poke. Those since the last wait end it at once."""
        if self._pokes < 0:
            time.sleep(max(0.0, timeout))
            return False
        fds = [self._pokes, self._fd] if self.active else [self._pokes]
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        for fd in ready:
            self._drain(fd)
        return bool(ready)

    @staticmethod
    def _drain(fd: int) -> None:
        """Read away every queued event (they only say "look now")."""
        while True:
            try:
                if not os.read(fd, 65536):
                    return
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return

    def close(self) -> None:
        """Release the kernel's watch and the pokes' pipe (waits sleep afterwards)."""
        for fd in (self._fd, self._pokes, self._poker):
            if fd >= 0:
                os.close(fd)
        self._fd = self._pokes = self._poker = -1
        self._watched.clear()

    def __del__(self) -> None:
        self.close()

