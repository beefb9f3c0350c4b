"""`rft-hpc submit | render | resume | cancel | logs`: an experiment as Slurm jobs (`status`:
status_cmd)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from rft_hpc.core.console import console

if TYPE_CHECKING:
    from rft_hpc.launch.submit import SubmitResult

_SET = typer.Option([], "--set", help="Override a key: --set trainer.lr=1e-5.")
_NAME = typer.Option(None, "--name", help="Run name (sets run.name).")


def submit(
    config: Path = typer.Argument(..., help="Experiment config (YAML)."),
    set_: list[str] = _SET,
    name: str | None = _NAME,
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print the sbatch scripts; create and submit nothing."),
    auto_resume: bool = typer.Option(False, "--auto-resume", help="If a role's job fails, "
                                     "a watcher job runs `rft-hpc resume` (up to "
                                     "launch.max_resubmits times)."),
) -> None:
    """Submit an experiment as Slurm jobs (resumes a run submitted before with this config)."""
    from rft_hpc.launch.submit import submit_run

    result = submit_run(config, set_, name=name, dry_run=dry_run, auto_resume=auto_resume)
    if result.finished:
        console.print(f"{result.root} has finished: nothing to submit "
                      f"(summary: {result.root / 'summary.json'})")
        return
    if dry_run:
        for job in result.jobs:
            after = f" (after {', '.join(job.after)})" if job.after else ""
            console.print(f"# ---- {job.file_name}{after}", markup=False)
            console.print(job.script, markup=False)
        console.print(f"dry run: {len(result.jobs)} job(s) for {result.root}; nothing was "
                      "submitted")
        return
    console.print(submitted_table(result, "submitted"))
    console.print(f"run directory: {result.root}   watch: rft-hpc status {result.root}")


def submitted_table(result: SubmitResult, what: str) -> Table:
    """One row per job submitted: name, Slurm id, the jobs it waits for, its script."""
    table = Table(title=f"run {result.root.name}: {what}")
    for col in ("job", "slurm id", "waits for", "script"):
        table.add_column(col)
    for job in result.jobs:
        waits = ", ".join(job.after) or "-"
        if job.dependency != "afterok":
            waits = f"{job.dependency} {waits}"
        table.add_row(job.name, ", ".join(result.ids.get(job.name, [])), waits, job.file_name)
    return table


def resume(
    run: Path = typer.Argument(..., help="Run directory."),
) -> None:
    """Resubmit the jobs of a run that failed, were cancelled or died with a node; they
    continue from their checkpoints. Jobs still queued are kept."""
    from rft_hpc.launch.resume import resume_run

    result = resume_run(run)
    if result.finished:
        console.print(f"{result.root} has finished: nothing to resume")
    elif not result.jobs:
        console.print(f"{result.root}: every unfinished job is still queued; nothing to resume")
    else:
        console.print(submitted_table(result, "resubmitted"))


def render(
    config: Path = typer.Argument(..., help="Experiment config (YAML)."),
    out: Path = typer.Option(..., "--out", help="Folder for the scripts and submit.sh."),
    set_: list[str] = _SET,
    name: str | None = _NAME,
) -> None:
    """Write standalone sbatch scripts and a submit.sh for submitting by hand."""
    from rft_hpc.launch.submit import render_run

    result = render_run(config, out, set_, name=name)
    if result.finished:
        console.print(f"{result.root} has finished: nothing to render")
        return
    for job in result.jobs:
        console.print(str(out / job.file_name))
    console.print(f"submit them with: bash {out / 'submit.sh'}   (run directory: {result.root})")


def cancel(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Cancel every job of a submitted run and wait until none is left in the queue."""
    from rft_hpc.launch.status import cancel_run

    cancelled = cancel_run(run)
    console.print(f"cancelled {len(cancelled)} queued job(s)/task(s): "
                  f"{', '.join(cancelled) or 'none was queued'}")


def logs(
    run: Path = typer.Argument(..., help="Run directory."),
    role: str | None = typer.Argument(None, help="trainer, explorer, explorer-<i>, finalize, "
                                                 "<stage>.prepare; all when left out."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output."),
) -> None:
    """Print the logs of a run's roles and jobs (local runs too)."""
    from rft_hpc.launch.status import log_files, show_logs

    show_logs(log_files(run, role), follow=follow)  # --follow ends with Ctrl-C
