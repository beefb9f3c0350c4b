"""Segments written in this process, handed to a reader in this process without a read.

In the colocated placement (docs/colocated.md) the explorer's writer and the trainer's
reader share a process: reading back a segment the writer has just built costs the trainer
an open, a read and a checksum pass of every dataset, milliseconds per step on the loop's
critical path. When the tap is on (`enable`), the writer offers each segment's columns as
a reader would read them (`offer`), keyed by the segment's final path, and the reader takes
them (`take`) once it has seen that path committed, instead of reading the file. What the
reader hands out, and when, is unchanged: a segment counts only once its file is committed,
and a restarted process (an empty tap) reads the files.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rft_hpc.buffer.segment import Segment

_lock = threading.Lock()
_offered: dict[Path, Segment] = {}
_enabled = False


def enable() -> None:
    """Turn the tap on for this process (writers offer, readers take)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    """Whether writers of this process offer their segments."""
    return _enabled


def offer(segment: Segment) -> None:
    """The segment that will be committed at `segment.path` (replacing an offer of the same
    path: a step written again after a failed commit)."""
    with _lock:
        _offered[segment.path] = segment


def take(path: Path) -> Segment | None:
    """The segment offered for `path` (once), or None: read the file."""
    with _lock:
        return _offered.pop(path, None)
