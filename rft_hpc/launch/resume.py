"""`rft-hpc resume`: resubmit what of a run failed, was cancelled or died with its node.

The run's job graph is planned again from its frozen config. A job whose work is done
(heartbeats, results, the stage laid out) is left out, and a dependency on it counts as
satisfied; a job still queued is kept; everything else is submitted again, an array with only
its unfinished, unqueued tasks. Each role continues from its own checkpoint. The watchers of
`submit --auto-resume` call the same function when a job fails.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, open_run_dir, read_json
from rft_hpc.eval.bench import RESULTS_FILE
from rft_hpc.eval.results import result_path
from rft_hpc.launch.sbatch import Job, with_array_tasks
from rft_hpc.launch.status import job_states
from rft_hpc.launch.submit import (
    SubmitResult,
    check_resources,
    first_unfinished,
    plan_jobs,
    prepare_first_stage,
    require_slurm,
    submissions,
    submit_jobs,
)
from rft_hpc.runtime.common import role_status

ALIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING",
                   "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT"})
"""Slurm states of a job that will still run (or runs)."""


LOCK_STALE_SECONDS = 600.0
"""A resume lock older than this was left by a resume that died: it is broken."""


def resume_run(path: Path, lock_timeout: float = 300.0) -> SubmitResult:
    """Resubmit the unfinished jobs of a submitted run that are no longer queued, after the
    queued ones they need. Refused beyond `launch.max_resubmits` resubmissions. Two resumes
    of one run (watchers of two failed jobs) take turns: the second finds the first's jobs
    queued and submits nothing."""
    run = open_run_dir(path)
    with _lock(run.resume_lock, lock_timeout):
        return _resume(run)


@contextlib.contextmanager
def _lock(folder: Path, timeout: float) -> Iterator[None]:
    """Hold `folder` as a lock: mkdir is atomic on every shared filesystem, flock is not."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            folder.mkdir()
            break
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - folder.stat().st_mtime > LOCK_STALE_SECONDS:
                    folder.rmdir()
                    continue
            if time.monotonic() > deadline:
                raise UserError(f"another `rft-hpc resume` of this run holds {folder}; "
                                "try again later (or remove it if none runs)") from None
            time.sleep(1.0)
    try:
        yield
    finally:
        folder.rmdir()


def _resume(run: RunDir) -> SubmitResult:
    config = load_config(run.config)
    first = first_unfinished(config, run)
    if first is None:
        return SubmitResult(run.root, [], finished=True)
    history = submissions(run)
    if not history:
        raise UserError(f"{run.root} was never submitted: use `rft-hpc submit`")
    require_slurm()
    latest = history[-1]
    auto = bool(latest.get("auto_resume"))
    states = job_states([e["id"] for e in latest["jobs"]])
    kept = [e for e in latest["jobs"] if _alive_tasks(e, states)]
    planned = plan_jobs(config, run, first, source=str(run.config), auto_resume=auto)
    jobs = _jobs_to_submit(planned, kept, states, config, run)
    if not jobs:
        return SubmitResult(run.root, [])
    done = sum(1 for s in history if s.get("resume"))
    if done >= config.launch.max_resubmits:
        raise UserError(f"{run.root} was resubmitted {done} times already "
                        f"(launch.max_resubmits); look at `rft-hpc logs`, then raise the "
                        "limit in a new run or resubmit by hand")
    check_resources(jobs)
    prepare_first_stage(config, run, first)
    ids = submit_jobs(run, jobs, kept=kept, auto_resume=auto, resumed=True)
    return SubmitResult(run.root, jobs, ids)


def _alive_tasks(entry: dict[str, Any], states: dict[str, str]) -> set[int | None]:
    """Tasks of a recorded job still queued: array indices, or {None} for a plain job."""
    alive: set[int | None] = set()
    for key, state in states.items():
        if state not in ALIVE:
            continue
        if key == entry["id"]:
            alive.add(None)
        elif key.startswith(entry["id"] + "_") and key.split("_", 1)[1].isdigit():
            alive.add(int(key.split("_", 1)[1]))
    return alive


def _jobs_to_submit(planned: list[Job], kept: list[dict[str, Any]], states: dict[str, str],
                    config: ExperimentConfig, run: RunDir) -> list[Job]:
    queued: dict[str, set[int | None]] = {}
    for entry in kept:
        queued.setdefault(entry["name"], set()).update(_alive_tasks(entry, states))
    out: list[Job] = []
    for job in planned:
        if job.role == "watch":
            if out and out[-1].name == job.after[0]:
                out.append(job)  # the watcher of a job submitted again
            continue
        left = _work_left(job, config, run)
        if job.array is None:
            if left and not queued.get(job.name):
                out.append(job)
            continue
        rerun = [i for i in left if i not in queued.get(job.name, set())]
        if rerun:
            out.append(with_array_tasks(job, rerun))
    return out


def _work_left(job: Job, config: ExperimentConfig, run: RunDir) -> list[int]:
    """What of `job` is not done yet: its unfinished array tasks, or [0] for a plain job
    that still has work ([] when it has none)."""
    if job.role == "finalize":
        return [] if run.summary.exists() else [0]
    index, stage = next((i, s) for i, (n, s) in enumerate(config.stage_configs())
                        if n == job.stage)
    stage_run = run.stage(index, job.stage or "")
    if job.role == "prepare":
        return [] if stage_run.config.exists() else [0]
    if job.role == "trainer":
        return [] if role_status(stage_run, "trainer") == "done" else [0]
    if job.role == "explorer":
        return [i for i in range(stage.explorer.count)
                if role_status(stage_run, f"explorer-{i}") != "done"]
    if job.role == "reward":
        return [j for j in range(stage.reward_job.count)
                if role_status(stage_run, f"reward-{j}") != "done"]
    if job.role == "bench":  # a stage in mode bench: done once it has collected
        return [] if (stage_run.bench / RESULTS_FILE).exists() else [0]
    if job.role == "evaluator":
        versions = stage.eval.scored_versions(stage.trainer.steps)
        return [i for i, v in enumerate(versions) if not result_path(stage_run, v).exists()
                and not (i == len(versions) - 1 and _evaluated_last(stage_run))]
    raise ValueError(f"unknown role {job.role!r}")


def _evaluated_last(stage: RunDir) -> bool:
    """The last evaluator task scores the trainer's final version, which may be earlier
    than trainer.steps when the data ran out."""
    path = stage.heartbeat("trainer")
    if not path.exists():
        return False
    final = read_json(path).get("final_version")
    return final is not None and result_path(stage, final).exists()
