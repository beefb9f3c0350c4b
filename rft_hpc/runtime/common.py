"""What every role needs: its frozen config, a stop flag for signals, a heartbeat file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType

import yaml

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.core.json_types import JSONValue
from rft_hpc.core.retry import PROCESS_RETRY, StillUnreadable, read_bytes
from rft_hpc.core.rundir import RunDir, atomic_write_json, atomic_write_text
from rft_hpc.core.watch import Waitable
from rft_hpc.runtime.lifecycle import RequeueRequested
from rft_hpc.runtime.placement import role_threads
from rft_hpc.runtime.signals import STOP_SIGNALS, take_early


def freeze_config(config: ExperimentConfig, path: Path) -> None:
    """Write the resolved config that the roles of a stage read."""
    data = config.model_dump(mode="json", exclude={"stages"})
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def load_stage(stage_dir: Path) -> tuple[ExperimentConfig, RunDir]:
    """The frozen config of a stage directory and its paths. The launcher that started
    this role wrote the config: one this node does not see yet is waited for (`core.retry`,
    `named`); one that never appears ends as the config loader's "not found"."""
    run = RunDir(stage_dir)
    with contextlib.suppress(StillUnreadable):
        PROCESS_RETRY.read("stage config", run.config, run.config.stat, named=True)
    return load_config(run.config), run


class StopFlag:
    """Set by SIGINT, SIGTERM or SIGUSR2 (Slurm's warning), or by the role itself when its
    job's time runs out: the role stops at a safe point. A signal that came before the flag
    existed (see `signals.catch_early`) counts as if it came now."""

    def __init__(self) -> None:
        self.signal: int | None = take_early()
        self.walltime = False
        self.requested: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = signum

    def out_of_time(self) -> None:
        """Stop because the next step would not fit in the job's time."""
        self.walltime = True

    def request(self, reason: str) -> None:
        """Stop for `reason` (colocated: the other loop in this process failed)."""
        self.requested = reason

    def __bool__(self) -> bool:
        return self.signal is not None or self.walltime or self.requested is not None

    @property
    def reason(self) -> str:
        """Why the role stops: `requeue` (USR2), `walltime`, `stopped` (INT, TERM) or
        `running` (not stopped)."""
        if self.signal == signal.SIGUSR2:
            return "requeue"
        if self.walltime:
            return "walltime"
        if self.signal is None and self.requested is not None:
            return self.requested
        return "stopped" if self.signal is not None else "running"

    def check_requeue(self) -> None:
        """Raise `RequeueRequested` when the role stopped to run again in a next job."""
        if self.reason in ("requeue", "walltime"):
            raise RequeueRequested(self.reason)

    def sleep(self, seconds: float, watch: Waitable | None = None) -> bool:
        """Sleep up to `seconds`, waking early on a stop signal or, with `watch`, as soon as
        a watched folder changes; True if stopped."""
        deadline = time.monotonic() + seconds
        while not self and time.monotonic() < deadline:
            left = min(0.02 if watch is None else 0.1, max(0.0, deadline - time.monotonic()))
            if watch is None:
                time.sleep(left)
            elif watch.wait(left):
                break
        return bool(self)


FRESH_BEAT_SECONDS = 0.25
"""A colocated explorer's heartbeat younger than this is fresh enough to show what it has
in flight (`rft-hpc status`): the beat after a submit is skipped within it (the beat after
each written step is not). Each beat replaces a file, ~1 ms between a version's arrival and
its generation, on the critical path of a colocated loop whose steps take tens of
milliseconds (docs/colocated.md). A split explorer beats after every submit: a watcher
(the chaos tests) may wait for a step in flight between two written steps."""


def write_heartbeat(run: RunDir, role: str, **fields: JSONValue) -> None:
    """Replace `state/<role>.json` with the role's current state and the time (and, in a
    Slurm job, how many times Slurm has restarted it)."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    atomic_write_json(run.heartbeat(role),
                      {"role": role, "pid": os.getpid(), "time": time.time(),
                       "restarts": restarts, **fields}, durable=False)


def read_heartbeat(run: RunDir, role: str) -> dict[str, JSONValue]:
    """A role's last heartbeat (`write_heartbeat`'s fields), read with retries
    (`core.retry`); {} when it has none or it stayed unreadable."""
    path = run.heartbeat(role)
    try:
        return json.loads(read_bytes(path, what="heartbeat"))
    except (OSError, ValueError):
        return {}


def final_heartbeat(run: RunDir, role: str) -> dict[str, JSONValue]:
    """The heartbeat of a role whose process has ended: read again while it still says
    `running` (its last beat, written on another node, may not be visible here yet), up to
    `RetryPolicy.appear_s`; then as it is (a role that died says `running` for ever)."""
    return PROCESS_RETRY.read_settled("heartbeat", run.heartbeat(role),
                                      lambda: read_heartbeat(run, role),
                                      lambda beat: beat.get("status") != "running")


def role_status(run: RunDir, role: str) -> str | None:
    """The status in a role's last heartbeat (`running`, `stopped`, `done`), None if none."""
    return read_heartbeat(run, role).get("status")


def set_threads(setting: int | None, cpus: list[int] | None = None) -> int:
    """Pin the role to `cpus` when given and set torch's CPU threads to `setting`, or when
    None to what fits the role's place (`runtime.placement.role_threads`); logs the number
    and why, and returns it."""
    import torch

    threads, why = role_threads(setting, cpus)
    torch.set_num_threads(threads)
    logging.getLogger(__name__).info("%d CPU threads (%s)", threads, why)
    return threads
