"""Metrics of one role: JSON lines in `metrics/<role>.jsonl` and TensorBoard events.

Each line is one complete JSON object (`{"step": ..., "time": ..., "<name>": value}`),
appended whole in one write (a short write on a filling disk is cut off again and raised as
`StorageFull`), so a reader tailing the file never sees half a record and a restarted role
continues the same file. TensorBoard gets one event per `log` holding every
numeric value as a scalar tagged with its name (one event per value, as `add_scalar` writes
them, cost a role ~1 ms a step for its ~30 metrics), appended in the caller's thread
(`monitor.events_file`): a failure (a full disk) surfaces in `log`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rft_hpc.core.retry import PROCESS_COUNTERS, PROCESS_RETRY, open_append
from rft_hpc.core.rundir import make_dirs
from rft_hpc.core.storage import StorageFull, append_whole, cut_torn_tail

if TYPE_CHECKING:
    from rft_hpc.monitor.events_file import EventsFile

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends a role's metrics to `<metrics_dir>/<role>.jsonl` and to TensorBoard."""

    def __init__(self, metrics_dir: Path, role: str, *, tensorboard: bool = True) -> None:
        make_dirs(metrics_dir)
        self.path = metrics_dir / f"{role}.jsonl"
        self._fd = open_append(self.path, flags=os.O_RDWR | os.O_APPEND | os.O_CREAT,
                               what="metrics")
        PROCESS_RETRY.read("metrics", self.path, lambda: cut_torn_tail(self._fd))
        self.tb_dir = metrics_dir / "tb" / role
        self._tb: EventsFile | None = None
        if tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary

            from rft_hpc.monitor.events_file import EventsFile

            self._summary = Summary
            self._tb = EventsFile(self.tb_dir)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Record `values` at `step` (non-finite floats are written as null)."""
        row: dict[str, Any] = {"step": step, "time": time.time()}
        scalars = []
        for key, value in values.items():
            finite = not isinstance(value, float) or math.isfinite(value)
            row[key] = value if finite else None
            if finite and isinstance(value, int | float) and not isinstance(value, bool):
                scalars.append((key, float(value)))
        if self._tb is not None and scalars:
            entry = self._summary.Value
            self._add_summary(self._summary(value=[entry(tag=k, simple_value=v)
                                                   for k, v in scalars]), step)
        append_whole(self._fd, (json.dumps(row) + "\n").encode("utf-8"), self.path)

    def _add_summary(self, summary: Any, step: int) -> None:
        """Append to TensorBoard's events; a full disk stops the role (`StorageFull`); after
        another I/O error go on in a new events file (that event is lost, the JSON lines are
        not)."""
        assert self._tb is not None
        try:
            self._tb.add(summary, step)
            return
        except StorageFull:
            raise
        except OSError as exc:
            log.warning("TensorBoard events of %s: %s; going on in a new events file",
                        self.path.stem, exc)
        PROCESS_COUNTERS["io_retries"] += 1
        with contextlib.suppress(OSError):
            self._tb.close()
        self._tb = type(self._tb)(self.tb_dir)  # a new EventsFile in the same folder

    def close(self) -> None:
        """Close the JSON lines file and TensorBoard's events (every line and event is
        written by then)."""
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()


class MetricsTail:
    """Follows a metrics file: each call returns the complete lines added since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_rows(self) -> list[dict[str, Any]]:
        """The complete lines added since the last call (read with retries, `core.retry`:
        `StillUnreadable` when I/O errors outlast them; read again at the next call)."""
        try:
            data = PROCESS_RETRY.read("metrics", self.path, self._read_new)
        except FileNotFoundError:
            return []
        rows: list[dict[str, Any]] = []
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a line still being written: read it next time
            self.offset += len(line)
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def _read_new(self) -> bytes:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            return f.read()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file."""
    return MetricsTail(path).new_rows()
