"""`rft-hpc eval`: bench mode, the base model and every checkpoint scored on task sets."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from rft_hpc.core.console import console


def eval_(
    target: Path = typer.Argument(..., help="Run directory, or a folder of checkpoints "
                                  "(model folders, weights/v<N>, trainer step-<N>)."),
    tasks: list[str] = typer.Option([], "--tasks", help="Task set: eval (the config's eval "
                                    "split, the default), arithmetic:digits=D[,ops=OPS]"
                                    "[,size=N] or a .jsonl file; repeatable."),
    k: int = typer.Option(4, "--k", help="k of mean@k and pass@k."),
    n: int | None = typer.Option(None, "--n", help="Samples per task (default k)."),
    local: bool = typer.Option(False, "--local", help="Run as local processes, not Slurm "
                               "jobs (the default where Slurm is not on PATH)."),
    out: Path | None = typer.Option(None, "--out", help="Results go to OUT/bench "
                                    "(default: TARGET/bench)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key of the run's config "
                                   "(or of the defaults): --set eval.max_new_tokens=8."),
) -> None:
    """Score the base model and every checkpoint on task sets: greedy accuracy, mean@k,
    pass@k (a Slurm array with one task per checkpoint x task set, or local processes)."""
    from rft_hpc.eval.bench import bench_config, plan_bench, task_count
    from rft_hpc.eval.bench_local import run_bench_local
    from rft_hpc.launch.bench import submit_bench

    plan = plan_bench(target, tasks, out or target, k=k, n=n,
                      config=bench_config(target, set_), overrides=set_)
    folder = (out or target).resolve() / "bench"
    console.print(f"bench: {len(plan['checkpoints'])} checkpoint(s) x "
                  f"{len(plan['tasksets'])} task set(s) = {task_count(plan)} task(s)")
    if local or shutil.which("sbatch") is None:
        results = run_bench_local(folder)
        console.print(bench_table(results))
        console.print(f"results: {folder / 'results.json'}")
        return
    ids = submit_bench(folder)
    console.print(f"submitted: array {', '.join(ids['bench'])}, collect "
                  f"{', '.join(ids['bench-collect'])}; results: {folder / 'results.json'} "
                  f"(table in {folder / 'jobs' / 'bench-collect.log'})")


def bench_table(results: dict[str, Any]) -> Table:
    """One row per checkpoint and task set: greedy accuracy, mean@k, pass@1, pass@k."""
    k = results["k"]
    table = Table(title=f"bench of {Path(results['target']).name} "
                  f"(n={results['n']} samples per task)")
    columns = ("greedy_accuracy", f"mean@{k}", "pass@1", f"pass@{k}")
    for col in ("checkpoint", "task set", "tasks", "greedy acc", f"mean@{k}", "pass@1",
                f"pass@{k}"):
        table.add_column(col, justify="left" if col in ("checkpoint", "task set") else "right")
    for r in results["results"]:
        table.add_row(r["checkpoint"], r["taskset"], str(r["tasks"]),
                      *(f"{r[c]:.3f}" for c in columns))
    return table


def role_bench(
    folder: Path = typer.Argument(..., help="Bench folder (with plan.json)."),
    index: str = typer.Option("0", "--index", help="Pair index (Slurm array task id), or "
                              "several, comma-separated."),
) -> None:
    """Score checkpoint x task set INDEX of a bench plan."""
    from rft_hpc.eval.bench import run_bench_task

    for i in index.split(","):
        r = run_bench_task(folder, int(i))
        key = f"pass@{r['k']}"
        console.print(f"{r['checkpoint']} on {r['taskset']}: greedy "
                      f"{r['greedy_accuracy']:.3f}, {key} {r[key]:.3f}")


def role_bench_collect(
    folder: Path = typer.Argument(..., help="Bench folder (with plan.json)."),
) -> None:
    """Gather a bench's results into results.json and print the table."""
    from rft_hpc.eval.bench import collect_bench

    console.print(bench_table(collect_bench(folder)))


def role_bench_stage(
    stage: Path = typer.Argument(..., help="Stage directory (mode bench)."),
) -> None:
    """Run a stage in mode bench: score every checkpoint of the stages before it."""
    from rft_hpc.eval.bench_local import run_bench_stage

    console.print(bench_table(run_bench_stage(stage.resolve())))
