"""Sbatch scripts of a run, rendered from the templates in `slurm/` (package `rft_hpc.slurm`).

Every job runs, under srun, the very role command that `rft-hpc run` starts as a local
process (`role_command`). The scripts hold no secrets: `pass_env` names travel by name
(`--export=ALL,NAME`), their values stay in the submitting environment. Dependencies are
not in the scripts: the submitter passes them on the sbatch command line, so that the same
script serves `rft-hpc submit`, `rft-hpc render` and `sbatch --test-only`.
"""

from __future__ import annotations

import shlex
import string
import sys
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

from rft_hpc.config.launch import LaunchConfig, SlurmRoleConfig
from rft_hpc.config.reward_job import RewardJobConfig
from rft_hpc.core.rundir import RunDir, read_json
from rft_hpc.runtime.command import role_command, role_env
from rft_hpc.runtime.lifecycle import REQUEUE_EXIT

ARRAY_INDEX = "$SLURM_ARRAY_TASK_ID"
"""Shell text of the array task's index: an explorer's `--index` in its array job."""


class _Template(string.Template):
    delimiter = "@"  # `$` is the shell's


def template(name: str) -> _Template:
    """A template of `slurm/` (`role.sbatch`, `submit.sh`), read from the installed package
    `rft_hpc.slurm` (setup.py maps the top-level folder to it; an editable install reads
    the folder itself)."""
    return _Template(files("rft_hpc.slurm").joinpath(name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Job:
    """One Slurm job of a run: its script and the jobs it waits for."""

    name: str
    """`<stage>.<role>` for a role's job, `<stage>.prepare` or `finalize` for a helper."""
    role: str
    settings: str
    """Config key of its Slurm settings (`launch.slurm.trainer`), for messages."""
    script: str
    after: tuple[str, ...] = ()
    array: int | None = None
    stage: str | None = None
    logs: tuple[Path, ...] = ()
    dependency: str = "afterok"
    """How it waits for the jobs in `after`: `afterok` (they succeeded), or `afternotok`
    for a watcher (one of them failed)."""

    @property
    def file_name(self) -> str:
        """Name of its script file."""
        return f"{self.name}.sbatch"


@dataclass(frozen=True)
class JobContext:
    """What every script of one run shares."""

    run: RunDir
    launch: LaunchConfig
    cwd: Path
    source: str
    """The config file the run came from (shown in the scripts)."""

    def python(self, settings: SlurmRoleConfig) -> str:
        """The interpreter a job with these settings runs rft-hpc with."""
        return self.launch.python or ("python3" if settings.container else sys.executable)


def sbatch_options(settings: SlurmRoleConfig, *, job_name: str, output: Path, cwd: Path,
                   signal_delay: int, array: str | None = None) -> list[str]:
    """The `#SBATCH` options of a job, in a fixed order."""
    opts = [f"--job-name={job_name}", f"--output={output}", "--open-mode=append",
            f"--chdir={cwd}", f"--signal=USR2@{signal_delay}"]
    for key, option in (("partition", "partition"), ("account", "account"), ("qos", "qos")):
        if getattr(settings, key) is not None:
            opts.append(f"--{option}={getattr(settings, key)}")
    opts += [f"--nodes={settings.nodes}", f"--ntasks-per-node={settings.tasks_per_node}"]
    if settings.gpus_per_node:
        opts.append(f"--gpus-per-node={settings.gpus_per_node}")
    for key, option in (("cpus_per_task", "cpus-per-task"), ("mem", "mem"), ("time", "time"),
                        ("constraint", "constraint")):
        if getattr(settings, key) is not None:
            opts.append(f"--{option}={getattr(settings, key)}")
    if settings.exclusive:
        opts.append("--exclusive")
    if array is not None:
        opts.append(f"--array={array}")
    if settings.pass_env:
        opts.append(f"--export=ALL,{','.join(settings.pass_env)}")
    opts += [f"--{key}={value}" if value else f"--{key}" for key, value in settings.extra.items()]
    return opts


def container_prefix(settings: SlurmRoleConfig, run: RunDir) -> list[str]:
    """`apptainer exec ... IMAGE` (empty without a container): what wraps the role command."""
    box = settings.container
    if box is None:
        return []
    binds = [str(run.root), *box.binds]
    gpu = ["--nv"] if settings.gpus_per_node else []
    return [box.runtime, "exec", *gpu, *box.options, "--bind", ",".join(binds), box.image]


def shell_command(argv: list[str]) -> str:
    """`argv` as shell text; `ARRAY_INDEX` stays a variable the shell expands."""
    return " ".join(f'"{ARRAY_INDEX}"' if a == ARRAY_INDEX else shlex.quote(a) for a in argv)


def render_script(ctx: JobContext, settings: SlurmRoleConfig, *, key: str, title: str,
                  job_name: str, log: Path, command: list[str], threads: int | None,
                  state: Path | None = None,
                  env: dict[str, str] | None = None, array: str | None = None,
                  record: str | None = None, srun_options: tuple[str, ...] = (),
                  requeue_needs: str | None = None) -> str:
    """The sbatch script of one job (its settings at config key `key`): options, umask,
    setup, environment, then srun of `command` (in the container, if any).

    `env` values are shell text inside double quotes (they may use `$state`, the stage's
    state folder, and Slurm's variables); `record` names the file in `$state` where a role's
    job leaves its start, end and exit status; such a role's job requeues itself when the
    role asks for it (or crashed, up to `launch.slurm.max_restarts`), but not while no job
    named `requeue_needs` is queued or running.
    """
    options = sbatch_options(settings, job_name=f"{ctx.run.root.name}.{job_name}", output=log,
                             cwd=ctx.cwd, signal_delay=ctx.launch.slurm.signal_delay,
                             array=array)
    if record is not None and "--requeue" not in options:  # a user's extra may have it
        options.append("--requeue")  # the script requeues itself (see _REQUEUE)
    preamble = [f"umask {ctx.launch.umask}"] if ctx.launch.umask else []
    if settings.setup:
        preamble += ["", f"# setup ({key}.setup)", *settings.setup]
    exports = {**role_env(threads), **settings.env}
    preamble += ["", "# environment"]
    if state is not None:
        preamble.append(f"state={shlex.quote(str(state))}")
    preamble += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    preamble += [f'export {k}="{v}"' for k, v in (env or {}).items()]
    srun = ["--kill-on-bad-exit=1"] if settings.tasks() > 1 else []
    srun += srun_options
    if settings.cpus_per_task:
        srun.append(f"--cpus-per-task={settings.cpus_per_task}")
    epilogue = ""
    if record is not None:
        epilogue = (f"printf '{{\"job\": \"%s\", \"start\": %s, \"end\": %s, "
                    f"\"status\": %s}}\\n' "
                    f'"$job" "$started" "$(date +%s.%N)" "$status" '
                    f'>"$state/.tmp-{record}.json"\n'
                    f'mv "$state/.tmp-{record}.json" "$state/{record}.json"\n')
    requeue = ""
    if record is not None:  # a role: it saved and asked for it (75), or its process died
        needs = _REQUEUE_NEEDS.format(job=shlex.quote(requeue_needs)) if requeue_needs else ""
        requeue = _REQUEUE.format(exit=REQUEUE_EXIT, limit=ctx.launch.slurm.max_restarts,
                                  needs=needs)
    return template("role.sbatch").substitute(
        sbatch="\n".join(f"#SBATCH {o}" for o in options), title=_one_line(title),
        config=_one_line(ctx.source), preamble="\n".join(preamble), what=shlex.quote(title),
        srun=shell_command([*srun, *container_prefix(settings, ctx.run), *command]),
        epilogue=epilogue, requeue=requeue)


_REQUEUE = """\
requeue=
if [ "$status" -eq {exit} ]; then
    requeue=yes
elif [ "$status" -gt 128 ]; then  # killed: counts against launch.slurm.max_restarts
    crashes=$(( $(cat "$state/.crashes-$job" 2>/dev/null || echo 0) + 1 ))
    echo "$crashes" >"$state/.crashes-$job"
    if [ "$crashes" -le {limit} ]; then
        requeue=yes
    fi
fi
{needs}if [ -n "$requeue" ]; then
    echo "rft-hpc: $what: requeueing job $job (restart $((${{SLURM_RESTART_COUNT:-0}} + 1)))"
    scontrol requeue "$job"
    exit 0
fi
"""

# Explorers whose trainer's job is gone (cancelled, or crashed past max_restarts) would wait
# for weights until their time limit and requeue themselves forever; `rft-hpc resume` (or
# the --auto-resume watcher) brings back both. A failing squeue leaves the requeue as it is.
_REQUEUE_NEEDS = """\
if [ -n "$requeue" ] && queued=$(squeue --me --noheader --format=%i --name={job}) \\
        && [ -z "$queued" ]; then
    echo "rft-hpc: $what: not requeued: no job {job} is queued or running to use its" \\
         "work; rft-hpc resume brings both back"
    requeue=
fi
"""


def role_job(ctx: JobContext, role: str, stage_run: RunDir, stage: str, *, threads: int | None,
             count: int = 1, after: tuple[str, ...] = (), mpi: bool = False,
             with_trainer: bool = False, colocated: bool = False) -> Job:
    """The explorer array, the evaluator array (`count` tasks each) or the trainer job of
    one stage; an explorer array `with_trainer` requeues itself only while the stage's
    trainer job is queued or running. A `colocated` trainer job runs explorer 0 in its
    process too (`rft-hpc role colocated`, launch.colocate), with the trainer's settings."""
    slurm = ctx.launch.slurm
    settings: SlurmRoleConfig = getattr(slurm, role)
    # sync.method mpi: each role an MPI program that joins the others by connect/accept
    srun_options = (f"--mpi={slurm.mpi}",) if mpi else ()
    name, key = f"{stage}.{role}", f"launch.slurm.{role}"
    if role in _ARRAY_TITLES:
        par = f"%{settings.array_parallelism}" if settings.array_parallelism else ""
        script = render_script(
            ctx, settings, key=key, title=_ARRAY_TITLES[role].format(stage=stage),
            job_name=name, log=stage_run.log(f"{role}-%a"),
            command=role_command(role, stage_run.root, ARRAY_INDEX,
                                 python=ctx.python(settings)),
            threads=threads, state=stage_run.state, array=f"0-{count - 1}{par}",
            record=f"slurm-{role}-$SLURM_ARRAY_TASK_ID", srun_options=srun_options,
            requeue_needs=f"{ctx.run.root.name}.{stage}.trainer" if with_trainer else None)
        logs = tuple(stage_run.log(f"{role}-{i}") for i in range(count))
        return Job(name, role, key, script, after, count, stage, logs)
    # Ranks meet through a file store on the run directory (no MASTER_ADDR to resolve).
    dist = {"RFT_DIST_INIT_FILE": "$state/dist-$SLURM_JOB_ID"}
    command = "colocated" if colocated else "trainer"
    title = (f"trainer and explorer 0 of stage {stage}, colocated" if colocated
             else f"trainer of stage {stage}, {_count(settings.tasks(), 'rank')}")
    script = render_script(
        ctx, settings, key=key, title=title, job_name=name, log=stage_run.log(command),
        command=role_command(command, stage_run.root, python=ctx.python(settings)),
        threads=threads, state=stage_run.state, env=dist, record="slurm-trainer",
        srun_options=srun_options)
    return Job(name, role, key, script, after, None, stage, (stage_run.log(command),))


def reward_job_array(ctx: JobContext, stage_run: RunDir, stage: str,
                     reward_job: RewardJobConfig, *, after: tuple[str, ...],
                     clients: str = "explorer") -> Job:
    """The reward job array of one stage (`reward_job.count` tasks, `reward_job.slurm`
    settings, docs/reward-job.md): it requeues itself like the other roles (its warning
    signal, its time limit, a killed process), but only while the stage's explorer array is
    queued or running (its only clients; `clients` names their job: `trainer` when the
    explorer is colocated in it)."""
    settings = reward_job.slurm
    name, key = f"{stage}.reward", "reward_job.slurm"
    par = f"%{settings.array_parallelism}" if settings.array_parallelism else ""
    script = render_script(
        ctx, settings, key=key,
        title=f"reward jobs of stage {stage} (array task = reward job index)",
        job_name=name, log=stage_run.log("reward-%a"),
        command=role_command("reward", stage_run.root, ARRAY_INDEX,
                             python=ctx.python(settings)),
        threads=None, state=stage_run.state, array=f"0-{reward_job.count - 1}{par}",
        record="slurm-reward-$SLURM_ARRAY_TASK_ID",
        requeue_needs=f"{ctx.run.root.name}.{stage}.{clients}")
    logs = tuple(stage_run.log(f"reward-{j}") for j in range(reward_job.count))
    return Job(name, "reward", key, script, after, reward_job.count, stage, logs)


def bench_stage_job(ctx: JobContext, stage_run: RunDir, stage: str, *, threads: int | None,
                    after: tuple[str, ...]) -> Job:
    """The job of a stage in mode bench (`launch.slurm.evaluator` settings): one job, as the
    checkpoints to score exist only once the stages before have run; its bench tasks run
    as processes inside it."""
    settings = ctx.launch.slurm.evaluator
    log = stage_run.log("bench")
    script = render_script(
        ctx, settings, key="launch.slurm.evaluator",
        title=f"bench of stage {stage}: every checkpoint of the stages before",
        job_name=f"{stage}.bench", log=log,
        command=role_command("bench-stage", stage_run.root, python=ctx.python(settings)),
        threads=threads, state=stage_run.state, record="slurm-bench")
    return Job(f"{stage}.bench", "bench", "launch.slurm.evaluator", script, after, None, stage,
               (log,))


_ARRAY_TITLES = {
    "explorer": "explorers of stage {stage} (array task = explorer index)",
    "evaluator": "evaluator of stage {stage} (array task = index of the weights version "
                 "scored, see eval.every)",
}


def helper_job(ctx: JobContext, name: str, role: str, *, index: int | None = None,
               after: tuple[str, ...] = (), stage: str | None = None) -> Job:
    """A small job of the launcher's own: prepare stage `index`, or finalize the run."""
    settings = ctx.launch.slurm.helper_settings()
    log = ctx.run.log(name)
    title = (f"prepare stage {stage} after the one before" if role == "prepare"
             else "finalize the run: summary.json and report.png")
    script = render_script(ctx, settings, key="launch.slurm.helper", title=title,
                           job_name=name, log=log,
                           command=role_command(role, ctx.run.root, index,
                                                python=ctx.python(settings)),
                           threads=1)
    return Job(name, role, "launch.slurm.helper", script, after, None, stage, (log,))


def watch_job(ctx: JobContext, watched: Job) -> Job:
    """The watcher of a role's job (`submit --auto-resume`): if that job fails, it runs
    `rft-hpc resume` on the run; if the job succeeds, Slurm drops it unrun. (Not `singleton`:
    that would hold a failed job's watcher behind the pending watchers of running jobs;
    `resume` takes a lock on the run instead.)"""
    settings = ctx.launch.slurm.helper_settings()
    name = f"{watched.name}.watch"
    log = ctx.run.log("watch")
    script = render_script(ctx, settings, key="launch.slurm.helper",
                           title=f"resume the run if {watched.name} fails", job_name="watch",
                           log=log, command=role_command("resume", ctx.run.root,
                                                         python=ctx.python(settings)),
                           threads=1)
    return Job(name, "watch", "launch.slurm.helper", script, (watched.name,), None,
               watched.stage, (log,), dependency="afternotok")


def dependency_option(job: Job, ids: list[str]) -> str | None:
    """The `--dependency=` value of `job` waiting for the Slurm jobs `ids`."""
    return f"{job.dependency}:{':'.join(ids)}" if ids else None


def with_array_tasks(job: Job, indices: list[int]) -> Job:
    """`job` (an array) running only the array tasks `indices`."""
    lines = job.script.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("#SBATCH --array="):
            limit = line.partition("%")[2]
            lines[i] = f"#SBATCH --array={','.join(map(str, indices))}" + (
                f"%{limit}" if limit else "")
    return replace(job, script="\n".join(lines))


def submit_script(jobs: list[Job], run_name: str, source: str) -> str:
    """`submit.sh` for `rft-hpc render`: sbatch of every job in order, with dependencies."""
    lines, ids = [], {}
    for number, job in enumerate(jobs):
        var = f"job{number}"
        option = dependency_option(job, [f"${{{ids[a]}%%;*}}" for a in job.after])
        dep = f"--kill-on-invalid-dep=yes --dependency={option} " if option else ""
        lines += [f"{var}=$(sbatch --parsable {dep}{shlex.quote(job.file_name)})",
                  f'echo {shlex.quote(job.name + ":")} "${{{var}%%;*}}"']
        ids[job.name] = var
    return template("submit.sh").substitute(run=run_name, config=_one_line(source),
                                            submissions="\n".join(lines))


def stage_job_seconds(stage_run: RunDir) -> float:
    """How long a stage's role jobs took: the longest of them (each timed on its own node)."""
    spans = [read_json(p) for p in stage_run.state.glob("slurm-*.json")
             if not p.name.startswith("slurm-evaluator-")]  # evaluators run after the stage
    return max((float(s["end"]) - float(s["start"]) for s in spans), default=0.0)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
