"""The buffer folder: its marker file, its writer folders, and the quarantine.

    <buffer>/FORMAT              {"format": "rft-hpc-buffer", "schema_version": 2}
    <buffer>/<writer>/<step>.h5  committed segments (8-digit first step)
    <buffer>/<writer>/archive-<step>-<end>.h5   consumed segments folded together
    <buffer>/<writer>/.tmp-*     segments being written (never read)
    <buffer>/quarantine/<writer>/<step>.h5 + <step>.h5.reason.txt
"""

from __future__ import annotations

import os
from pathlib import Path

from rft_hpc.buffer.segment import SCHEMA_VERSION
from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import PROCESS_RETRY
from rft_hpc.core.rundir import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    is_temporary,
    make_dirs,
    read_json,
)

FORMAT_FILE = "FORMAT"
FORMAT_NAME = "rft-hpc-buffer"
QUARANTINE = "quarantine"


def ensure_buffer_dir(path: Path) -> Path:
    """Create the buffer folder and its FORMAT marker if needed (done again after a
    transient error: `core.retry`); return the path."""
    PROCESS_RETRY.write("buffer folder", path, lambda: _ensure_buffer_dir(path))
    return path


def _ensure_buffer_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file, not a buffer folder")
    make_dirs(path)
    if not (path / FORMAT_FILE).exists():
        atomic_write_json(path / FORMAT_FILE,
                          {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION})


def open_buffer_dir(path: Path) -> Path:
    """Check that `path` is an existing buffer folder; raise a `UserError` saying why not."""
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a buffer folder")
    marker = path / FORMAT_FILE
    try:
        fmt = read_json(marker)
        ok = fmt.get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise UserError(f"{path} is not an rft-hpc buffer (no valid {FORMAT_FILE} file); "
                        "buffers are made by explorers or `rft-hpc buffer import`")
    return path


def writer_names(buffer_dir: Path) -> list[str]:
    """Names of the writer folders in a buffer (one listing of the buffer folder, with
    retries: `core.retry`), sorted."""
    def names() -> list[str]:
        with os.scandir(buffer_dir) as entries:
            return sorted(e.name for e in entries
                          if e.is_dir() and e.name != QUARANTINE and not e.name.startswith("."))
    try:
        return PROCESS_RETRY.read("buffer folder", buffer_dir, names)
    except FileNotFoundError:
        return []


def quarantine_segment(buffer_dir: Path, segment: Path, reason: str) -> Path:
    """Move a damaged segment to `<buffer>/quarantine/<writer>/` with a `.reason.txt` beside it.

    Returns the segment's new path. An earlier quarantined file of the same name is kept
    (the new one gets a numeric suffix).
    """
    target_dir = buffer_dir / QUARANTINE / segment.parent.name
    make_dirs(target_dir)
    target = target_dir / segment.name
    n = 1
    while target.exists():
        target = target_dir / f"{segment.name}.{n}"
        n += 1
    atomic_write_text(target.with_name(target.name + ".reason.txt"), reason.rstrip() + "\n")
    os.replace(segment, target)
    fsync_dir(segment.parent)
    return target


def stray_temporaries(writer_dir: Path) -> list[str]:
    """Temporary files in a writer folder (a live writer's work, or a dead one's leftovers)."""
    return sorted(e for e in os.listdir(writer_dir) if is_temporary(e))
