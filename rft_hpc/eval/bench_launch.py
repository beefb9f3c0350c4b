"""Running a bench plan: a Slurm array (one task per checkpoint x task set) and a collect
job after it, or the same role commands as local processes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from rft_hpc.errors import UserError
from rft_hpc.eval.bench import PLAN_FILE, bench_config, collect_bench, result_file, task_count
from rft_hpc.rundir import RunDir, read_json


def run_bench_local(folder: Path, *, parallel: int | None = None) -> dict[str, Any]:
    """Run the plan's unfinished bench tasks as local processes (`parallel` at a time),
    then collect; a failed task raises a `UserError` with the end of its log."""
    from rft_hpc.run.local import role_command, role_env

    plan = read_json(folder / PLAN_FILE)
    todo = [i for i in range(task_count(plan)) if not result_file(folder, plan, i).exists()]
    width = parallel or max(1, (os.cpu_count() or 1) // plan["threads"])
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ, **role_env(plan["threads"]))
    running: list[tuple[int, subprocess.Popen[bytes], Path]] = []
    while todo or running:
        while todo and len(running) < width:
            index = todo.pop(0)
            log = logs / f"bench-{index}.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(role_command("bench", folder, index), stdout=out,
                                        stderr=subprocess.STDOUT, env=env)
            running.append((index, proc, log))
        time.sleep(0.1)
        for entry in list(running):
            index, proc, log = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            if proc.returncode != 0:
                for _, other, _ in running:
                    other.kill()
                    other.wait()
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise UserError(f"bench task {index} failed (exit {proc.returncode}); its "
                                f"log is {log}:\n{tail}")
    return collect_bench(folder)


def submit_bench(folder: Path, overrides: list[str]) -> dict[str, list[str]]:
    """Submit the plan as an evaluator array (`launch.slurm.evaluator`) and a collect job
    (`launch.slurm.helper`, afterok); returns the Slurm ids of both."""
    from rft_hpc.launch.sbatch import ARRAY_INDEX, Job, JobContext, render_script
    from rft_hpc.launch.submit import check_resources, require_slurm, submit_jobs
    from rft_hpc.run.local import role_command

    require_slurm()
    plan = read_json(folder / PLAN_FILE)
    config = bench_config(Path(plan["target"]), overrides)
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
