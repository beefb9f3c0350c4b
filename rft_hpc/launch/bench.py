"""Bench plans as Slurm jobs: an evaluator array (one task per checkpoint x task set) and a
collect job after it, or one job for a stage in mode bench."""

from __future__ import annotations

from pathlib import Path

from rft_hpc.core.rundir import RunDir, read_json
from rft_hpc.eval.bench import PLAN_FILE, bench_config, task_count
from rft_hpc.launch.sbatch import ARRAY_INDEX, Job, JobContext, render_script
from rft_hpc.runtime.command import role_command


def submit_bench(folder: Path) -> dict[str, list[str]]:
    """Submit the plan as an evaluator array (`launch.slurm.evaluator`) and a collect job
    (`launch.slurm.helper`, afterok); returns the Slurm ids of both."""
    from rft_hpc.launch.submit import check_resources, require_slurm, submit_jobs

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
        job_name="bench", log=run.log("bench-%a"),
        command=role_command("bench", folder, ARRAY_INDEX, python=ctx.python(settings)),
        threads=plan["threads"], state=run.state, array=f"0-{count - 1}{par}",
        record="slurm-bench-$SLURM_ARRAY_TASK_ID")
    collect = render_script(
        ctx, helper, key="launch.slurm.helper", title="bench: collect results.json",
        job_name="bench-collect", log=run.log("bench-collect"),
        command=role_command("bench-collect", folder, python=ctx.python(helper)), threads=1)
    jobs = [Job("bench", "bench", "launch.slurm.evaluator", array, (), count, None,
                tuple(run.log(f"bench-{i}") for i in range(count))),
            Job("bench-collect", "bench-collect", "launch.slurm.helper", collect, ("bench",),
                None, None, (run.log("bench-collect"),))]
    check_resources(jobs)
    return submit_jobs(run, jobs)
