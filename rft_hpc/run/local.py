"""`rft-hpc run`: every role of every stage as a local process (the trainer and explorer 0
in one where the stage runs colocated, `launch.colocate`).

The roles run the command line a Slurm job runs (`rft-hpc role ...` on a stage directory),
forked from a fork server that has imported torch once (`run.forked`); only the launcher
differs. Ctrl-C asks every role to stop at its next safe point
(the trainer saves a checkpoint); running the same command again resumes: finished stages
are skipped, explorers continue after their last committed step, the trainer from its
checkpoint. A role that stops on a full disk or an exceeded quota (its exit status is the
errno, `rft_hpc.core.storage`) stops the others the same way, and the run ends with one
message naming the role, the error and the path (`StoppedOnFullStorage`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.placement import colocated
from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import open_append, read_bytes
from rft_hpc.core.rundir import RunDir, atomic_write_json, read_json
from rft_hpc.core.storage import full_from_exit, storage_full
from rft_hpc.eval.results import result_path
from rft_hpc.run.display import Display
from rft_hpc.run.forked import ForkedProcess, forkable
from rft_hpc.run.processes import ProcessRecord, role_stopped_full, unless_full
from rft_hpc.run.stages import (
    finish_stage,
    open_run,
    prepare_stage,
    stage_result,
    start_weights,
)
from rft_hpc.run.summary import write_report, write_summary
from rft_hpc.runtime.command import role_command, role_env
from rft_hpc.runtime.lifecycle import REQUEUE_EXIT
from rft_hpc.runtime.placement import available_cores, local_threads

STOP_GRACE_SECONDS = 60.0


class Interrupted(UserError):
    """The user stopped the run; it resumes when the same command runs again."""


@dataclass
class RoleProcess:
    """One running role, how it was started and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes] | ForkedProcess
    log: Path
    cmd: list[str]
    threads: int
    record: ProcessRecord
    stage: str
    restarts: int = 0

    def start(self) -> None:
        """Start the role (again) and record its pid."""
        self.proc = _popen(self.cmd, self.log, self.threads)
        _record(self.record, self.stage, self.name, self.proc.pid)


@dataclass
class RunResult:
    """Where a finished run lives and what it reported."""

    root: Path
    summary: dict = field(default_factory=dict)


def _start(name: str, cmd: list[str], run: RunDir, threads: int,
           record: ProcessRecord) -> RoleProcess:
    log = run.log(name)
    role = RoleProcess(name, _popen(cmd, log, threads), log, cmd, threads, record,
                       run.root.name)
    _record(record, role.stage, name, role.proc.pid)
    return role


def _record(record: ProcessRecord, stage: str, name: str, pid: int) -> None:
    """Record process `pid` as role `name` (the colocated process as each role it runs:
    `rft-hpc status` shows roles, each with its heartbeat)."""
    for role in COLOCATED_ROLES if name == "colocated" else (name,):
        record.started(stage, role, pid)


COLOCATED_ROLES = ("trainer", "explorer-0")
"""The roles the colocated process runs (`rft_hpc.colocate.role`)."""


def _popen(cmd: list[str], log: Path, threads: int) -> subprocess.Popen[bytes] | ForkedProcess:
    if forkable(cmd):  # from the fork server that has imported torch once for every role
        return ForkedProcess(cmd, role_env(threads, shared=True), log)
    env = dict(os.environ, **role_env(threads, shared=True))
    with os.fdopen(open_append(log, mode=0o644, what="log"), "ab") as out:
        # A session of its own: Ctrl-C reaches only the launcher, which asks roles to stop.
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _roles(config: ExperimentConfig, run: RunDir, record: ProcessRecord) -> list[RoleProcess]:
    # sync.method mpi: each role an MPI program of its own, as srun --mpi makes it in a job
    launcher = mpi_launcher() if config.sync.method == "mpi" else []
    threads = local_threads(config)  # the roles share this machine's cores
    procs: list[RoleProcess] = []
    try:
        _start_roles(config, run, record, launcher, threads, procs)
    except BaseException:  # e.g. a log that cannot be created: stop those already started
        _stop_all(procs)
        raise
    return procs


def _start_roles(config: ExperimentConfig, run: RunDir, record: ProcessRecord,
                 launcher: list[str], threads: dict[str, int],
                 procs: list[RoleProcess]) -> None:
    """Start the roles of `config`'s mode, each appended to `procs` as it starts."""
    if config.mode == "bench":
        procs.append(_start("bench", role_command("bench-stage", run.root), run,
                            threads["trainer"], record))
    together = colocated(config, "local")
    if together:  # the trainer and explorer 0 in one process: it takes every core
        procs.append(_start("colocated", role_command("colocated", run.root), run,
                            config.trainer.threads or available_cores(), record))
    elif config.mode in ("both", "train"):
        procs.append(_start("trainer", [*launcher, *role_command("trainer", run.root)], run,
                            threads["trainer"], record))
    if config.mode in ("both", "explore"):
        for j in range(config.reward_job.count):  # first: explorers send them work at once
            procs.append(_start(f"reward-{j}", role_command("reward", run.root, j), run,
                                threads["explorer"], record))
        for i in range(1 if together else 0, config.explorer.count):
            procs.append(_start(f"explorer-{i}",
                                [*launcher, *role_command("explorer", run.root, i)], run,
                                threads["explorer"], record))


def mpi_launcher() -> list[str]:
    """`mpiexec -n 1`: the MPI beside this Python (the `mpi` extra's), else the PATH's."""
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise UserError("sync.method mpi needs mpiexec: pip install 'rft-hpc[mpi]'")
    return [found, "-n", "1"]


def _evaluate(config: ExperimentConfig, run: RunDir, title: str, live: bool | None,
              record: ProcessRecord) -> None:
    """Run the evaluator tasks of a finished stage that have no result yet, all at once."""
    versions = config.eval.scored_versions(config.trainer.steps)
    todo = [i for i, v in enumerate(versions) if not result_path(run, v).exists()]
    if not todo:
        return
    share = config.trainer.threads or max(1, available_cores() // len(todo))
    procs = [_start(f"evaluator-{i}", role_command("evaluator", run.root, i), run,
                    share, record) for i in todo]
    with Display(config, run, title, live=live, roles=[p.name for p in procs]) as display:
        _supervise(procs, display)


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
    """Wait for every role, starting again those that ask to be requeued; stop the others
    when one fails."""
    try:
        while True:
            display.refresh()
            for p in procs:  # saved and asked to run again, as a Slurm job requeues itself
                if p.proc.poll() == REQUEUE_EXIT:
                    p.restarts += 1
                    display.note(f"restarting {p.name} (restart {p.restarts})")
                    p.start()
            failed = [p for p in procs if p.proc.returncode not in (None, 0)]
            if failed:
                _stop_all(procs)
                full = [p for p in failed if full_from_exit(p.proc.returncode) is not None]
                if full:  # before any other failure: a full disk fails the others too
                    said = getattr(full[0].proc, "reported", lambda: None)()
                    raise role_stopped_full(full[0].name, full[0].proc.returncode, full[0].log,
                                            said)
                text = read_bytes(failed[0].log, what="log").decode(errors="replace")
                tail = text.strip().splitlines()[-15:]
                raise UserError(f"role {failed[0].name} failed (exit {failed[0].proc.returncode});"
                                f" its log is {failed[0].log}:\n" + "\n".join(tail))
            if all(p.proc.returncode is not None for p in procs):
                break
            time.sleep(0.25)
        display.refresh()
    except KeyboardInterrupt:
        display.note("stopping every role at its next safe point ...")
        _stop_all(procs)
        raise Interrupted("run stopped; run the same command again to resume") from None
    except BaseException:  # the launcher's own failure: no role may be left waiting
        _stop_all(procs)
        raise


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
    config, run = open_run(config_path, overrides or [])
    record = ProcessRecord(run)
    try:
        result = _run_stages(config, run, record, live)
    except (Interrupted, KeyboardInterrupt):
        record.ended("stopped")
        raise
    except BaseException as exc:  # a full disk: stopped, the same command resumes
        record.ended("stopped" if storage_full(exc) is not None else "failed")
        raise
    record.ended("done")
    return result


def _run_stages(config: ExperimentConfig, run: RunDir, record: ProcessRecord,
                live: bool | None) -> RunResult:
    results: list[dict] = []
    t_run = time.monotonic()
    for index, (name, stage) in enumerate(config.stage_configs()):
        folder = run.stage(index, name).root
        done = stage_result(RunDir(folder))
        if done is None:
            stage_run = prepare_stage(stage, folder, start_weights(results))
            display = Display(stage, stage_run, f"stage {index}: {name}", live=live)
            clock = stage_run.launcher_clock
            spent = read_json(clock)["seconds"] if clock.exists() else 0.0
            t0 = time.monotonic()
            try:
                with display:
                    _supervise(_roles(stage, stage_run, record), display)
            finally:  # seconds spent in a stage add up over interrupted runs
                spent += time.monotonic() - t0
                unless_full(atomic_write_json, clock, {"seconds": spent})  # lost: no harm
            done = finish_stage(stage, stage_run, name, spent)
        if stage.eval.evaluator and stage.mode in ("both", "train"):
            _evaluate(stage, RunDir(folder), f"stage {index}: {name}, evaluator", live,
                      record)
        results.append(done)
    summary = write_summary(run, results, wall_seconds=time.monotonic() - t_run)
    write_report(run, results)
    return RunResult(run.root, summary)
