"""Filesystem faults injected into real processes: the file-opening calls fail on schedule.

A schedule (JSON, usually in the environment variable `RFT_TEST_FAULTS` of the processes
under test; `sitecustomize.py` beside this file installs it at interpreter start) lists
faults. Each fault names a wrapped call and when it fires:

    {"seed": 0, "log": "/tmp/x/faults.jsonl", "faults": [
      {"call": "h5py.File", "path": "explorer-0/00000001\\\\.h5$", "process": "role trainer",
       "nth": [1], "errno": "EIO"},
      {"call": "open", "path": "weights/", "mode": "read", "probability": 0.2,
       "errno": "ESTALE"},
      {"call": "os.open", "path": "ledger/", "mode": "write", "nth": [3], "errno": "ENOSPC"},
      {"call": "h5py.File", "path": "\\\\.h5$", "action": "delay", "seconds": 0.5, "nth": [2]}]}

- `call`: one of `CALLS` (`h5py.File`, `open` (builtins and io), `os.open`, `os.stat`).
- `path`: a regular expression searched in the path the call is given; `process`: one
  searched in the process's command line (`sys.argv`), at the time of the call (a role
  forked from a fork server has its own); `mode`: `read` or `write` (a call that may write:
  `w`, `a`, `+`, `x` modes, `O_WRONLY`/`O_RDWR`), any when left out.
- when: `nth`, the 1-based numbers of the matching calls (counted per fault and process)
  that fire, and/or `probability`, drawn from a generator seeded with `seed` and the
  fault's position (the same schedule fires the same calls in the same process).
- `action`: `raise` (default: `OSError(errno, strerror, path)`, `errno` by name) or
  `delay` (sleep `seconds`, then make the call).

Each firing appends one JSON line to `log` (when given): the fault's position, the call,
the path, the action and the pid, so a test can tell that its faults happened.
"""

from __future__ import annotations

import builtins
import errno as errno_names
import io
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

ENV = "RFT_TEST_FAULTS"


@dataclass
class Fault:
    """One entry of a schedule, with its own count of matching calls and its generator."""

    index: int
    call: str
    path: re.Pattern[str]
    process: re.Pattern[str] | None = None
    mode: str | None = None
    nth: frozenset[int] = frozenset()
    probability: float = 0.0
    action: str = "raise"
    errno: int = errno_names.EIO
    seconds: float = 0.0
    seen: int = 0
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def from_json(cls, index: int, spec: dict[str, Any], seed: int) -> Fault:
        """Entry `index` of a schedule; `ValueError` for an unknown key, call or action."""
        unknown = set(spec) - {"call", "path", "process", "mode", "nth", "probability",
                               "action", "errno", "seconds"}
        if unknown or spec.get("call") not in CALLS or spec.get("action", "raise") not in (
                "raise", "delay") or spec.get("mode") not in (None, "read", "write"):
            raise ValueError(f"fault {index}: bad entry {spec}")
        return cls(index, spec["call"], re.compile(spec.get("path", "")),
                   re.compile(spec["process"]) if "process" in spec else None,
                   spec.get("mode"), frozenset(spec.get("nth", ())),
                   float(spec.get("probability", 0.0)), spec.get("action", "raise"),
                   getattr(errno_names, spec.get("errno", "EIO")),
                   float(spec.get("seconds", 0.0)), rng=random.Random(seed * 1000 + index))

    def fires(self, call: str, path: str, writes: bool) -> bool:
        """Whether this call is one the fault strikes (counting it when it matches)."""
        if call != self.call or not self.path.search(path):
            return False
        if self.mode is not None and (self.mode == "write") != writes:
            return False
        if self.process is not None and not self.process.search(" ".join(sys.argv)):
            return False
        self.seen += 1
        return self.seen in self.nth or (self.probability > 0
                                         and self.rng.random() < self.probability)


class Hook(Protocol):
    """How one wrapped call is found, replaced and read: its path and whether it writes."""

    def install(self, strike: Callable[[str, str, bool], None]) -> Callable[[], None]:
        """Wrap the call so that `strike(call, path, writes)` runs first; return the undo."""
        ...


@dataclass
class Schedule:
    """The faults of one process, and where their firings are logged."""

    faults: list[Fault]
    log: str | None = None

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """The schedule a JSON text describes (module docstring)."""
        data = json.loads(text)
        seed = int(data.get("seed", 0))
        return cls([Fault.from_json(i, f, seed) for i, f in enumerate(data["faults"])],
                   data.get("log"))

    def strike(self, call: str, path: str, writes: bool) -> None:
        """Run before each wrapped call: fire every fault that strikes it."""
        for fault in self.faults:
            if not fault.fires(call, path, writes):
                continue
            self._record(fault, call, path)
            if fault.action == "delay":
                time.sleep(fault.seconds)
            else:
                raise OSError(fault.errno, os.strerror(fault.errno), path)

    def _record(self, fault: Fault, call: str, path: str) -> None:
        if self.log is None:
            return
        line = json.dumps({"fault": fault.index, "call": call, "path": path, "pid": os.getpid(),
                           "action": fault.action, "errno": errno_names.errorcode[fault.errno],
                           "seen": fault.seen}) + "\n"
        fd = _REAL_OS_OPEN(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


_REAL_OS_OPEN = os.open


def _writes_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class _H5pyFile:
    """`h5py.File` replaced by a subclass that strikes before opening."""

    def install(self, strike: Callable[[str, str, bool], None]) -> Callable[[], None]:
        import h5py

        real = h5py.File

        class File(real):  # type: ignore[misc, valid-type]
            def __init__(self, name: Any, mode: str = "r", *args: Any, **kwargs: Any) -> None:
                if isinstance(name, str | bytes | os.PathLike):
                    strike("h5py.File", os.fsdecode(name), _writes_mode(mode))
                super().__init__(name, mode, *args, **kwargs)

        h5py.File = File

        def undo() -> None:
            h5py.File = real
        return undo


class _BuiltinOpen:
    """`open` (builtins.open, io.open: what pathlib uses) wrapped."""

    def install(self, strike: Callable[[str, str, bool], None]) -> Callable[[], None]:
        real = builtins.open

        def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, str | bytes | os.PathLike):
                strike("open", os.fsdecode(file), _writes_mode(mode))
            return real(file, mode, *args, **kwargs)

        builtins.open = io.open = open

        def undo() -> None:
            builtins.open = io.open = real
        return undo


class _OsCall:
    """`os.open` or `os.stat` wrapped."""

    def __init__(self, name: str) -> None:
        self.name = name

    def install(self, strike: Callable[[str, str, bool], None]) -> Callable[[], None]:
        real = getattr(os, self.name)
        call = f"os.{self.name}"

        def wrapped(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | bytes | os.PathLike):
                flags = args[0] if args else kwargs.get("flags", 0)
                writes = call == "os.open" and bool(flags & (os.O_WRONLY | os.O_RDWR))
                strike(call, os.fsdecode(path), writes)
            return real(path, *args, **kwargs)

        setattr(os, self.name, wrapped)

        def undo() -> None:
            setattr(os, self.name, real)
        return undo


CALLS: dict[str, Hook] = {"h5py.File": _H5pyFile(), "open": _BuiltinOpen(),
                          "os.open": _OsCall("open"), "os.stat": _OsCall("stat")}
"""The calls a fault can name. A new kind of call is one more `Hook` here."""


def install(schedule: Schedule) -> Callable[[], None]:
    """Wrap the calls `schedule` names; return a function that puts the real ones back."""
    undos = [CALLS[name].install(schedule.strike)
             for name in sorted({f.call for f in schedule.faults})]

    def uninstall() -> None:
        for undo in reversed(undos):
            undo()
    return uninstall


def install_from_environment() -> None:
    """Install the schedule in `RFT_TEST_FAULTS`, if there is one (sitecustomize's job)."""
    text = os.environ.get(ENV)
    if text:
        install(Schedule.from_json(text))


def fired(log: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The firings a schedule's `log` holds, in order (none when it was never written)."""
    try:
        with builtins.open(log, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
