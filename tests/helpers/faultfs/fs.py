"""A FUSE filesystem that passes every call through to a backing folder and misbehaves as a
shared parallel filesystem does, on a seeded schedule (run as a program: `mount.py` starts
and stops it).

    python fs.py BACKING MOUNTPOINT SCHEDULE.json

The schedule (JSON; read again whenever the file changes, so a test can lift a full disk
while the roles run):

    {"seed": 0, "log": "faults.jsonl", "stats": "stats.json",
     "faults": [{"ops": ["open", "read"], "errno": "EIO", "rate": 0.01},
                {"ops": ["read"], "short": 0.05, "path": "\\\\.h5$"},
                {"ops": ["write", "fsync"], "errno": "ENOSPC", "rate": 0.002,
                 "sticky": true}],
     "metadata_delay": 0.02, "rename_lag": 2.0}

- a fault strikes the calls named in `ops` (`OPS`) whose path (from the mount's root)
  matches `path` (a regular expression, searched) and whose process's name matches
  `process`, each with probability `rate` from a generator seeded with `seed` and the
  fault's position; it fails the call with `errno` (by name), or, with `short`, a read
  returns part of what was asked (the file is opened `direct_io` so that the program sees
  the short read(2), not a file that ended early);
- `sticky`: once struck, it strikes every later matching call (a full disk stays full)
  until the schedule changes;
- `metadata_delay`: seconds every metadata call (`METADATA`) waits first, as on a busy
  metadata server; the kernel's attribute and entry caches stay at FUSE's 1 s, so a
  program's repeated look at one file within a second is answered by the client, as on NFS;
- `rename_lag`: seconds for which a name a process made by renaming stays unseen by every
  other process (and a name it replaced shows them the old file), as with attribute caches
  on different nodes; the kernel's caches are then off, so each process asks.

Processes are told apart by their thread-group id and named by what they say they are:
`/proc/PID/comm` when it starts with `rft-` (roles name themselves), else the command line.
`stats` is rewritten at most twice a second: per process name, the calls of each kind, and
the faults each process met; `log` gets one JSON line per fault struck; `trace`, when
given, one line per call: process, call, path (tab-separated).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import mfusepy as fuse

METADATA = frozenset({"getattr", "readdir", "open", "create", "rename", "unlink", "mkdir",
                      "rmdir", "truncate", "utimens", "chmod", "access", "statfs", "readlink",
                      "symlink", "link"})
"""Calls a metadata server answers (delayed by `metadata_delay`, counted apart)."""

OPS = METADATA | {"read", "write", "fsync", "flush", "release"}


class Fault:
    """One entry of the schedule with its own seeded generator."""

    def __init__(self, index: int, spec: dict[str, Any], seed: int) -> None:
        unknown = set(spec) - {"ops", "errno", "rate", "short", "path", "process", "sticky"}
        if unknown or not set(spec.get("ops", ())) <= OPS:
            raise ValueError(f"fault {index}: unknown keys or ops in {spec}")
        self.index = index
        self.ops = frozenset(spec["ops"])
        self.errno = getattr(errno, spec.get("errno", "EIO"))
        self.rate = float(spec.get("rate", spec.get("short", 0.0)))
        self.short = "short" in spec
        self.path = re.compile(spec.get("path", ""))
        self.process = re.compile(spec["process"]) if "process" in spec else None
        self.sticky = bool(spec.get("sticky", False))
        self.struck = False
        self.rng = random.Random(seed * 1000 + index)

    def strikes(self, op: str, path: str, process: str) -> bool:
        """Whether this call is one the fault strikes (drawing from its generator)."""
        if op not in self.ops or not self.path.search(path):
            return False
        if self.process is not None and not self.process.search(process):
            return False
        if self.sticky and self.struck:
            return True
        self.struck = self.rng.random() < self.rate
        return self.struck


class Schedule:
    """The faults, delays and lag in force, read from the schedule file."""

    def __init__(self, data: dict[str, Any]) -> None:
        seed = int(data.get("seed", 0))
        self.faults = [Fault(i, f, seed) for i, f in enumerate(data.get("faults", ()))]
        self.metadata_delay = float(data.get("metadata_delay", 0.0))
        self.rename_lag = float(data.get("rename_lag", 0.0))
        self.log = data.get("log")
        self.stats = data.get("stats")
        self.trace = data.get("trace")


class Processes:
    """Names of the processes that call, by thread id (read again after a second: a role
    forked from `rft-hpc run` names itself once it has started)."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[float, int, str]] = {}

    def of(self, tid: int) -> tuple[int, str]:
        """(thread-group id, name) of the caller `tid`."""
        now = time.monotonic()
        known = self._names.get(tid)
        if known is None or now - known[0] > 1.0:
            known = self._names[tid] = (now, *self._read(tid))
        return known[1], known[2]

    @staticmethod
    def _read(tid: int) -> tuple[int, str]:
        try:
            status = Path(f"/proc/{tid}/status").read_text()
            tgid = int(re.search(r"^Tgid:\s*(\d+)", status, re.M).group(1))  # type: ignore
            comm = Path(f"/proc/{tgid}/comm").read_text().strip()
            if comm.startswith("rft-"):
                return tgid, comm[4:]
            args = Path(f"/proc/{tgid}/cmdline").read_bytes().split(b"\0")
            words = [a.decode(errors="replace") for a in args if a]
            if "rft_hpc.cli" in words:  # python -m rft_hpc.cli COMMAND ...
                after = words[words.index("rft_hpc.cli") + 1:]
                return tgid, " ".join(after[:2] if after[:1] == ["role"] else after[:1])
            return tgid, os.path.basename(words[0]) if words else "?"
        except (OSError, AttributeError, ValueError):
            return tid, "?"


class FaultFS(fuse.Operations):
    """Passthrough to `root`, with the schedule's faults, delays and lag."""

    use_ns = True

    def __init__(self, root: str, schedule_file: str) -> None:
        self.root = os.path.realpath(root)
        self.old = self.root + ".faultfs-old"  # old files shown to lagging views
        os.makedirs(self.old, exist_ok=True)
        self.schedule_file = schedule_file
        self.schedule_mtime = 0.0
        self.schedule = Schedule({})
        self.checked = 0.0
        self.mutex = threading.Lock()
        self.processes = Processes()
        self.calls: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.faults: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.renamed: dict[str, tuple[float, int, str | None]] = {}  # path: (until, tgid, old)
        self.written = 0.0
        self.traced: list[str] = []
        self._reload()

    # -- the schedule, the counts and the faults ---------------------------------------

    def _reload(self) -> None:
        mtime = os.stat(self.schedule_file).st_mtime
        if mtime != self.schedule_mtime:
            self.schedule_mtime = mtime
            self.schedule = Schedule(json.loads(Path(self.schedule_file).read_text()))

    def _enter(self, op: str, path: str, *, fail: bool = True) -> tuple[int, str]:
        """Count the call, wait the metadata delay, raise a fault that strikes it."""
        tgid, name = self.processes.of(fuse.fuse_get_context()[2])
        now = time.monotonic()
        with self.mutex:
            if now - self.checked > 0.2:
                self.checked = now
                self._reload()
                if now - self.written > 0.5:
                    self.written = now
                    self._write_stats()
            self.calls[name][op] += 1
            if self.schedule.trace:
                self.traced.append(f"{name}\t{op}\t{path}\n")
                if len(self.traced) > 1000:
                    self._flush_trace()
            struck = None
            if fail:
                for fault in self.schedule.faults:
                    if not fault.short and fault.strikes(op, path, name):
                        struck = fault
                        break
            if struck is not None:
                self.faults[name][errno.errorcode[struck.errno]] += 1
                self._log(struck, op, path, tgid, name)
        if op in METADATA and self.schedule.metadata_delay > 0:
            time.sleep(self.schedule.metadata_delay)
        if struck is not None:
            raise fuse.FuseOSError(struck.errno)
        return tgid, name

    def _log(self, fault: Fault, op: str, path: str, tgid: int, name: str) -> None:
        if self.schedule.log:
            with open(self.schedule.log, "a") as f:
                f.write(json.dumps({"fault": fault.index, "op": op, "path": path, "pid": tgid,
                                    "process": name, "short": fault.short,
                                    "errno": errno.errorcode[fault.errno]}) + "\n")

    def _write_stats(self) -> None:
        if self.schedule.stats:
            data = {"calls": self.calls, "faults": self.faults}
            tmp = self.schedule.stats + ".tmp"
            Path(tmp).write_text(json.dumps(data, sort_keys=True))
            os.replace(tmp, self.schedule.stats)

    def _flush_trace(self) -> None:
        with open(self.schedule.trace, "a") as f:
            f.writelines(self.traced)
        self.traced.clear()

    def destroy(self, path: str) -> None:
        with self.mutex:
            self._write_stats()
            if self.schedule.trace:
                self._flush_trace()

    def _real(self, path: str, tgid: int) -> str:
        """The backing path a caller sees: a lagging view sees a renamed name late."""
        seen = self.renamed.get(path)
        if seen is not None:
            until, renamer, old = seen
            if time.monotonic() >= until:
                self.renamed.pop(path, None)
                if old:
                    _unlink(old)
            elif renamer != tgid:
                if old is None:
                    raise fuse.FuseOSError(errno.ENOENT)
                return old
        return self.root + path

    # -- metadata ---------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        tgid, _ = self._enter("getattr", path)
        st = os.lstat(self._real(path, tgid))
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid",
                                            "st_gid", "st_ino", "st_blocks")} | {
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

    def readdir(self, path: str, fh: int) -> list[str]:
        tgid, _ = self._enter("readdir", path)
        names = os.listdir(self._real(path, tgid))
        prefix = path.rstrip("/") + "/"
        hidden = {p for p, (until, renamer, old) in list(self.renamed.items())
                  if old is None and renamer != tgid and time.monotonic() < until}
        return [".", ".."] + [n for n in names if prefix + n not in hidden]

    def access(self, path: str, amode: int) -> int:
        tgid, _ = self._enter("access", path)
        if not os.access(self._real(path, tgid), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self._enter("statfs", path, fail=False)
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                            "f_favail", "f_ffree", "f_files", "f_flag",
                                            "f_frsize", "f_namemax")}

    def rename(self, old: str, new: str) -> int:
        tgid, _ = self._enter("rename", old)
        lag = self.schedule.rename_lag
        kept = None
        if lag > 0 and os.path.isfile(self.root + new):
            kept = os.path.join(self.old, f"{time.monotonic_ns()}-{os.path.basename(new)}")
            os.link(self.root + new, kept)
        os.rename(self.root + old, self.root + new)
        if lag > 0:
            with self.mutex:
                self.renamed[new] = (time.monotonic() + lag, tgid, kept)
        return 0

    def unlink(self, path: str) -> int:
        self._enter("unlink", path)
        os.unlink(self.root + path)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._enter("mkdir", path)
        os.mkdir(self.root + path, mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._enter("rmdir", path)
        os.rmdir(self.root + path)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._enter("symlink", target)
        os.symlink(source, self.root + target)
        return 0

    def readlink(self, path: str) -> str:
        tgid, _ = self._enter("readlink", path)
        return os.readlink(self._real(path, tgid))

    def link(self, target: str, source: str) -> int:
        self._enter("link", target)
        os.link(self.root + source, self.root + target)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._enter("chmod", path)
        os.chmod(self.root + path, mode)
        return 0

    def truncate(self, path: str, length: int, fi: Any = None) -> int:
        self._enter("truncate", path)
        if fi is not None:
            os.ftruncate(fi.fh, length)
        else:
            os.truncate(self.root + path, length)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._enter("utimens", path)
        os.utime(self.root + path, ns=times) if times else os.utime(self.root + path)
        return 0

    # -- data -------------------------------------------------------------------------

    def _short_reads(self, path: str, name: str) -> bool:
        return any(f.short and "read" in f.ops and f.path.search(path)
                   and (f.process is None or f.process.search(name))
                   for f in self.schedule.faults)

    def open(self, path: str, fi: Any) -> int:
        tgid, name = self._enter("open", path)
        fi.fh = os.open(self._real(path, tgid), fi.flags)
        # direct_io only where reads may come back short: it forbids mmap (safetensors)
        fi.direct_io = self._short_reads(path, name)
        return 0

    def create(self, path: str, mode: int, fi: Any) -> int:
        self._enter("create", path)
        fi.fh = os.open(self.root + path, fi.flags | os.O_CREAT, mode)
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        tgid, name = self._enter("read", path)
        for fault in self.schedule.faults:
            if fault.short and size > 1 and fault.strikes("read", path, name):
                size = fault.rng.randrange(1, size)
                with self.mutex:
                    self.faults[name]["short"] += 1
                self._log(fault, "read", path, tgid, name)
                break
        return os.pread(fi.fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        self._enter("write", path)
        return os.pwrite(fi.fh, data, offset)

    def fsync(self, path: str, datasync: int, fi: Any) -> int:
        self._enter("fsync", path)
        os.fdatasync(fi.fh) if datasync else os.fsync(fi.fh)
        return 0

    def flush(self, path: str, fi: Any) -> int:
        self._enter("flush", path, fail=False)
        return 0

    def release(self, path: str, fi: Any) -> int:
        self._enter("release", path, fail=False)
        os.close(fi.fh)
        return 0


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def main() -> None:
    backing, mountpoint, schedule = sys.argv[1:4]
    ops = FaultFS(backing, schedule)
    caches = 0.0 if ops.schedule.rename_lag > 0 else 1.0
    fuse.FUSE(ops, mountpoint, raw_fi=True, foreground=True, nothreads=False,
              entry_timeout=caches, attr_timeout=caches, negative_timeout=0.0,
              default_permissions=True)


if __name__ == "__main__":
    main()
