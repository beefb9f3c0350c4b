"""Running a bench plan: a Slurm array (one task per checkpoint x task set) and a collect
job after it, or the same role commands as local processes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rft_hpc.errors import UserError
from rft_hpc.eval.bench import PLAN_FILE, bench_config, collect_bench, result_file, task_count
from rft_hpc.rundir import RunDir, read_json

if TYPE_CHECKING:
    from rft_hpc.launch.sbatch import Job, JobContext


def run_bench_local(folder: Path, *, parallel: int | None = None) -> dict[str, Any]:
    """Run the plan's unfinished bench tasks in `parallel` local processes (each takes every
    `parallel`-th task: one interpreter start per process, not per task), then collect; a
    failed process raises a `UserError` with the end of its log."""
    from rft_hpc.run.local import role_command, role_env

    plan = read_json(folder / PLAN_FILE)
    todo = [i for i in range(task_count(plan)) if not result_file(folder, plan, i).exists()]
    width = min(len(todo), parallel or max(1, (os.cpu_count() or 1) // plan["threads"]))
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ, **role_env(plan["threads"]))
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for worker in range(width):
        log = logs / f"bench-local-{worker}.log"
        indices = ",".join(map(str, todo[worker::width]))
        with log.open("ab") as out:
            procs.append((subprocess.Popen(role_command("bench", folder, indices), stdout=out,
                                           stderr=subprocess.STDOUT, env=env), log))
    while any(p.poll() is None for p, _ in procs):
        failed = [(p, log) for p, log in procs if p.returncode not in (None, 0)]
        if failed:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.1)
    for p, log in procs:
        if p.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise UserError(f"a bench process failed (exit {p.returncode}); its log is "
                            f"{log}:\n{tail}")
    return collect_bench(folder)


def submit_bench(folder: Path) -> dict[str, list[str]]:
    """Submit the plan as an evaluator array (`launch.slurm.evaluator`) and a collect job
    (`launch.slurm.helper`, afterok); returns the Slurm ids of both."""
    from rft_hpc.launch.sbatch import ARRAY_INDEX, Job, JobContext, render_script
    from rft_hpc.launch.submit import check_resources, require_slurm, submit_jobs
    from rft_hpc.run.local import role_command

    require_slurm()
    plan = read_json(folder / PLAN_FILE)
    config = bench_config(Path(plan["target"]), plan["overrides"])
    run = RunDir(folder)
    for sub in (run.state, run.jobs):
        sub.mkdir(parents=True, exist_ok=True)
    ctx = JobContext(run, config.launch, Path.cwd().resolve(), plan["target"])
    slurm = config.launch.slurm
    settings, helper = slurm.evaluator, slurm.helper_settings()
    count = task_count(plan)
    par = f"%{settings.array_parallelism}" if settings.array_parallelism else ""
    array = render_script(
        ctx, settings, key="launch.slurm.evaluator",
        title="bench: score one checkpoint on one task set (array task = pair index)",
        job_name="bench", log=run.jobs / "bench-%a.log",
        command=role_command("bench", folder, ARRAY_INDEX, python=ctx.python(settings)),
        threads=plan["threads"], state=run.state, array=f"0-{count - 1}{par}",
        record="slurm-bench-$SLURM_ARRAY_TASK_ID")
    collect = render_script(
        ctx, helper, key="launch.slurm.helper", title="bench: collect results.json",
        job_name="bench-collect", log=run.jobs / "bench-collect.log",
        command=role_command("bench-collect", folder, python=ctx.python(helper)), threads=1)
    jobs = [Job("bench", "bench", "launch.slurm.evaluator", array, (), count, None,
                tuple(run.jobs / f"bench-{i}.log" for i in range(count))),
            Job("bench-collect", "bench-collect", "launch.slurm.helper", collect, ("bench",),
                None, None, (run.jobs / "bench-collect.log",))]
    check_resources(jobs)
    return submit_jobs(run, jobs)


def bench_stage_job(ctx: JobContext, stage_run: RunDir, stage: str, *, threads: int,
                    after: tuple[str, ...]) -> Job:
    """The job of a stage in mode bench (`launch.slurm.evaluator` settings): one job, as the
    checkpoints to score exist only once the stages before have run; its bench tasks run
    as processes inside it."""
    from rft_hpc.launch.sbatch import Job, render_script
    from rft_hpc.run.local import role_command

    settings = ctx.launch.slurm.evaluator
    log = stage_run.jobs / "bench.log"
    script = render_script(
        ctx, settings, key="launch.slurm.evaluator",
        title=f"bench of stage {stage}: every checkpoint of the stages before",
        job_name=f"{stage}.bench", log=log,
        command=role_command("bench-stage", stage_run.root, python=ctx.python(settings)),
        threads=threads, state=stage_run.state, record="slurm-bench")
    return Job(f"{stage}.bench", "bench", "launch.slurm.evaluator", script, after, None, stage,
               (log,))
