"""Metrics of one role: JSON lines in `metrics/<role>.jsonl` and TensorBoard events.

Each line is one complete JSON object (`{"step": ..., "time": ..., "<name>": value}`),
appended whole in one write (a short write on a filling disk is cut off again and raised as
`StorageFull`), so a reader tailing the file never sees half a record and a restarted role
continues the same file. TensorBoard gets one event per `log` holding every
numeric value as a scalar tagged with its name (one event per value, as `add_scalar` writes
them, cost a role ~1 ms a step for its ~30 metrics), flushed at once: its writer thread's
failure (a full disk) surfaces in `log`, not as a queue that stops draining.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rft_hpc.core.retry import PROCESS_RETRY
from rft_hpc.core.storage import append_whole, cut_torn_tail, raise_if_full


class MetricsWriter:
    """Appends a role's metrics to `<metrics_dir>/<role>.jsonl` and to TensorBoard."""

    def __init__(self, metrics_dir: Path, role: str, *, tensorboard: bool = True) -> None:
        metrics_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_dir / f"{role}.jsonl"
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        PROCESS_RETRY.read("metrics", self.path, lambda: cut_torn_tail(self._fd))
        self._tb = None
        if tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard.writer import FileWriter

            self.tb_dir = metrics_dir / "tb" / role
            try:
                self._tb, self._summary = FileWriter(str(self.tb_dir)), Summary
            except Exception as exc:
                raise_if_full(exc, self.tb_dir)
                raise

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
            try:
                self._tb.add_summary(self._summary(value=[entry(tag=k, simple_value=v)
                                                          for k, v in scalars]), step)
                self._tb.flush()
            except Exception as exc:
                raise_if_full(exc, self.tb_dir)
                raise
        append_whole(self._fd, (json.dumps(row) + "\n").encode("utf-8"), self.path)

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard events (a failure to write the last
        events, e.g. on a full disk, is raised after both are closed)."""
        os.close(self._fd)
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception as exc:
                raise_if_full(exc, self.tb_dir)
                raise


class MetricsTail:
    """Follows a metrics file: each call returns the complete lines added since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        if not self.path.exists():
            return rows
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a line still being written: read it next time
                self.offset += len(line)
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
        return rows


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file."""
    return MetricsTail(path).new_rows()
