"""`rft-hpc run`, `rft-hpc model init` and the role entry points that launchers start."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rft_hpc.core.console import console
from rft_hpc.core.errors import UserError
from rft_hpc.core.process_name import name_process
from rft_hpc.runtime.signals import ignore_warning_signal


def run(
    config: Path = typer.Argument(..., help="Experiment config (YAML)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set trainer.lr=1e-5."),
) -> None:
    """Run an experiment on this machine, every role a local process (resumes if re-run)."""
    from rft_hpc.run.local import run_local

    result = run_local(config, set_)
    console.print(stage_table(result.summary))
    ev = result.summary["eval"]
    console.print(f"held-out accuracy: start of RL {_pct(ev['initial_accuracy'])} -> end "
                  f"{_pct(ev['final_accuracy'])} (base model {_pct(ev['base_accuracy'])})")
    console.print(f"summary: {result.root / 'summary.json'}   report: "
                  f"{result.root / 'report.png'}")


def stage_table(summary: dict) -> Table:
    """One row per stage: mode, steps, seconds, held-out accuracy before and after."""
    table = Table(title=f"run {summary['run']}")
    for col in ("stage", "mode", "trainer steps", "explorer steps", "seconds", "eval start",
                "eval end"):
        table.add_column(col, justify="left" if col in ("stage", "mode") else "right")
    for s in summary["stages"]:
        table.add_row(s["name"], s["mode"], str(s["trainer_steps"]), str(s["explorer_steps"]),
                      f"{s['seconds']:.1f}", _pct(s["eval_initial"]), _pct(s["eval_final"]))
    return table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


model_app = typer.Typer(help="Build models locally.", no_args_is_help=True)


@model_app.command("init")
def model_init(
    kind: str = typer.Argument(..., help="Which model to build: tiny."),
    out: Path = typer.Option(..., "--out", help="Folder to write the model to."),
    arch: str = typer.Option("llama", "--arch", help="Model family: llama, qwen2, qwen3 or "
                             "mistral (all but llama are chat models)."),
    chat: bool = typer.Option(False, "--chat", help="llama: the chat model (Llama 3 chat "
                              "template, byte-level tokenizer) in place of the "
                              "character-level arithmetic one."),
) -> None:
    """Build a model folder locally (tiny: ~1M parameters; the default is the demo's Llama
    with a character tokenizer, --arch qwen2|qwen3|mistral or --chat a chat model with its
    family's special tokens and chat template)."""
    from rft_hpc.models.tiny import ARCHS, TinyModelSpec, init_tiny_model, is_chat

    if kind != "tiny":
        raise UserError(f"unknown model {kind!r}: only 'tiny' can be built")
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty")
    spec = TinyModelSpec(arch=arch, chat=chat)  # type: ignore[arg-type]
    init_tiny_model(out, spec)
    what = f"tiny {arch} chat model" if is_chat(spec) else "tiny model"
    console.print(f"{what} written to {out}")


role_app = typer.Typer(help="Role entry points (started by `run` and by Slurm jobs).",
                       no_args_is_help=True)


@role_app.command("explorer")
def role_explorer(  # stage: not checked here, the role reads it with retries
    stage: Path = typer.Argument(..., help="Stage directory.", readable=False),
    index: int = typer.Option(0, "--index", help="Explorer index (Slurm array task id)."),
) -> None:
    """Run explorer INDEX of a stage directory."""
    from rft_hpc.explorer.role import run_explorer

    try:
        name_process(f"explorer-{index}")
        run_explorer(stage, index)
    finally:
        ignore_warning_signal()


@role_app.command("reward")
def role_reward(
    stage: Path = typer.Argument(..., help="Stage directory.", readable=False),
    index: int = typer.Option(0, "--index", help="Reward job index (Slurm array task id)."),
) -> None:
    """Run reward job INDEX of a stage directory (docs/reward-job.md)."""
    from rft_hpc.reward_job.role import run_reward_job

    try:
        name_process(f"reward-{index}")
        run_reward_job(stage, index)
    finally:
        ignore_warning_signal()


@role_app.command("trainer")
def role_trainer(stage: Path = typer.Argument(..., help="Stage directory.",
                                              readable=False)) -> None:
    """Run the trainer of a stage directory."""
    from rft_hpc.runtime.exit import leave_process
    from rft_hpc.trainer.role import run_trainer

    try:
        name_process("trainer")
        run_trainer(stage)
    finally:
        ignore_warning_signal()
    leave_process(0)  # not through the process group's teardown (rft_hpc/runtime/exit.py)


@role_app.command("colocated")
def role_colocated(stage: Path = typer.Argument(..., help="Stage directory.",
                                                readable=False)) -> None:
    """Run a stage's trainer and explorer 0 in one process (launch.colocate)."""
    from rft_hpc.colocate.role import run_colocated
    from rft_hpc.runtime.exit import leave_process

    try:
        name_process("colocated")
        run_colocated(stage)
    finally:
        ignore_warning_signal()
    leave_process(0)  # as the trainer's (rft_hpc/runtime/exit.py)


@role_app.command("evaluator")
def role_evaluator(
    stage: Path = typer.Argument(..., help="Stage directory.", readable=False),
    index: int = typer.Option(0, "--index", help="Evaluator task (Slurm array task id)."),
) -> None:
    """Score weights version INDEX of a finished stage (see eval.every)."""
    from rft_hpc.eval.evaluator import run_evaluator

    name_process(f"evaluator-{index}")
    result = run_evaluator(stage, index)
    console.print(f"weights v{result['version']}: {result['metric']} "
                  f"{_pct(result['accuracy'])} on {result['tasks']} tasks")


@role_app.command("prepare")
def role_prepare(
    run: Path = typer.Argument(..., help="Run directory."),
    index: int = typer.Option(..., "--index", help="Stage to prepare."),
) -> None:
    """Finish the stages before stage INDEX and lay out stage INDEX (a job between stages)."""
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.launch.sbatch import stage_job_seconds
    from rft_hpc.run.stages import prepare_next_stage

    stage = prepare_next_stage(RunDir(run.resolve()), index, stage_job_seconds)
    console.print(f"prepared {stage.root}")


@role_app.command("resume")
def role_resume(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Resubmit a run's failed jobs (the watcher job of `submit --auto-resume`)."""
    from rft_hpc.launch.resume import resume_run

    result = resume_run(run)
    console.print(f"resubmitted: {', '.join(j.name for j in result.jobs) or 'nothing'}")


@role_app.command("finalize")
def role_finalize(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    """Finish the last stage, write summary.json and report.png (the last job of a run)."""
    import time

    from rft_hpc.core.rundir import RunDir
    from rft_hpc.launch.sbatch import stage_job_seconds
    from rft_hpc.launch.submit import submitted_at
    from rft_hpc.run.summary import finalize_run

    folder = RunDir(run.resolve())
    start = submitted_at(folder)
    summary = finalize_run(folder, stage_job_seconds,
                           wall_seconds=time.time() - start if start is not None else 0.0)
    console.print(stage_table(summary))
    console.print(f"summary: {folder.root / 'summary.json'}")
