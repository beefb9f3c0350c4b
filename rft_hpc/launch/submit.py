"""`rft-hpc submit` and `rft-hpc render`: a config becomes a graph of Slurm jobs.

Per stage, an explorer array and a trainer job (with `reward_job.count`, a reward job array
beside them; and, with `eval.evaluator`, an evaluator
array after the trainer, which only the final job waits for); between stages a small
`prepare` job (it finishes the stage before and lays out the next one, which starts from its
weights); at the end a `finalize` job (summary.json, report.png). Every job is checked with `sbatch
--test-only` before anything is submitted, so a run is never half-submitted because the
cluster cannot hold one of its jobs. Each job is our own script (the one `render` writes and
`--dry-run` prints), given to sbatch through submitit's public `helpers.CommandFunction`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.config.placement import colocated
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, atomic_write_json, atomic_write_text, read_json
from rft_hpc.launch.sbatch import (
    Job,
    JobContext,
    bench_stage_job,
    dependency_option,
    helper_job,
    reward_job_array,
    role_job,
    submit_script,
    watch_job,
)
from rft_hpc.run.stages import (
    check_runnable,
    check_same_config,
    create_run,
    prepare_model,
    prepare_stage,
    run_root,
    stage_result,
    start_weights,
)
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS

JOBS_FILE = "jobs.json"  # in state/ (RunDir.jobs_record)
"""`<run>/state/jobs.json`: every submission of the run, with its jobs' Slurm ids."""

# Words of Slurm's refusals, and the setting each one points at.
_HINTS = (("account", "account"), ("partition", "partition"), ("gres", "gpus_per_node"),
          ("gpu", "gpus_per_node"), ("qos", "qos"), ("time limit", "time"),
          ("memory", "mem"), ("feature", "constraint"), ("constraint", "constraint"),
          ("node configuration", "nodes, tasks_per_node, cpus_per_task, mem or gpus_per_node"),
          ("node count", "nodes"))


@dataclass
class SubmitResult:
    """What `submit_run` / `render_run` did: the run directory and the jobs."""

    root: Path
    jobs: list[Job]
    ids: dict[str, list[str]] = field(default_factory=dict)
    """Slurm job ids of each job name (empty for a dry run or a render; more than one
    where `resume` reruns some tasks of an array that still has others running)."""
    finished: bool = False
    """The run had finished before: nothing to submit."""


def submit_run(config_path: Path, overrides: Sequence[str] | None = None,
               name: str | None = None, dry_run: bool = False,
               auto_resume: bool = False) -> SubmitResult:
    """Validate a config, lay out and freeze its run directory and submit its jobs.

    A run directory that exists with the same config is resumed: finished stages are
    skipped. `dry_run` renders the scripts and submits (and creates) nothing. With
    `auto_resume`, a watcher job per role job runs `rft-hpc resume` if that job fails.
    """
    config, run, first = _load(config_path, overrides, name)
    if first is None:
        return SubmitResult(run.root, [], finished=True)
    jobs = plan_jobs(config, run, first, source=str(config_path), auto_resume=auto_resume)
    if dry_run:
        return SubmitResult(run.root, jobs)
    require_slurm()
    _check_pass_env(config)
    _refuse_if_queued(run)
    check_resources(jobs)
    config, run = create_run(config)
    prepare_first_stage(config, run, first)
    return SubmitResult(run.root, jobs, submit_jobs(run, jobs, auto_resume=auto_resume))


def render_run(config_path: Path, out: Path, overrides: Sequence[str] | None = None,
               name: str | None = None) -> SubmitResult:
    """Write the run's scripts and a `submit.sh` that sbatches them in order to `out`.

    The run directory is laid out and frozen as `submit` does, so the scripts run as they
    are; nothing is submitted.
    """
    config, run, first = _load(config_path, overrides, name)
    if first is None:
        return SubmitResult(run.root, [], finished=True)
    jobs = plan_jobs(config, run, first, source=str(config_path))
    config, run = create_run(config)
    prepare_first_stage(config, run, first)
    out.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        atomic_write_text(out / job.file_name, job.script)
    script = out / "submit.sh"
    atomic_write_text(script, submit_script(jobs, run.root.name, str(config_path)))
    script.chmod(0o755)
    return SubmitResult(run.root, jobs)


def _load(config_path: Path, overrides: Sequence[str] | None, name: str | None,
          ) -> tuple[ExperimentConfig, RunDir, int | None]:
    extra = [f"run.name={name}"] if name is not None else []
    config = load_config(config_path, [*(overrides or []), *extra], checks=PREFLIGHT_CHECKS)
    check_runnable(config)
    run = RunDir(run_root(config))
    if run.config.exists():  # a finished run must not hide that this config is another one
        check_same_config(prepare_model(config), run)
    return config, run, first_unfinished(config, run)


def first_unfinished(config: ExperimentConfig, run: RunDir) -> int | None:
    """Index of the first stage without a result, or None when every stage has one."""
    for index, (name, _) in enumerate(config.stage_configs()):
        if stage_result(run.stage(index, name)) is None:
            return index
    return None


def plan_jobs(config: ExperimentConfig, run: RunDir, first: int, *, source: str,
              cwd: Path | None = None, auto_resume: bool = False) -> list[Job]:
    """The jobs of stages `first`.. in submission order, each after the ones it needs (with
    `auto_resume`, each role's job followed by its watcher)."""
    jobs = _plan(config, run, first, source=source, cwd=cwd)
    if not auto_resume:
        return jobs
    ctx = JobContext(run, config.launch, (cwd or Path.cwd()).resolve(), source)
    return [j for job in jobs for j in ([job, watch_job(ctx, job)] if job.role in ROLE_JOBS
                                        else [job])]


ROLE_JOBS = frozenset({"explorer", "trainer", "evaluator", "bench", "reward"})
"""Roles whose jobs restart from their own checkpoints (and get a watcher)."""


def _plan(config: ExperimentConfig, run: RunDir, first: int, *, source: str,
          cwd: Path | None) -> list[Job]:
    ctx = JobContext(run, config.launch, (cwd or Path.cwd()).resolve(), source)
    jobs: list[Job] = []
    evaluators: list[str] = []  # side branches: the next stage need not wait for them
    after: tuple[str, ...] = ()
    for index, (name, stage) in enumerate(config.stage_configs()):
        if index < first:
            continue
        stage_run = run.stage(index, name)
        if index > first:
            jobs.append(helper_job(ctx, f"{name}.prepare", "prepare", index=index,
                                   after=after, stage=name))
            after = (jobs[-1].name,)
        roles = []
        mpi = stage.sync.method == "mpi" and stage.mode == "both"
        together = colocated(stage, "slurm")  # explorer 0 runs in the trainer's job
        if stage.mode in ("both", "explore") and stage.reward_job.count:
            roles.append(reward_job_array(ctx, stage_run, name, stage.reward_job, after=after,
                                          clients="trainer" if together else "explorer"))
        if stage.mode in ("both", "explore") and not together:
            roles.append(role_job(ctx, "explorer", stage_run, name, count=stage.explorer.count,
                                  threads=stage.explorer.threads, after=after, mpi=mpi,
                                  with_trainer=stage.mode == "both"))
        if stage.mode in ("both", "train"):
            roles.append(role_job(ctx, "trainer", stage_run, name,
                                  threads=stage.trainer.threads, after=after, mpi=mpi,
                                  colocated=together))
        if stage.mode == "bench":
            roles.append(bench_stage_job(ctx, stage_run, name, threads=stage.trainer.threads,
                                         after=after))
        jobs += roles
        after = tuple(job.name for job in roles)
        if stage.eval.evaluator and stage.mode in ("both", "train"):
            evaluator = role_job(ctx, "evaluator", stage_run, name,
                                 count=len(stage.eval.scored_versions(stage.trainer.steps)),
                                 threads=stage.trainer.threads, after=(f"{name}.trainer",))
            jobs.append(evaluator)
            evaluators.append(evaluator.name)
    jobs.append(helper_job(ctx, "finalize", "finalize", after=(*after, *evaluators)))
    return jobs


def prepare_first_stage(config: ExperimentConfig, run: RunDir, first: int) -> None:
    """Lay out stage `first` (idempotent), starting from the weights of the stages before."""
    results = [stage_result(run.stage(i, n))
               for i, (n, _) in enumerate(config.stage_configs()[:first])]
    name, stage = config.stage_configs()[first]
    prepare_stage(stage, run.stage(first, name).root, start_weights([r for r in results if r]))


def require_slurm() -> None:
    """Refuse, with a pointer to `rft-hpc run`, where Slurm's commands are missing."""
    missing = [c for c in ("sbatch", "squeue", "scancel", "srun") if shutil.which(c) is None]
    if missing:
        raise UserError(f"Slurm's {', '.join(missing)} not found on PATH: submit from a login "
                        "node of a Slurm cluster, or run the experiment on this machine with "
                        "`rft-hpc run CONFIG`")


def _check_pass_env(config: ExperimentConfig) -> None:
    slurm = config.launch.slurm
    settings = {f"launch.slurm.{role}": getattr(slurm, role)
                for role in ("explorer", "trainer", "evaluator", "helper")}
    settings["reward_job.slurm"] = config.reward_job.slurm
    for key, role_settings in settings.items():
        for var in role_settings.pass_env:
            if var not in os.environ:
                raise UserError(f"{key}.pass_env: {var} is not set in this "
                                "environment; export it before `rft-hpc submit`")


def check_resources(jobs: list[Job]) -> None:
    """`sbatch --test-only` every job's script; the first refusal becomes a `UserError`
    naming the setting Slurm objects to."""
    for job in jobs:
        result = subprocess.run(["sbatch", "--test-only"], input=job.script, text=True,
                                capture_output=True, timeout=120, check=False)
        if result.returncode != 0:
            message = "; ".join(line.removeprefix("sbatch: error: ").strip()
                                for line in result.stderr.splitlines() if line.strip())
            lower = message.lower()
            setting = next((f"{job.settings}.{s}" if "," not in s else
                            f"{job.settings} ({s})" for word, s in _HINTS if word in lower),
                           job.settings)
            raise UserError(f"{setting}: Slurm refuses job {job.name}: {message}. "
                            "Nothing was submitted.")


def _refuse_if_queued(run: RunDir) -> None:
    queued = queued_jobs(latest_job_ids(run))
    if queued:
        raise UserError(f"{run.root} has jobs in the queue ({', '.join(queued)}): see "
                        "`rft-hpc status`, or stop them with `rft-hpc cancel`")


def submissions(run: RunDir) -> list[dict[str, Any]]:
    """Every submission of the run recorded in `state/jobs.json`, oldest first."""
    path = run.jobs_record
    return read_json(path)["submissions"] if path.exists() else []


def latest_job_ids(run: RunDir) -> list[str]:
    """Slurm ids of every job of the run's latest submission (empty if never submitted)."""
    found = submissions(run)
    return [j["id"] for j in found[-1]["jobs"]] if found else []


def queued_jobs(ids: list[str]) -> list[str]:
    """The ids among `ids` that squeue still lists (arrays as their tasks, `12_0`)."""
    if not ids:
        return []
    result = subprocess.run(["squeue", "--noheader", "--array", "--format=%i",
                             f"--jobs={','.join(ids)}"],
                            capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0 and "Invalid job id" not in result.stderr:
        raise UserError(f"squeue failed: {result.stderr.strip()}")
    return result.stdout.split()


def submit_jobs(run: RunDir, jobs: list[Job], *, kept: list[dict[str, Any]] | None = None,
                auto_resume: bool = False, resumed: bool = False) -> dict[str, list[str]]:
    """Write each job's script and submit it after the jobs it needs, recording each id in
    `state/jobs.json` at once; on a failure, cancel those submitted and raise.

    `kept`: jobs of the previous submission still queued, part of this one (`resume`); a
    dependency on a job neither kept nor submitted here is taken as satisfied (its work is
    done).
    """
    path = run.jobs_record
    record = {"submissions": submissions(run)}
    entry: dict[str, Any] = {"time": time.time(), "auto_resume": auto_resume,
                             "resume": resumed, "jobs": [dict(j, kept=True) for j in kept or []]}
    record["submissions"].append(entry)
    ids: dict[str, list[str]] = {}
    for old in kept or []:
        ids.setdefault(old["name"], []).append(old["id"])
    new: list[str] = []
    for job in jobs:
        atomic_write_text(run.jobs / job.file_name, job.script)
        option = dependency_option(job, [i for a in job.after for i in ids.get(a, [])])
        try:
            job_id = sbatch_script(run.jobs / job.file_name, option)
        except UserError:
            if new:
                subprocess.run(["scancel", *new], capture_output=True, check=False)
            raise
        new.append(job_id)
        ids.setdefault(job.name, []).append(job_id)
        entry["jobs"].append({"name": job.name, "id": job_id, "role": job.role,
                              "stage": job.stage, "array": job.array, "after": list(job.after),
                              "logs": [str(p) for p in job.logs]})
        atomic_write_json(path, record)
    atomic_write_json(path, record)
    return ids


def sbatch_script(path: Path, dependency: str | None) -> str:
    """Submit the script at `path` with `sbatch --parsable` (after `dependency`, whose jobs'
    failure cancels it) through submitit's public `helpers.CommandFunction`; returns the job
    id, or raises `UserError` with sbatch's message.

    Not `SlurmExecutor.submit`: it would write its own batch file around a pickled function,
    hiding the role command, srun line and requeue trap of the script that `rft-hpc render`
    writes and the golden tests pin (docs/slurm-submission.md).
    """
    from submitit.core.utils import FailedJobError
    from submitit.helpers import CommandFunction

    args = ["--kill-on-invalid-dep=yes", f"--dependency={dependency}"] if dependency else []
    try:
        out = CommandFunction(["sbatch", "--parsable", *args, str(path)], verbose=False)()
    except FailedJobError as exc:
        raise UserError(f"sbatch refused {path.name}: {exc}") from None
    return out.strip().splitlines()[-1].split(";")[0]


def submitted_at(run: RunDir) -> float | None:
    """When the run was first submitted (its first `jobs.json` entry), if ever."""
    found = submissions(run)
    return found[0]["time"] if found else None
