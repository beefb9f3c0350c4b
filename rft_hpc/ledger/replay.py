"""Reading ledger files back and replaying them into each role's effective history.

A ledger (docs/ledger.md) is the append-only story of every process of one role. Replaying
it voids the steps a restart redid: a `start` voids the steps from its `first_redone` on
written before it (a trainer's `resume_step` + 1, an explorer's `resume_step`). What
remains is the effective history, which `rft_hpc.ledger.audit` checks against the buffer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import read_bytes

LEDGER_VERSION = 1
"""The ledger format this rft-hpc writes and the newest it reads (docs/ledger.md)."""


class LedgerError(UserError):
    """A ledger file that cannot be read: the message names the file and line."""


@dataclass(frozen=True)
class Event:
    """One ledger line: its 1-based line number and its JSON object."""

    line: int
    data: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.data["event"])


@dataclass(frozen=True)
class StepEntry:
    """A step event of the effective history, with the process (life) that wrote it."""

    step: int
    line: int
    life: int
    """0 for the first process of the file, 1 for the one after the first restart, ..."""
    data: dict[str, Any]


@dataclass
class Restart:
    """A `start` after the first one: what it voided and what it cost."""

    line: int
    resume_step: int
    redone: list[int]
    """Steps voided by this restart (work done again), in the order they had been written."""
    seconds_lost: float
    """Gap from the last event before the start to it, plus the voided steps' seconds."""
    cause: str
    """The previous process's stop reason (`requeue`, `walltime`, ...) or `crash` (no stop)."""


@dataclass
class History:
    """The replay of one ledger file."""

    path: Path
    role: str
    steps: list[StepEntry] = field(default_factory=list)
    """The effective history: steps not voided by a later restart, in the order written."""
    restarts: list[Restart] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)
    first_resume: int | None = None
    """`resume_step` of the first `start` (None without one)."""

    @property
    def redone_steps(self) -> int:
        return sum(len(r.redone) for r in self.restarts)

    def summary(self) -> dict[str, Any]:
        """Steps, restarts, redone steps and seconds lost per restart, as plain JSON."""
        return {"steps": len(self.steps), "restarts": len(self.restarts),
                "redone_steps": self.redone_steps,
                "seconds_lost": [round(r.seconds_lost, 3) for r in self.restarts],
                "causes": [r.cause for r in self.restarts]}


_REQUIRED = {
    "ledger": ("ledger_version", "role"),
    "start": ("resume_step",),
    "step": ("step",),
    "save": ("step",),
    "stop": ("reason",),
    "scored": ("request", "explorer", "calls"),
}


def read_events(path: Path) -> list[Event]:
    """The events of a ledger file with their line numbers; a torn last line (no newline) is
    skipped. The file is read with retries (`core.retry`: a passing EIO or ESTALE is read
    again). Raises `LedgerError` naming the file and line of anything malformed, or the
    error that outlasted the retries."""
    try:
        data = read_bytes(path, what="ledger")
    except OSError as exc:
        raise LedgerError(f"cannot read ledger {path}: {exc.strerror or exc}") from None
    events = []
    for number, raw in enumerate(data[:data.rfind(b"\n") + 1].split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            raise LedgerError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("event"), str) \
                or not isinstance(obj.get("time"), int | float):
            raise LedgerError(f"{path}:{number}: not a ledger event (needs `event` and `time`)")
        missing = [k for k in _REQUIRED.get(obj["event"], ()) if k not in obj]
        if missing:
            raise LedgerError(f"{path}:{number}: `{obj['event']}` event lacks {', '.join(missing)}")
        if obj["event"] == "ledger" and int(obj["ledger_version"]) > LEDGER_VERSION:
            raise LedgerError(f"{path}:{number}: ledger_version {obj['ledger_version']} is newer "
                              f"than this rft-hpc reads ({LEDGER_VERSION}): upgrade rft-hpc")
        events.append(Event(number, obj))
    return events


def replay(path: Path, *, trainer: bool) -> History:
    """Replay a ledger file into its effective history (docs/ledger.md, "Replaying").

    A start voids the steps from its `first_redone` on written before it; without that field,
    the steps > `resume_step` for the trainer (`trainer=True`), >= it for an explorer.
    """
    events = read_events(path)
    role = next((str(e.data["role"]) for e in events if e.kind == "ledger"), path.stem)
    history = History(path, role)
    effective: list[StepEntry] = []
    life = -1
    previous: Event | None = None
    stopped: str | None = None
    for event in events:
        data = event.data
        if event.kind == "start":
            resume = int(data["resume_step"])
            first_void = int(data.get("first_redone", resume + 1 if trainer else resume))
            if life < 0:
                history.first_resume = resume
            else:
                voided = [e for e in effective if e.step >= first_void]
                effective = [e for e in effective if e.step < first_void]
                gap = data["time"] - previous.data["time"] if previous is not None else 0.0
                lost = max(gap, 0.0) + sum(float(e.data.get("seconds") or 0.0) for e in voided)
                history.restarts.append(Restart(event.line, resume, [e.step for e in voided],
                                                lost, stopped or "crash"))
            life += 1
            stopped = None
        elif event.kind == "step":
            effective.append(StepEntry(int(data["step"]), event.line, max(life, 0), data))
        elif event.kind == "save":
            history.saves.append(int(data["step"]))
        elif event.kind == "stop":
            stopped = str(data["reason"])
        if event.kind != "ledger":
            previous = event
    history.steps = effective
    return history


def sequence_problems(history: History, first: int) -> list[str]:
    """Problems with the effective steps not being exactly `first`, `first`+1, ..., each
    once: steps done twice (with their lines) and steps missing."""
    lines: dict[int, list[int]] = {}
    for entry in history.steps:
        lines.setdefault(entry.step, []).append(entry.line)
    problems = [f"{history.role} step {step} done {len(at)} times (lines "
                f"{', '.join(map(str, at))})" for step, at in sorted(lines.items()) if len(at) > 1]
    last = max(lines, default=first - 1)
    missing = [s for s in range(first, last + 1) if s not in lines]
    problems += [f"{history.role} step {a} missing" if a == b else
                 f"{history.role} steps {a}..{b} missing" for a, b in _ranges(missing)]
    problems += [f"{history.role} step {s} is below {first}" for s in sorted(lines) if s < first]
    return problems


def _ranges(numbers: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as runs of consecutive ones: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs
