"""How a role ends a Slurm job's life early and asks for the next one.

A role stops at its next safe point, saves, and exits with `REQUEUE_EXIT` when Slurm's
warning signal (USR2, `--signal=USR2@<launch.slurm.signal_delay>`) arrives or when its next
step would not fit in the job's remaining time (`JobClock`). The job script
(slurm/role.sbatch) then requeues the job, which starts again from the checkpoint;
`rft-hpc run` restarts the role process the same way.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from datetime import datetime

log = logging.getLogger(__name__)

REQUEUE_EXIT = 75
"""Exit status of a role that saved and wants to run again (EX_TEMPFAIL). A role stopped by
a full disk or an exceeded quota exits with that errno instead, 28 or 122
(`rft_hpc.core.storage.exit_status`): not requeued, it waits for space and a resume."""

JOB_END_ENV = "RFT_JOB_END_TIME"
"""Epoch seconds at which the role must have stopped; overrides what Slurm says."""


class RequeueRequested(Exception):
    """Raised by a role that saved its state and asks to be started again."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"saved and asking to be requeued ({reason})")
        self.reason = reason


def job_end_time() -> float | None:
    """When this job's time limit ends (epoch seconds), or None when unknown or unlimited:
    `RFT_JOB_END_TIME`, else Slurm's `SLURM_JOB_END_TIME`, else `squeue`'s end time."""
    for var in (JOB_END_ENV, "SLURM_JOB_END_TIME"):
        if os.environ.get(var):
            return float(os.environ[var])
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    if os.environ.get("SLURM_ARRAY_JOB_ID"):  # an array's first task has the array's id
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        out = subprocess.run(["squeue", "--noheader", f"--jobs={job}", "--format=%e"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return datetime.fromisoformat(out.split()[0]).timestamp()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("cannot tell when job %s ends (%s): relying on Slurm's signal", job, exc)
        return None


class JobClock:
    """Decides whether the next step (and a save after it) still fits in the job's time.

    Step and save times are measured as the role runs; the estimate is the slowest of the
    last few, plus `margin` seconds for the exit and whatever was not measured.
    """

    def __init__(self, margin: float, end: float | None = None, window: int = 8) -> None:
        self.margin = margin
        self.end = job_end_time() if end is None else end
        self.window = window
        self._steps: list[float] = []
        self.save_seconds = 0.0

    def observe_step(self, seconds: float) -> None:
        """Record how long a step took."""
        self._steps = [*self._steps[-(self.window - 1):], seconds]

    def observe_save(self, seconds: float) -> None:
        """Record how long a save (checkpoint, segment commit) took."""
        self.save_seconds = max(self.save_seconds, seconds)

    def next_step_fits(self) -> bool:
        """False when the next step, a save and the margin would run past the job's end."""
        if self.end is None:
            return True
        need = max(self._steps, default=0.0) + self.save_seconds + self.margin
        return time.time() + need < self.end
