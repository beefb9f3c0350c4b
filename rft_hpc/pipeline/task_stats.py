"""The pass rates one explorer saw, kept restart-safe beside its committed steps.

`state/pipeline/explorer-<i>.jsonl` holds one line per explorer step: `{"step": s, "tasks":
{task_id: [passed, rollouts]}}`, written and flushed before the step's records go to the
buffer. So every committed step has its line; a restarted explorer keeps only the lines of
its committed steps (steps < the writer's next step), rewrites the file with them, and
redoes the rest, so its selectors see exactly the pass rates they saw the first time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from rft_hpc.core.retry import open_append
from rft_hpc.core.rundir import atomic_write_text, make_dirs


class TaskStats:
    """Cumulative (passed, rollouts) per task id over the committed steps of one explorer."""

    def __init__(self, path: Path, committed_step: int, *, durable: bool) -> None:
        self.path, self.durable = path, durable
        self.rates: dict[str, tuple[float, int]] = {}
        kept: list[str] = []
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a torn last line: its step was not committed
                    continue
                if row["step"] < committed_step:
                    kept.append(line)
                    self._add(row["tasks"])
        make_dirs(path.parent)
        atomic_write_text(path, "".join(f"{line}\n" for line in kept), durable=durable)
        self._file = os.fdopen(open_append(path, what="task statistics"), "a", encoding="utf-8")

    def _add(self, counts: Mapping[str, list[float] | tuple[float, int]]) -> None:
        for task_id, (passed, seen) in counts.items():
            p0, n0 = self.rates.get(task_id, (0.0, 0))
            self.rates[task_id] = (p0 + passed, n0 + int(seen))

    def record(self, step: int, counts: Mapping[str, tuple[float, int]]) -> None:
        """Append step `step`'s counts (durably when asked) and add them to the rates."""
        self._file.write(json.dumps({"step": step, "tasks": {k: list(v) for k, v
                                                            in counts.items()}}) + "\n")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._add(counts)

    def close(self) -> None:
        """Close the file (the lines are already flushed)."""
        self._file.close()
