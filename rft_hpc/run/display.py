"""The live view of a running stage: one row per role, refreshed from metrics and heartbeats.

Each row shows the role's step/total, its rate and time left (from its heartbeat,
`monitor.progress`), weight version, reward, eval accuracy and buffer backlog. On a terminal
it is a rich live table; otherwise (CI, logs) a progress line every few seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rich.live import Live
from rich.table import Table

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.console import console
from rft_hpc.core.rundir import RunDir
from rft_hpc.monitor.metrics import MetricsTail
from rft_hpc.monitor.progress import format_eta, format_rate, format_step, progress
from rft_hpc.runtime.common import read_heartbeat

log = logging.getLogger(__name__)

PLAIN_INTERVAL_SECONDS = 5.0


class Display:
    """Shows each role's step/total, rate, time left, weight version, reward, eval accuracy
    and buffer backlog."""

    def __init__(self, config: ExperimentConfig, run: RunDir, title: str, *,
                 live: bool | None = None, roles: list[str] | None = None) -> None:
        """Rows for `roles` (default: the roles the config's mode runs)."""
        self.config, self.run, self.title = config, run, title
        if roles is None:
            roles = ["bench"] if config.mode == "bench" else []
            roles += ["trainer"] if config.mode in ("both", "train") else []
            if config.mode in ("both", "explore"):
                roles += [f"explorer-{i}" for i in range(config.explorer.count)]
                roles += [f"reward-{j}" for j in range(config.reward_job.count)]  # requests
        self.roles = roles
        self.tails = {r: MetricsTail(run.metrics_file(r)) for r in roles}
        self.last: dict[str, dict[str, Any]] = {r: {} for r in roles}
        self.eval: float | None = None
        self.live = console.is_terminal if live is None else live
        self._live: Live | None = None
        self._printed = 0.0
        self.t0 = time.monotonic()

    def __enter__(self) -> Display:
        if self.live:
            self._live = Live(self._table(), console=console, refresh_per_second=4)
            self._live.__enter__()
        else:
            console.print(f"{self.title}: {', '.join(self.roles)} started in {self.run.root}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
        else:
            console.print(self._line())

    def note(self, message: str) -> None:
        console.print(message)

    def refresh(self) -> None:
        """Read what the roles wrote since the last refresh and redraw."""
        for role, tail in self.tails.items():
            try:
                rows = tail.new_rows()
            except OSError as exc:  # unreadable for now: the display catches up next time
                log.warning("metrics of %s unreadable for now: %s", role, exc)
                continue
            for row in rows:
                if row.get("eval_accuracy") is not None:
                    self.eval = row["eval_accuracy"]
                self.last[role].update(row)
        if self._live is not None:
            self._live.update(self._table())
        elif time.monotonic() - self._printed >= PLAIN_INTERVAL_SECONDS:
            self._printed = time.monotonic()
            console.print(self._line())

    def _heartbeat(self, role: str) -> dict[str, Any]:
        return read_heartbeat(self.run, role)

    def _table(self) -> Table:
        t = Table(title=f"{self.title}  ({time.monotonic() - self.t0:.0f} s)")
        for col in ("role", "status", "step", "rate", "left", "weights", "reward", "eval acc",
                    "backlog", "loss"):
            t.add_column(col, justify="left" if col in ("role", "status") else "right")
        for role in self.roles:
            m, hb = self.last[role], self._heartbeat(role)
            p = progress(hb)
            t.add_row(role, hb.get("status", "starting"), format_step(p.step, p.total),
                      format_rate(p.rate), format_eta(p.eta),
                      _fmt(m.get("version", hb.get("final_version", hb.get("version")))),
                      _fmt(m.get("reward_mean")),
                      _fmt(self.eval) if role == "trainer" else "",
                      _fmt(m.get("backlog")), _fmt(m.get("loss")))
        return t

    def _line(self) -> str:
        parts = [f"{self.title} {time.monotonic() - self.t0:.0f}s"]
        for role in self.roles:
            m, p = self.last[role], progress(self._heartbeat(role))
            parts.append(f"{role} step {format_step(p.step, p.total)} "
                         f"{format_rate(p.rate)} left {format_eta(p.eta)} "
                         f"reward {_fmt(m.get('reward_mean'))}")
        if self.eval is not None:
            parts.append(f"eval acc {self.eval:.3f}")
        return " | ".join(parts)


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
