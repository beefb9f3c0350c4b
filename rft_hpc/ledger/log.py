"""The ledger: what each role did, step by step, appended to `ledger/<role>.jsonl`.

The trainer records which buffer records every step consumed and which weights it
published; explorers record each step they wrote; every process records its start (with the
step it resumed from) and its stop. `rft-hpc audit` checks a run's invariants from the buffer
and these files alone (docs/ledger.md). One writer per file; each line is one complete JSON
object, written with a single `write`; the trainer fsyncs its ledger (`sync`) before each
checkpoint, so a checkpoint never holds a step the ledger lacks. A line torn by a crash
can only be the last one, and readers skip it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft_hpc.core.retry import PROCESS_RETRY, open_append
from rft_hpc.core.rundir import make_dirs
from rft_hpc.core.storage import append_whole, cut_torn_tail, naming_full
from rft_hpc.ledger.replay import LEDGER_VERSION, replay


class LedgerWriter:
    """Appends events of one role to `<ledger_dir>/<role>.jsonl`."""

    def __init__(self, ledger_dir: Path, role: str, *, durable: bool = True) -> None:
        make_dirs(ledger_dir)
        self.path = ledger_dir / f"{role}.jsonl"
        self.durable = durable
        self._fd = open_append(self.path, flags=os.O_RDWR | os.O_APPEND | os.O_CREAT,
                               what="ledger")
        PROCESS_RETRY.read("ledger", self.path, lambda: cut_torn_tail(self._fd))
        if os.fstat(self._fd).st_size == 0:
            self.append("ledger", ledger_version=LEDGER_VERSION, role=role)

    def append(self, event: str, **fields: object) -> None:
        """Append one event (with the time) in one write, whole or not at all (a short write
        is cut off again: `append_whole`); a failed one is not written again: it may have
        landed, and a doubled line would count twice. Fsync it when durable."""
        line = json.dumps({"event": event, "time": time.time(), **fields},
                          separators=(",", ":")) + "\n"
        append_whole(self._fd, line.encode("utf-8"), self.path)
        if self.durable:
            self.sync()

    def start(self, resume_step: int, *, first_redone: int) -> RestartCount:
        """Record that a process of this role started, resuming at `resume_step` (see
        docs/ledger.md), and count the restarts and redone steps so far: every step event
        numbered `first_redone` or later that is still in effect is void from now on."""
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.append("start", resume_step=resume_step, pid=os.getpid(),
                    slurm_restarts=restarts, job=os.environ.get("SLURM_JOB_ID"),
                    first_redone=first_redone)
        history = replay(self.path, trainer=first_redone > resume_step)
        return RestartCount(len(history.restarts), history.redone_steps)

    def sync(self) -> None:
        """Put every event appended so far on stable storage."""
        with naming_full(self.path):
            os.fsync(self._fd)

    def close(self) -> None:
        """Put every event on stable storage and close the file."""
        try:
            self.sync()
        finally:
            os.close(self._fd)


@dataclass(frozen=True)
class RestartCount:
    """How often a role's processes were started again, and the steps they redid."""

    restarts: int
    redone: int


def compact_refs(refs: Iterable[Any]) -> list[list[Any]]:
    """Record refs (writer, segment, index) as `[[writer, segment, [index, ...]], ...]` in
    the order first seen, the ledger's form of a step's `consumed` field."""
    groups: dict[tuple[str, int], list[int]] = {}
    for ref in refs:
        groups.setdefault((ref.writer, ref.segment), []).append(ref.index)
    return [[w, s, idx] for (w, s), idx in groups.items()]
