"""A full disk or an exceeded quota: one recognizer, one exception, one message.

A write that fails with ENOSPC (no space left on the device) or EDQUOT (the user's or the
group's quota exceeded) is no fault of the file being written, nor of rft-hpc: the role
cannot go on, and the same command, run again once space is back, resumes the run (every
commit is an atomic rename: nothing committed is lost, nothing half-written is read).

Libraries report it their own way: Python's `OSError` (errno 28 or 122), HDF5 through h5py
in its message text (`errno = 28`), the safetensors crate as `code: 28` or `StorageFull`,
and torch.save to a path as a bare "file write failed" (rft-hpc writes checkpoints through
a Python file, so its `OSError` comes through). `storage_full` sees it in an exception or
anywhere in its chain and returns a `StorageFull` that names the errno and, when known, the
path; a role ends on it with `exit_status` (the errno itself: 28 or 122), which Slurm's
accounting shows and the local launcher reads, and which a job script does not requeue.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable, Iterable, Iterator

from rft_hpc.core.errors import UserError

STORAGE_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a full disk (ENOSPC) and of an exceeded quota (EDQUOT)."""

_IN_TEXT = (re.compile(r"errno\s*=\s*(\d+)"), re.compile(r"\bcode:\s*(\d+)"),
            re.compile(r"\[Errno (\d+)\]"))
"""How libraries put the system call's errno into their message (HDF5, Rust's io::Error,
an OSError turned into text)."""
_NAMES_IN_TEXT = {"StorageFull": errno.ENOSPC, "No space left on device": errno.ENOSPC,
                  "QuotaExceeded": errno.EDQUOT, "Disk quota exceeded": errno.EDQUOT}
_PATH_IN_TEXT = re.compile(r"""(?:filename|name) = '([^']+)'""")
"""HDF5 names the file in its message: `filename = '/path/x.h5'`."""


class StorageFull(OSError):
    """A write failed because the disk is full or the quota is exceeded (`errno` is ENOSPC
    or EDQUOT, `filename` the path when known)."""

    def __init__(self, code: int, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(code, os.strerror(code), None if path is None else os.fspath(path))

    @property
    def name(self) -> str:
        """The errno's name: `ENOSPC` or `EDQUOT`."""
        return errno.errorcode.get(self.errno, str(self.errno))

    def describe(self) -> str:
        """`No space left on device (ENOSPC) writing /path` (the path when known)."""
        where = f" writing {self.filename}" if self.filename else ""
        return f"{self.strerror} ({self.name}){where}"

    def __str__(self) -> str:
        return self.describe()

    def __reduce__(self) -> tuple[type[StorageFull], tuple[int, str | None]]:
        # OSError pickles its (errno, strerror, filename); this constructor takes two
        return StorageFull, (int(self.errno), self.filename)


class StoppedOnFullStorage(UserError):
    """A run stopped because one of its roles (or the launcher) met a full disk or an
    exceeded quota: the message says who, what and where, and what to do; the command exits
    with `exit_status`."""

    def __init__(self, message: str, full: StorageFull) -> None:
        super().__init__(message)
        self.full = full
        self.exit_status = exit_status(full)


def storage_full(exc: BaseException | None) -> StorageFull | None:
    """The `StorageFull` that `exc` (or an exception in its chain of causes and contexts)
    reports, None when none of them is a full disk or an exceeded quota.

    The deepest `StorageFull` in the chain wins: it is the first failure, and what the
    closing of other files (failing on the same full disk while it propagated) raised came
    later. Without one, the first errno and path the chain names.
    """
    code: int | None = None
    path: str | None = None
    named: StorageFull | None = None
    seen: set[int] = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StorageFull) and e.filename:
            named = e
        found = _errno_of(e)
        if found in STORAGE_FULL_ERRNOS and code is None:
            code = found
        if path is None:
            path = _path_of(e)
        e = e.__cause__ or e.__context__
    if named is not None:
        return named
    return None if code is None else StorageFull(code, path)


def _errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    text = str(e)
    for pattern in _IN_TEXT:
        for m in pattern.finditer(text):
            if int(m.group(1)) in STORAGE_FULL_ERRNOS:
                return int(m.group(1))
    for words, code in _NAMES_IN_TEXT.items():
        if words in text:
            return code
    return None


def _path_of(e: BaseException) -> str | None:
    if isinstance(e, OSError) and e.filename:
        return os.fspath(e.filename)
    m = _PATH_IN_TEXT.search(str(e))
    return m.group(1) if m else None


@contextlib.contextmanager
def naming_full(path: str | os.PathLike[str]) -> Iterator[None]:
    """Run the block; a full disk or an exceeded quota met in it is raised as `StorageFull`
    naming `path` (from the error), any other error as it is."""
    try:
        yield
    except Exception as exc:
        raise_if_full(exc, path)
        raise


def raise_if_full(exc: BaseException, path: str | os.PathLike[str]) -> None:
    """Raise `StorageFull` naming `path` (from `exc`) when `exc` is a full disk or an
    exceeded quota; return otherwise (the caller re-raises `exc`)."""
    full = storage_full(exc)
    if full is not None:
        raise StorageFull(int(full.errno), path) from exc


def exit_status(full: StorageFull) -> int:
    """The exit status of a role that stopped on `full`: its errno (28 or 122)."""
    return int(full.errno)


def full_from_exit(status: int | None) -> StorageFull | None:
    """The `StorageFull` a role's exit `status` says it stopped on (no path), else None."""
    return StorageFull(status) if status in STORAGE_FULL_ERRNOS else None


def advice(full: StorageFull, again: str = "run the same command again") -> str:
    """What the user does about `full`: `free space ..., then <again>; nothing committed is
    lost`."""
    what = "raise the quota or free space" if full.errno == errno.EDQUOT \
        else "free space or raise the quota"
    return f"{what}, then {again}; nothing committed is lost"


def append_whole(fd: int, data: bytes, path: str | os.PathLike[str]) -> None:
    """Append `data` to the file open at `fd` (O_APPEND) in one write, whole or not at all:
    a short write (a disk filling up) is cut off again and raised as `StorageFull`, so that
    the file never ends in half a line that the next append would glue to its own."""
    size = os.fstat(fd).st_size
    with naming_full(path):
        written = os.write(fd, data)
    if written != len(data):
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise StorageFull(errno.ENOSPC, path)


def cut_torn_tail(fd: int) -> None:
    """Drop a last line without its newline (a writer killed mid-write): appending after it
    would glue two lines into one unreadable line."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    data = os.pread(fd, size, 0)
    os.ftruncate(fd, data.rfind(b"\n") + 1)


def close_all(closers: Iterable[Callable[[], object]]) -> None:
    """Call every closer, even when one fails (a full disk fails each flush), then raise the
    first failure: nothing is left open (a writer thread, a worker pool) because an earlier
    close raised."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as exc:  # raised below, after the others closed
            first = first or exc
    if first is not None:
        raise first
