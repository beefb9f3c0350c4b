"""A role's progress from its heartbeat: step/total, rate and time left, and their text.

A heartbeat (`state/<role>.json`, written by `runtime.common.write_heartbeat`) holds the
steps done (`step`), the steps to do (`total`), and when and at which step the role's
current process began its loop (`started`, `start_step`); the rate is the steps this process
has done over the time it took (waits for data or weights included), the time left the steps
still to do at that rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """Steps done and to do, steps per second, and seconds left (None where unknown)."""

    step: int | None
    total: int | None
    rate: float | None
    eta: float | None


def progress(beat: Mapping[str, Any]) -> Progress:
    """The progress a heartbeat shows: no rate before the process's first step, no time
    left without a rate (0 once every step is done or the role is done)."""
    step, total = beat.get("step"), beat.get("total")
    started, first, now = beat.get("started"), beat.get("start_step"), beat.get("time")
    rate = None
    if None not in (step, started, first, now) and step > first and now > started:
        rate = (step - first) / (now - started)
    eta = None
    if beat.get("status") == "done":
        eta = 0.0
    elif step is not None and total is not None:
        if step >= total:
            eta = 0.0
        elif rate:
            eta = (total - step) / rate
    return Progress(step, total, rate, eta)


def format_step(step: int | None, total: int | None) -> str:
    """`3/6`, `3` without a total, `-` without a step."""
    if step is None:
        return "-"
    return str(step) if total is None else f"{step}/{total}"


def format_rate(rate: float | None) -> str:
    """`2.5 steps/s` at a step a second or faster, else `1.3 s/step`; `-` if unknown."""
    if not rate:
        return "-"
    if rate >= 1:
        return f"{rate:.1f} steps/s"
    per = 1 / rate
    return f"{per:.1f} s/step" if per < 100 else f"{per:.0f} s/step"


def format_eta(seconds: float | None) -> str:
    """Time left as `45s`, `3m05s`, `2h07m` (rounded to the second); `-` if unknown."""
    if seconds is None:
        return "-"
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
