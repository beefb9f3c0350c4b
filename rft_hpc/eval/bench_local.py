"""Running a bench plan's tasks as local processes (the Slurm array is `rft_hpc.launch.bench`)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rft_hpc.config import load_config
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, read_json
from rft_hpc.eval.bench import (
    PLAN_FILE,
    bench_line,
    collect_bench,
    plan_bench,
    result_file,
    task_count,
)
from rft_hpc.runtime.command import role_command, role_env
from rft_hpc.runtime.common import write_heartbeat
from rft_hpc.runtime.logs import setup_logging
from rft_hpc.runtime.placement import available_cores

logger = logging.getLogger(__name__)


def run_bench_local(folder: Path, *, parallel: int | None = None,
                    on_result: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the plan's unfinished bench tasks in `parallel` local processes (each takes every
    `parallel`-th task: one interpreter start per process, not per task), then collect; a
    failed process raises a `UserError` with the end of its log. `on_result(i)` is called
    once for each task `i` whose result appears while they run."""
    plan = read_json(folder / PLAN_FILE)
    todo = [i for i in range(task_count(plan)) if not result_file(folder, plan, i).exists()]
    waiting = list(todo)

    def notice() -> None:
        for i in [i for i in waiting if result_file(folder, plan, i).exists()]:
            waiting.remove(i)
            if on_result is not None:
                on_result(i)

    width = min(len(todo), parallel or max(1, available_cores() // (plan["threads"] or 1)))
    threads = plan["threads"] or max(1, available_cores() // width)  # the cores shared out
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ, **role_env(threads, shared=True))
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
        notice()
        time.sleep(0.1)
    notice()
    for p, log in procs:
        if p.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise UserError(f"a bench process failed (exit {p.returncode}); its log is "
                            f"{log}:\n{tail}")
    return collect_bench(folder)


def run_bench_stage(stage: Path) -> dict[str, Any]:
    """A stage in mode bench: score the base model and every checkpoint of the run's stages
    before it on the stage's eval split, k = n = `explorer.repeat`, into `<stage>/bench`.
    Its heartbeat (role `bench`) and log count the scored tasks as its steps."""
    setup_logging("bench")
    config = load_config(RunDir(stage).config)
    folder = RunDir(stage).bench
    if not (folder / PLAN_FILE).exists():  # a restarted stage keeps its plan and results
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"start_weights": None})})
        plan_bench(stage.parents[1], ["eval"], stage, k=config.explorer.repeat, n=None,
                   config=config)
    plan, run = read_json(folder / PLAN_FILE), RunDir(stage)
    total, started = task_count(plan), time.time()
    first = sum(result_file(folder, plan, i).exists() for i in range(total))
    done = [first]

    def beat() -> None:
        write_heartbeat(run, "bench", status="done" if done[0] == total else "running",
                        step=done[0], total=total, started=started, start_step=first)

    def scored(index: int) -> None:
        done[0] += 1
        beat()
        logger.info(bench_line(read_json(result_file(folder, plan, index)), done[0], total))

    beat()
    return run_bench_local(folder, on_result=scored)
