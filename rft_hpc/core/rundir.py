"""The run directory: the only state the roles share, and the one atomic-write helper.

Layout (docs/run-directory.md, version 1)::

    <run_root>/<run_name>/
      config.yaml          resolved config, frozen at first submit
      buffer/<writer>/     experience segments, one writer per folder
      weights/v<NNNNNN>/   published policy weights + manifest.json; weights/LATEST
      ckpt/trainer/step-<NNNNNN>/   full trainer state; ckpt/LATEST
      state/               explorer cursors, heartbeats, rendezvous files, job ids
      metrics/             JSONL per role + TensorBoard events
      jobs/                sbatch scripts, logs

Every file another role reads is written with `atomic_write_bytes` (or one of its wrappers):
temporary name, flush, fsync, rename, fsync of the folder. No file locks are used anywhere.
A write that meets a full disk or an exceeded quota removes its temporary file and raises
`rft_hpc.core.storage.StorageFull` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import PROCESS_RETRY, read_bytes
from rft_hpc.core.storage import naming_full

RUNDIR_LAYOUT_VERSION = 1

TEMP_PREFIX = ".tmp-"
"""Prefix of every temporary file rft-hpc writes; readers never open such a file."""


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename or create inside it) to stable storage (done again
    after a transient error: `core.retry`)."""
    PROCESS_RETRY.write("folder", path, lambda: _fsync(path, os.O_RDONLY | os.O_DIRECTORY))


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a closed file's data to stable storage (for files written by other libraries;
    done again after a transient error)."""
    PROCESS_RETRY.write("file", path, lambda: _fsync(path, os.O_RDONLY))


def _fsync(path: str | os.PathLike[str], flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike[str]) -> None:
    """`mkdir -p path`, done again after a transient error (`core.retry`)."""
    PROCESS_RETRY.write("folder", path, lambda: Path(path).mkdir(parents=True, exist_ok=True))


def commit_file(tmp: str | os.PathLike[str], final: str | os.PathLike[str], *,
                durable: bool = True) -> None:
    """Make a fully written temporary file visible under its final name, atomically.

    With `durable`, the file's data is fsynced before the rename and the folder after it,
    so that after a crash the final name either does not exist or holds the whole file.
    Each step is done again after a transient error (`core.retry`); a rename that failed
    but happened (the temporary name is gone, the final one there) counts as done.
    """
    with naming_full(final):  # a full disk: named as such, with the file (StorageFull)
        if durable:
            fsync_file(tmp)
        rename_into_place(tmp, final)
        if durable:
            fsync_dir(Path(final).parent)


def rename_into_place(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """`os.replace(tmp, final)`, done again after a transient error (`core.retry`); one that
    failed but happened (`tmp` gone, `final` there: the server did it and lost the reply)
    counts as done."""
    PROCESS_RETRY.write("file", final, lambda: _replace(tmp, final))


def _replace(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    try:
        os.replace(tmp, final)
    except OSError:
        if not os.path.lexists(tmp) and os.path.lexists(final):
            return
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one.

    Temporary name in the same folder, write, flush, fsync, rename, fsync of the folder;
    after a transient error (EIO, ESTALE ... on the create, a write or the rename) the whole
    write is done again under a fresh temporary name (`core.retry`, counted as its retries).
    """
    path = Path(path)
    with naming_full(path):  # a full disk: named as such, with the file (StorageFull)
        PROCESS_RETRY.write("file", path, lambda: _write_once(path, data, durable))
        if durable:
            fsync_dir(path.parent)


def _write_once(path: Path, data: bytes, durable: bool) -> None:
    """One try of `atomic_write_bytes` without the folder's fsync."""
    # A fresh name opened with O_EXCL (as mkstemp does) but with the usual mode, so that the
    # file respects the umask and a run directory shared with a group stays readable.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        _replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, *, durable: bool = True) -> None:
    """`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: str | os.PathLike[str], obj: object, *, durable: bool = True) -> None:
    """`atomic_write_bytes` for a JSON document (indented, trailing newline); `obj` is
    anything `json.dumps` writes (its `TypeError` otherwise, before the file is touched)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", durable=durable)


# -> Any: the document's shape is the caller's to know (a heartbeat, a manifest, ...)
def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON document written by `atomic_write_json` (with retries: `core.retry`)."""
    return json.loads(read_bytes(Path(path), what="JSON file"))


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[object], *,
                durable: bool = False) -> None:
    """`atomic_write_bytes` of one JSON object per line (a record of results, not state:
    not fsynced unless `durable`)."""
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows),
                      durable=durable)


# list[Any]: as read_json, each row's shape is the caller's to know
def read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
    """The rows of a file written by `write_jsonl`."""
    text = read_bytes(Path(path), what="JSON lines").decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a folder and what it holds, as far as it goes: what cannot be deleted now
    (an I/O error; `shutil.rmtree(ignore_errors=True)` still raises what its `fstat` of
    the folder meets) stays, for the next cleanup of its owner."""
    with contextlib.suppress(OSError):
        shutil.rmtree(path, ignore_errors=True)


def weights_folder_name(version: int) -> str:
    """Name of the folder of published weights version `version` (`v000042`)."""
    return f"v{version:06d}"


def trainer_step_folder_name(step: int) -> str:
    """Name of the folder of the trainer checkpoint at `step` (`step-000042`)."""
    return f"step-{step:06d}"


def is_temporary(name: str) -> bool:
    """True for names of files still being written (never to be opened by a reader)."""
    return name.startswith(TEMP_PREFIX)


@dataclass(frozen=True)
class RunDir:
    """Every path of one run (or stage) directory (docs/run-directory.md); the inner layout
    of `weights/` and `ckpt/` belongs to their formats (`rft_hpc.sync.weight_files`,
    `rft_hpc.trainer.checkpoint`). Creating the object touches nothing on disk."""

    root: Path

    @property
    def config(self) -> Path:
        """`config.yaml`: the resolved config, frozen at the first start."""
        return self.root / "config.yaml"

    @property
    def buffer(self) -> Path:
        """`buffer/`: experience segments, one folder per writer."""
        return self.root / "buffer"

    @property
    def weights(self) -> Path:
        """`weights/`: published weight versions and their `LATEST` pointer."""
        return self.root / "weights"

    def weights_version(self, version: int) -> Path:
        """`weights/v<NNNNNN>/`: one published version (docs/weights-format.md)."""
        return self.weights / weights_folder_name(version)

    @property
    def ckpt(self) -> Path:
        """`ckpt/`: trainer checkpoints and their `LATEST` pointer."""
        return self.root / "ckpt"

    @property
    def state(self) -> Path:
        """`state/`: heartbeats, cursors, rendezvous files, job ids."""
        return self.root / "state"

    def heartbeat(self, role: str) -> Path:
        """`state/<role>.json`: the role's last heartbeat (status, step, version ...)."""
        return self.state / f"{role}.json"

    @property
    def processes(self) -> Path:
        """`state/processes.json`: the pids of the last local run (`rft_hpc.run.processes`)."""
        return self.state / "processes.json"

    @property
    def jobs_record(self) -> Path:
        """`state/jobs.json`: every submission's Slurm jobs."""
        return self.state / "jobs.json"

    @property
    def resume_lock(self) -> Path:
        """`state/resume.lock/`: held while `rft-hpc resume` runs (a folder: mkdir is atomic)."""
        return self.state / "resume.lock"

    @property
    def launcher_clock(self) -> Path:
        """`state/launcher.json`: when the local launcher started the stage."""
        return self.state / "launcher.json"

    @property
    def stage_result(self) -> Path:
        """`state/result.json`: a finished stage's figures."""
        return self.state / "result.json"

    def sync_state(self, method: str) -> Path:
        """`state/sync/<method>/`: rendezvous files of a weight-sync fabric."""
        return self.state / "sync" / method

    def pipeline_stats(self, role: str) -> Path:
        """`state/pipeline/<role>.jsonl`: the explorer-side pipeline's task statistics."""
        return self.state / "pipeline" / f"{role}.jsonl"

    @property
    def ledger(self) -> Path:
        """`ledger/`: each role's ledger of what it did (docs/ledger.md)."""
        return self.root / "ledger"

    def ledger_file(self, role: str) -> Path:
        """`ledger/<role>.jsonl`."""
        return self.ledger / f"{role}.jsonl"

    @property
    def metrics(self) -> Path:
        """`metrics/`: JSONL per role and TensorBoard events."""
        return self.root / "metrics"

    def metrics_file(self, role: str) -> Path:
        """`metrics/<role>.jsonl`."""
        return self.metrics / f"{role}.jsonl"

    @property
    def jobs(self) -> Path:
        """`jobs/`: sbatch scripts and the roles' logs."""
        return self.root / "jobs"

    def log(self, name: str) -> Path:
        """`jobs/<name>.log`: a role's or job's log (`%a` in `name` for an array task)."""
        return self.jobs / f"{name}.log"

    @property
    def eval(self) -> Path:
        """`eval/`: the evaluator's results, one file per weights version."""
        return self.root / "eval"

    def heldout_answers(self, version: int) -> Path:
        """`eval/answers/v<NNNNNN>.jsonl`: the trainer's greedy answer to each held-out task
        and its reward, when it scored weights version `version`."""
        return self.eval / "answers" / f"{weights_folder_name(version)}.jsonl"

    @property
    def bench(self) -> Path:
        """`bench/`: a stage in mode bench (plan, results, logs)."""
        return self.root / "bench"

    @property
    def stages(self) -> Path:
        """`stages/`: one stage directory per stage of a multi-stage run."""
        return self.root / "stages"

    def stage(self, index: int, name: str) -> RunDir:
        """`stages/<index>-<name>/`: a stage directory, itself laid out as a run directory."""
        return RunDir(self.stages / f"{index}-{name}")

    @property
    def summary(self) -> Path:
        """`summary.json`: the run's figures when it ended."""
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        """`report.png`: the run's curves."""
        return self.root / "report.png"

    def create(self) -> RunDir:
        """Create the folders of the layout (idempotent: done again after a transient
        error) and record the layout version."""
        PROCESS_RETRY.write("run directory", self.root, self._create)
        return self

    def _create(self) -> None:
        for folder in (self.buffer, self.weights, self.ckpt, self.state, self.metrics, self.jobs):
            folder.mkdir(parents=True, exist_ok=True)
        marker = self.root / "RUNDIR_VERSION"
        if not marker.exists():
            atomic_write_text(marker, f"{RUNDIR_LAYOUT_VERSION}\n")


def open_run_dir(path: Path) -> RunDir:
    """The run directory at `path`, or a `UserError` if there is none."""
    run = RunDir(path.resolve())
    if not run.config.exists():
        raise UserError(f"{path} is not a run directory (no config.yaml)")
    return run
