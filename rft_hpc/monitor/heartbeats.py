"""The roles' heartbeats of a run, read back: one row per role and stage.

Each stage's `state/<role>.json` is the last heartbeat of a role (written by
`runtime.common.write_heartbeat`); `rft-hpc status` shows them for Slurm and local runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rft_hpc.core.rundir import RunDir, read_json
from rft_hpc.monitor.progress import progress

NOT_HEARTBEATS = frozenset({"result", "launcher", "jobs", "processes"})
"""Files of `state/` that are not a role's heartbeat."""


def heartbeats(run: RunDir) -> Iterator[dict[str, Any]]:
    """Each role's last heartbeat in each stage: status, pid, step, total, version, age,
    rate (steps/s), eta (seconds left), backlog, restarts, redone."""
    now = time.time()
    for stage in sorted(run.stages.glob("*")):
        state = RunDir(stage).state
        for path in sorted(state.glob("*.json")):
            if path.stem in NOT_HEARTBEATS or path.stem.startswith(("slurm-", ".")):
                continue
            try:
                beat = read_json(path)
            except (OSError, ValueError):
                continue  # gone since the glob (a stage reset)
            version = beat.get("version")  # the trainer's: the last it published
            if path.stem == "trainer" and beat.get("final_version") is not None:
                version = beat["final_version"]
            p = progress(beat)
            yield {"stage": stage.name, "role": path.stem, "status": beat.get("status"),
                   "pid": beat.get("pid"), "step": beat.get("step"), "total": p.total,
                   "version": version,
                   "age": round(now - beat["time"], 1) if "time" in beat else None,
                   "rate": p.rate, "eta": p.eta, "backlog": beat.get("backlog"),
                   "restarts": beat.get("restarts", 0), "redone": beat.get("redone", 0)}

