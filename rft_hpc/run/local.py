"""`rft-hpc run`: every role of every stage as a separate local process.

The roles are started exactly as a Slurm job starts them (`rft-hpc role ...` on a stage
directory); only the launcher differs. Ctrl-C asks every role to stop at its next safe point
(the trainer saves a checkpoint); running the same command again resumes: finished stages
are skipped, explorers continue after their last committed step, the trainer from its
checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.errors import UserError
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.run.display import Display
from rft_hpc.run.stages import (
    check_runnable,
    freeze_run_config,
    prepare_model,
    prepare_stage,
    stage_dir,
    stage_result,
)
from rft_hpc.run.summary import write_report, write_summary
from rft_hpc.rundir import RunDir, atomic_write_json, read_json

STOP_GRACE_SECONDS = 60.0


class Interrupted(UserError):
    """The user stopped the run; it resumes when the same command runs again."""


@dataclass
class RoleProcess:
    """One running role and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class RunResult:
    """Where a finished run lives and what it reported."""

    root: Path
    summary: dict = field(default_factory=dict)


def role_command(role: str, folder: Path, index: int | None = None) -> list[str]:
    """The command line that runs one role on a stage directory (local or in a Slurm job)."""
    cmd = [sys.executable, "-m", "rft_hpc.cli", "role", role, str(folder)]
    return cmd + (["--index", str(index)] if index is not None else [])


def _start(name: str, cmd: list[str], run: RunDir, threads: int) -> RoleProcess:
    log = run.jobs / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    with log.open("ab") as out:
        # A session of its own: Ctrl-C reaches only the launcher, which asks roles to stop.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return RoleProcess(name, proc, log)


def _roles(config: ExperimentConfig, run: RunDir) -> list[RoleProcess]:
    procs = []
    if config.mode in ("both", "train"):
        procs.append(_start("trainer", role_command("trainer", run.root), run,
                            config.trainer.threads))
    if config.mode in ("both", "explore"):
        for i in range(config.explorer.count):
            procs.append(_start(f"explorer-{i}", role_command("explorer", run.root, i), run,
                                config.explorer.threads))
    return procs


def _stop_all(procs: list[RoleProcess]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


def _supervise(procs: list[RoleProcess], display: Display) -> None:
    """Wait for every role; stop the others when one fails."""
    try:
        while any(p.proc.poll() is None for p in procs):
            display.refresh()
            failed = [p for p in procs if p.proc.returncode not in (None, 0)]
            if failed:
                _stop_all(procs)
                tail = failed[0].log.read_text(errors="replace").strip().splitlines()[-15:]
                raise UserError(f"role {failed[0].name} failed (exit {failed[0].proc.returncode});"
                                f" its log is {failed[0].log}:\n" + "\n".join(tail))
            time.sleep(0.25)
        display.refresh()
    except KeyboardInterrupt:
        display.note("stopping every role at its next safe point ...")
        _stop_all(procs)
        raise Interrupted("run stopped; run the same command again to resume") from None


def _finish_stage(config: ExperimentConfig, run: RunDir, name: str, seconds: float) -> dict:
    trainer_state = run.state / "trainer.json"
    trainer = read_json(trainer_state) if trainer_state.exists() else {}
    if config.mode in ("both", "train") and trainer.get("status") != "done":
        raise UserError(f"stage {name}: the trainer stopped before its last step; run the same "
                        "command again to resume")
    evals = [r["eval_accuracy"] for r in read_metrics(run.metrics / "trainer.jsonl")
             if r.get("eval_accuracy") is not None]
    explorer_steps = sum(read_json(p).get("step", 0) for p in run.state.glob("explorer-*.json"))
    version = trainer.get("final_version")
    result = {"name": name, "mode": config.mode, "seconds": seconds,
              "trainer_steps": trainer.get("step", 0), "explorer_steps": explorer_steps,
              "eval_initial": evals[0] if evals else None,
              "eval_final": evals[-1] if evals else None,
              "weights": str(run.weights_version(version)) if version is not None else None}
    atomic_write_json(run.state / "result.json", result)
    return result


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_local(config_path: Path, overrides: list[str] | None = None, *,
              live: bool | None = None) -> RunResult:
    """Run (or resume) the experiment of a config file on this machine.

    SIGINT (Ctrl-C) and SIGTERM stop every role at its next safe point and raise
    `Interrupted`; calling again with the same config resumes the run.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    config = load_config(config_path, overrides or [])
    check_runnable(config)
    config = prepare_model(config)
    run = RunDir(config.run.root.resolve() / config.run.name)
    freeze_run_config(config, run)
    start_weights: Path | None = None
    results = []
    t_run = time.monotonic()
    for index, (name, stage) in enumerate(config.stage_configs()):
        folder = stage_dir(run, index, name)
        done = stage_result(RunDir(folder))
        if done is None:
            stage_run = prepare_stage(stage, folder, start_weights)
            display = Display(stage, stage_run, f"stage {index}: {name}", live=live)
            clock = stage_run.state / "launcher.json"
            spent = read_json(clock)["seconds"] if clock.exists() else 0.0
            t0 = time.monotonic()
            try:
                with display:
                    _supervise(_roles(stage, stage_run), display)
            finally:  # seconds spent in a stage add up over interrupted runs
                spent += time.monotonic() - t0
                atomic_write_json(clock, {"seconds": spent})
            done = _finish_stage(stage, stage_run, name, spent)
        results.append(done)
        start_weights = Path(done["weights"]) if done["weights"] else start_weights
    summary = write_summary(run, results, wall_seconds=time.monotonic() - t_run)
    write_report(run, results)
    return RunResult(run.root, summary)
