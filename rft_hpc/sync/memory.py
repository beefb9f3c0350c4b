"""Weights handed from the trainer to the explorer in one process: the colocated placement.

When the explorer's loop and the trainer's loop share a process (`launch.colocate`), a
published version needs no files and no fabric: `MemoryHandover.send` copies the trainer's
state dict into a buffer of its own (the trainer goes on changing its parameters in place)
and wakes the explorer, whose `WeightFollower` takes it at its next refresh and copies it
into the engine. Two buffers serve turn by turn: the one the engine is copying from is never
written into. The newest version stays in its buffer, so that a checkpoint (or the end of
the stage) can write it as files (`WeightPublisher.flush`): a restarted process, or an
evaluator, finds it where every role looks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from rft_hpc.sync.protocols import SyncFailed, Version


class MemoryHandover:
    """Both ends of an in-process weight sync: a `WeightSender` for the trainer and a
    `VersionSource` for the explorer's follower."""

    last_form = "whole"

    def __init__(self) -> None:
        self.failures: list[SyncFailed] = []  # never: a copy in memory cannot fail halfway
        self._lock = threading.Condition()
        self._newest: Version | None = None
        self._taken = -1  # the newest version given to the follower
        self._lent: set[int] = set()  # ids of buffers the engine is copying from
        self._spare: list[dict[str, torch.Tensor]] = []
        self._closed = False

    # -- the trainer's end ------------------------------------------------------------------

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Sequence[int | str]:
        """Copy `version` into a free buffer and make it the newest; wakes a waiting
        follower. Never fails, never waits for the explorer."""
        with self._lock:
            buffer = self._free_buffer(state_dict)
        for name, tensor in state_dict.items():  # outside the lock: the follower may take
            buffer[name].copy_(tensor.detach())  # the version before meanwhile
        with self._lock:
            old, self._newest = self._newest, (version, buffer)
            if old is not None and id(old[1]) not in self._lent:
                self._spare.append(old[1])
            self._lock.notify_all()
        return []

    def _free_buffer(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A buffer shaped like `state_dict` that nobody reads: a spare one, else new (at
        most two exist: the newest and the one being copied into)."""
        while self._spare:
            buffer = self._spare.pop()
            if buffer.keys() == state_dict.keys() and all(
                    buffer[n].shape == t.shape and buffer[n].dtype == t.dtype
                    for n, t in state_dict.items()):
                return buffer
        return {n: torch.empty_like(t) for n, t in state_dict.items()}

    def newest(self) -> Version | None:
        """The newest version sent (its buffer is not written into while the caller holds
        `held()`), or None before the first."""
        return self._newest

    def held(self) -> threading.Condition:
        """The lock that keeps the newest version's buffer as it is (a file write of it)."""
        return self._lock

    def close(self) -> None:
        """No more versions come; a waiting follower wakes."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # -- the explorer's end -----------------------------------------------------------------

    def take(self) -> Version | None:
        """The newest version not taken yet, lent until `give_back`, or None."""
        with self._lock:
            if self._newest is None or self._newest[0] == self._taken:
                return None
            version, buffer = self._newest
            self._taken = version
            self._lent.add(id(buffer))
            return version, buffer

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The engine has copied the version in: its buffer may be written into again
        (unless it is still the newest)."""
        with self._lock:
            self._lent.discard(id(state_dict))
            if self._newest is None or self._newest[1] is not state_dict:
                self._spare.append(dict(state_dict))

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` s for a version not taken yet; True when there is one (or
        the handover closed)."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._closed or (self._newest is not None
                                         and self._newest[0] != self._taken), timeout)
