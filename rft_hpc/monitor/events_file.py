"""A TensorBoard events file written in the caller's thread, one whole record per write.

TensorBoard's own writer hands each event to a thread of its own and flushes through it:
a role that flushes every step (so that a full disk surfaces in the step that met it, not
in a queue that stops draining) waits each time for that thread to get the interpreter
lock. Next to a thread generating or training in small Python-driven ops, that wait was
4-7 ms a step (colocated placement, docs/colocated.md), on the loop's critical path. An
event here is a few hundred bytes, framed as TFRecord (length, masked CRC-32C of the
length, data, masked CRC-32C of the data) and appended in one `write`: errors surface in
`add`, and a killed role leaves its events whole up to the last step.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from rft_hpc.core.retry import open_append
from rft_hpc.core.rundir import make_dirs
from rft_hpc.core.storage import append_whole, naming_full

_SERIAL = itertools.count()
"""Tells apart events files made by one process in the same second (TensorBoard's uid)."""


class EventsFile:
    """A new `events.out.tfevents.*` file in `folder` (made if missing), its version event
    written; `add` appends one summary at a step."""

    def __init__(self, folder: Path) -> None:
        with naming_full(folder):
            make_dirs(folder)
        self.path = folder / (f"events.out.tfevents.{int(time.time()):010d}."
                              f"{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}")
        self._fd = open_append(self.path, mode=0o644, what="TensorBoard events")
        self._append(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add(self, summary: Any, step: int) -> None:
        """Append `summary` (a `Summary` proto) as the event of `step`, whole or not at all
        (a full disk: `StorageFull`)."""
        self._append(Event(wall_time=time.time(), step=step, summary=summary))

    def _append(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        record = b"".join((header, struct.pack("<I", masked_crc32c(header)), data,
                           struct.pack("<I", masked_crc32c(data))))
        append_whole(self._fd, record, self.path)

    def close(self) -> None:
        """Close the file (every event is already written)."""
        os.close(self._fd)
