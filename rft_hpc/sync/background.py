"""Writing weight versions as files on a background thread while the trainer trains on.

The trainer's step must not wait for the filesystem: `submit` copies the version to host
memory (the next optimizer step changes the live tensors) and returns; a thread writes it
with `publish_weights`, which makes it visible to the explorers only when it is complete
(docs/weights-format.md). One write is in flight at a time, so versions land in order and at
most one extra host copy of the weights exists; a write that failed raises in the trainer at
its next `submit`, `wait` or `close`, never silently. With a `DeltaChain` that is active,
versions may go as deltas against the one before (its host copy is kept until then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.sync.delta import DeltaChain
from rft_hpc.sync.weight_files import publish_weights


class BackgroundWeightWriter:
    """Publishes weight versions to `weights_dir` on one background thread, in order."""

    def __init__(self, weights_dir: Path, keep_also: Collection[int] = (),
                 chain: DeltaChain | None = None) -> None:
        self.weights_dir, self.keep_also = weights_dir, keep_also
        self.chain = chain or DeltaChain(1)
        self.write_seconds = 0.0
        """How long the last finished write took (its thread's wall time)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, state_dict: Mapping[str, torch.Tensor], version: int, *,
               adapter: dict[str, Any] | None = None) -> float:
        """Start writing `version` (a host copy of `state_dict` taken now; `adapter`: as
        `publish_weights` takes it); returns the seconds spent waiting for the previous
        write to finish."""
        waited = self.wait()
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in state_dict.items()}
        base = None if adapter is not None else self.chain.next(
            snapshot, version, whole=version in self.keep_also)
        self._thread = threading.Thread(target=self._write,
                                        args=(snapshot, version, adapter, base),
                                        name=f"weights-writer-v{version}", daemon=True)
        self._thread.start()
        return waited

    def _write(self, snapshot: dict[str, torch.Tensor], version: int,
               adapter: dict[str, Any] | None,
               base: tuple[int, dict[str, torch.Tensor]] | None) -> None:
        t0 = time.monotonic()
        try:
            publish_weights(self.weights_dir, snapshot, version, keep_also=self.keep_also,
                            adapter=adapter, delta_of=base)
        except BaseException as exc:  # handed to the trainer's thread by `wait`
            self._error = exc
        self.write_seconds = time.monotonic() - t0

    def wait(self) -> float:
        """Block until the write in flight (if any) is on the filesystem; re-raise its
        error. Returns the seconds waited."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.monotonic() - t0
