"""Reads that retry before they judge: a passing filesystem error is not a damaged file.

On a parallel filesystem (NFS, Lustre, GPFS) a read can fail for a moment, with EIO, ESTALE,
EAGAIN, EINTR or ETIMEDOUT (a server failing over, a lock recalled, a file handle gone stale
after a rename on another node), and succeed when tried again. Taking such a failure for
proof of damage throws good data away: a quarantined segment is never trained on. Every
read of a shared file (buffer segments and archives, published weights, ledgers) goes
through one `ReadRetry`, which judges each failure:

- **transient** (one of `TRANSIENT_ERRNOS`, also when HDF5 reports it inside its own error
  text; ENOENT too when the caller knows the file existed): tried again after
  `RetryPolicy.delays()`, one warning naming the path and errno; when the tries run out,
  `StillUnreadable` (an `OSError` with that errno): the caller keeps the file for later;
- **not visible yet** (ENOENT of a file the caller was told exists, `named`: a pointer such
  as `LATEST` names it): another node renamed it into place and this node's attribute
  caches do not show it yet. Waited for, `RetryPolicy.appear_delays()` (up to `appear_s`,
  longer than any attribute cache), unless the caller's `absent()` says it will not come
  (removed since, ...); then `StillUnreadable` with ENOENT, for the caller to turn into a
  clear error;
- **proof** (the caller's `proof` says so, e.g. a checksum mismatch): raised at once;
- **any other OS error** (EACCES, ENOENT of a file not known to exist, ...): raised at
  once; a missing file is nobody's damage, and the caller says what it means;
- **an error without an errno** (e.g. HDF5 finds a malformed file): read again; the same
  failure (type and message) twice in a row is raised as it is, for the caller to take as
  proof; failures that keep changing end as `StillUnreadable` like transient ones.

Every retry is counted in the `Counter` the retrier was given (`io_retries`, and
`io_recovered` / `io_gave_up` per read that needed one, `io_late` per read that found its
file only after waiting for it to appear), which roles put in their metrics.

Writes of whole files (`ReadRetry.write`: a temporary file written again under a fresh name)
are retried after transient errors with the same policy and counters; a write that is not
idempotent (an append) must not go through it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR,
                              errno.ETIMEDOUT})
"""Errors a shared filesystem returns for a moment and then not: worth reading again."""

# How HDF5 (through h5py) reports the system call's failure inside its own message.
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)")
# How others (torch's file writer: "open file failed with strerror: ...") quote it, and
# HDF5's report of a failed stat(2) that leaves its errno out (an I/O error, not content).
_TRANSIENT_TEXTS = [(c, f"strerror: {os.strerror(c)}") for c in sorted(TRANSIENT_ERRNOS)] + [
    (errno.EIO, "can't retrieve stat info for file")]

PROCESS_COUNTERS: Counter[str] = Counter()
"""Retries of the reads and writes that name no counter of their own (weights, ledgers,
heartbeats, atomic writes ...), per process."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a failed read is tried again.

    The default, 4 tries after waits of 0.1, 0.4 and 1.6 s (2.1 s in all), outlasts a lock
    recall or a brief server hiccup without holding a role up long when a file really is
    unreadable; `later_s` is how long a caller that keeps such a file pending waits before
    it reads it again (the reader: at a poll after that).
    """

    tries: int = 4
    first_delay_s: float = 0.1
    factor: float = 4.0
    max_delay_s: float = 2.0
    later_s: float = 10.0
    appear_s: float = 60.0
    """How long a file that is named but not visible yet is waited for: NFS keeps a
    folder's attributes (and so a name it has not seen) up to `acdirmax`, 60 s by default."""

    def delays(self) -> list[float]:
        """The waits before the second, third, ... try: growing by `factor`, each at most
        `max_delay_s`, `tries - 1` of them."""
        return [min(self.first_delay_s * self.factor ** i, self.max_delay_s)
                for i in range(max(self.tries, 1) - 1)]

    def appear_delays(self) -> list[float]:
        """The waits for a named file to appear: growing as `delays`, then `max_delay_s`
        apart, adding up to `appear_s`."""
        waits: list[float] = []
        while sum(waits) < self.appear_s - 1e-9:
            waits.append(min(self.first_delay_s * self.factor ** len(waits), self.max_delay_s,
                             self.appear_s - sum(waits)))
        return waits


class StillUnreadable(OSError):
    """A read whose errors outlasted the tries (or a caller's OS error that is no verdict
    on the file's bytes): not proof of damage; read it again later."""

    def __init__(self, code: int | None, path: str | os.PathLike[str], tries: int,
                 last: BaseException) -> None:
        name = errno.errorcode.get(code, "error") if code is not None else "changing errors"
        tried = "1 try" if tries == 1 else f"{tries} tries"
        super().__init__(code, f"unreadable after {tried} ({name}): {last}", str(path))
        self.tries = tries
        self.last = last


class Retrier(Protocol):
    """What readers of shared files call to read one file with retries."""

    def read(self, what: str, path: str | os.PathLike[str], fn: Callable[[], T], *,
             proof: Callable[[BaseException], bool] | None = None,
             existed: bool = False, named: bool = False,
             absent: Callable[[], bool] | None = None) -> T:
        """`fn()`, tried again after transient errors; raises what `ReadRetry.read` says."""
        ...


def io_errno(exc: BaseException) -> int | None:
    """The OS error number behind `exc` (its own, one it names in its text as HDF5 does,
    a transient one whose message it quotes as torch's file writer does, or its cause's),
    or None when it names none."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        text = str(e)
        m = _ERRNO_IN_TEXT.search(text)
        if m:
            return int(m.group(1))
        quoted = next((c for c, message in _TRANSIENT_TEXTS if message in text), None)
        if quoted is not None:
            return quoted
        e = e.__cause__ or e.__context__
    return None


class ReadRetry:
    """Reads with retries and verdicts (module docstring), counted in `counters`."""

    def __init__(self, counters: Counter[str] | None = None,
                 policy: RetryPolicy | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.counters = PROCESS_COUNTERS if counters is None else counters
        self.policy = policy or RetryPolicy()
        self._sleep = sleep

    def read(self, what: str, path: str | os.PathLike[str], fn: Callable[[], T], *,
             proof: Callable[[BaseException], bool] | None = None,
             existed: bool = False, named: bool = False,
             absent: Callable[[], bool] | None = None) -> T:
        """Return `fn()` (which reads `path`, a `what` such as "segment"), tried again while
        its errors are transient or unproven.

        Raises at once an error `proof` accepts, a `StillUnreadable` from a nested read, and
        an OS error that is not transient (ENOENT is, with `existed`); raises an error
        without an errno that repeated itself exactly; raises `StillUnreadable` when the
        tries run out. With `named`, ENOENT means "not visible here yet": waited for over
        `RetryPolicy.appear_delays()`, ended early (the `FileNotFoundError` raised as it is)
        when `absent()` says it will not come (removed meanwhile, ...).
        """
        return self._run(what, path, fn, proof=proof, existed=existed, named=named, absent=absent)

    def read_settled(self, what: str, path: str | os.PathLike[str], fn: Callable[[], T],
                     settled: Callable[[T], bool]) -> T:
        """`fn()` (a read of `path`, with this retrier's retries), read again while
        `settled(value)` is False, for up to `RetryPolicy.appear_s`: the file's last version,
        written by a process that has ended, may not be visible on this node yet (its old
        version still shows). Returns the last value read, settled or not (the caller
        judges); counted as `io_retries` and, when it settled after a wait, `io_late`."""
        waits = self.policy.appear_delays()
        tried = 0
        while True:
            value = self.read(what, path, fn)
            if settled(value) or tried == len(waits):
                self.counters["io_late"] += bool(tried) and settled(value)
                return value
            if tried == 0:
                log.info("%s %s: not in its final state yet; reading it again (up to %.0f s)",
                         what, path, sum(waits))
            self.counters["io_retries"] += 1
            self._sleep(waits[tried])
            tried += 1

    def write(self, what: str, path: str | os.PathLike[str], fn: Callable[[], T]) -> T:
        """Return `fn()`, a whole write of `path` that may be done again (a temporary file
        under a fresh name, then a rename), tried again after transient errors (counted as
        reads are) and after an `OSError` without an errno (HDF5's "can't retrieve stat
        info") unless it repeats itself exactly; any other error is raised at once, and
        `StillUnreadable` (an `OSError` with the last errno) when the tries run out."""
        return self._run(what, path, fn, write=True)

    def _run(self, what: str, path: str | os.PathLike[str], fn: Callable[[], T], *,
             proof: Callable[[BaseException], bool] | None = None, existed: bool = False,
             named: bool = False, absent: Callable[[], bool] | None = None,
             write: bool = False) -> T:
        verb = "writing" if write else "reading"
        delays = self.policy.delays()
        waits = self.policy.appear_delays() if named else []
        previous: tuple[type, str] | None = None
        attempt = unseen = 0
        while True:
            try:
                value = fn()
            except Exception as exc:
                code = self._judge(exc, proof, existed or named, previous, write)
                if named and code == errno.ENOENT:
                    if absent is not None and absent():
                        raise
                    delay = self._next(waits, unseen, attempt + unseen, what, path, exc,
                                       f"not visible yet; {verb} it again", quiet=True)
                    unseen += 1
                else:
                    delay = self._next(delays, attempt, attempt + unseen, what, path, exc,
                                       f"{_describe(code, exc)}; {verb} it again", code)
                    attempt += 1
                previous = (type(exc), str(exc))
                self.counters["io_retries"] += 1
                self._sleep(delay)
                continue
            if attempt or unseen:
                self.counters["io_recovered"] += 1
                self.counters["io_late"] += bool(unseen)
                log.info("%s %s %s on try %d", what, path, "written" if write else "read",
                         attempt + unseen + 1)
            return value

    def _next(self, delays: list[float], used: int, tried: int, what: str,
              path: str | os.PathLike[str], exc: Exception, doing: str,
              code: int | None = errno.ENOENT, quiet: bool = False) -> float:
        """The wait before the next try, or `StillUnreadable` when `delays` are used up; the
        first wait of a kind is logged (a warning for an I/O error; at INFO an unproven one
        and, `quiet`, a file not visible yet: routine on a shared filesystem)."""
        if used == len(delays):
            self.counters["io_gave_up"] += 1
            raise StillUnreadable(code, path, tried + 1, exc) from exc
        if used == 0:
            log.log(logging.INFO if quiet or code is None else logging.WARNING,
                    "%s %s: %s (%d more tries within %.1f s)", what, path, doing,
                    len(delays), sum(delays))
        return delays[used]

    @staticmethod
    def _judge(exc: Exception, proof: Callable[[BaseException], bool] | None, existed: bool,
               previous: tuple[type, str] | None, write: bool = False) -> int | None:
        """Re-raise `exc` when it is a verdict; else its errno (None: unproven), to retry."""
        if isinstance(exc, StillUnreadable) or (proof is not None and proof(exc)):
            raise exc
        code = io_errno(exc)
        if code in TRANSIENT_ERRNOS or (code == errno.ENOENT and existed):
            return code
        if code is not None:  # EACCES, ENOENT of a file never seen, ...: no passing fault
            raise exc
        if write and not isinstance(exc, OSError):  # a bug, not the filesystem
            raise exc
        if previous == (type(exc), str(exc)):
            raise exc  # failed the same way twice: the file is what it is
        return None


def _describe(code: int | None, exc: BaseException) -> str:
    if code is not None:
        return f"{errno.errorcode.get(code, code)} (errno {code})"
    return f"{type(exc).__name__}: {exc}"


PROCESS_RETRY = ReadRetry()
"""The retrier of reads that bring no counters of their own (counted in PROCESS_COUNTERS)."""


def io_metrics(*counters: Counter[str]) -> dict[str, int]:
    """The retry counts of `counters` added up (default: this process's), as metric
    values."""
    sources = counters or (PROCESS_COUNTERS,)
    return {name: sum(int(c[name]) for c in sources)
            for name in ("io_retries", "io_recovered", "io_gave_up", "io_late")}


def read_bytes(path: Path, *, retry: Retrier | None = None, what: str = "file") -> bytes:
    """The whole file, read with retries (by `PROCESS_RETRY` unless `retry` is given)."""
    return (retry or PROCESS_RETRY).read(what, path, path.read_bytes)


APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT


def open_append(path: str | os.PathLike[str], *, flags: int = APPEND, mode: int = 0o666,
                what: str = "file") -> int:
    """`os.open(path, flags, mode)` of a file appended to (created if missing), done again
    after transient errors by `PROCESS_RETRY` (opening twice changes nothing; the appends
    themselves are not retried: one that failed may have landed). Returns the descriptor."""
    return PROCESS_RETRY.write(what, path, lambda: os.open(path, flags, mode))
