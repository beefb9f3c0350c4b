"""The seams of weight sync: what sends a version, what receives one, what takes it in.

A trainer's `WeightPublisher` writes every version as files and, with `sync.method` nccl or
mpi, hands it to a `WeightSender` too; an explorer's `WeightFollower` takes versions from a
`VersionSource` (a background thread over a `WeightReceiver`) and from files, and loads them
into a `WeightSink`, its inference engine. Each transport (gloo/NCCL in `collective.py`, MPI
in `mpi.py` and `mpi_port.py`) implements the sender and receiver; the files are the
fallback of both (docs/weights-format.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch


class SyncFailed(RuntimeError):
    """A fabric sync did not complete: a peer died, broke the protocol or was too slow.

    Raised in the sender and in every living receiver instead of hanging. `version` is the
    weights version that was being synced (None when unknown); the roles fall back to the
    `checkpoint` method for it.
    """

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version


Version = tuple[int, dict[str, torch.Tensor]]
"""A weights version as it arrives: its number and its state dict."""


class WeightSender(Protocol):
    """The trainer's end of a fabric: broadcasts versions to every explorer listening."""

    last_form: str
    """How the last version went: "whole", "delta" or "delta+whole" (a delta that a
    receiver could not apply, followed by the whole)."""

    def send(self, state_dict: Mapping[str, torch.Tensor],
             version: int) -> Sequence[int | str]:
        """Send version `version` to the receivers; returns the receivers that failed
        (dropped from later sends: ranks, or MPI link names). Raises `SyncFailed` when
        none received it, so the caller falls back to files; never blocks past its
        timeout."""
        ...

    def close(self) -> None:
        """Tell the receivers no more versions come, and free the fabric."""
        ...


class WeightReceiver(Protocol):
    """An explorer's end of a fabric, driven by a `BackgroundReceiver` thread."""

    def receive(self, wait: float | None = None) -> Version | None:
        """The next version, or None when none came within `wait` s (or the sender
        closed). The state dict's buffers are lent: `give_back` returns them."""
        ...

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The buffers of a received state dict may be received into again."""
        ...

    def close(self) -> None:
        """Leave the fabric."""
        ...


class VersionSource(Protocol):
    """Versions received in the background, taken at a step boundary (`BackgroundReceiver`)."""

    failures: list[SyncFailed]
    """Syncs that failed since the caller last cleared the list (each one a fallback to
    files)."""

    def take(self) -> Version | None:
        """The newest version received since the last call, or None."""
        ...

    def give_back(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The engine has copied the version in: its buffers may be reused."""
        ...

    def close(self) -> None:
        """Stop receiving."""
        ...


class WeightSink(Protocol):
    """What takes a version in: an explorer's inference engine (HF or vLLM)."""

    version: int
    """The version it holds (0: the model it was built from)."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights with `state_dict` (copied: the caller may reuse it)."""
        ...
