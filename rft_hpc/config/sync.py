"""`sync`: how and how often weights travel from the trainer to the explorers
(docs/weights-format.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rft_hpc.core.config_section import ConfigSection


class SyncConfig(ConfigSection):
    """How and how often new policy weights travel from the trainer to the explorers."""

    method: Literal["checkpoint", "nccl", "mpi"] = "checkpoint"
    """Transport: `checkpoint` (files on the shared filesystem, always works), `nccl`
    (torch.distributed broadcast, gloo on CPUs) or `mpi` (mpi4py broadcast)."""

    interval: int = Field(1, ge=1)
    """Trainer steps between weight publishes (Trinity-RFT's `sync_interval`)."""

    offset: int = Field(0, ge=0)
    """Steps an explorer may run ahead of the newest weights it holds: 0 is strictly
    on-policy, 1 one-step off-policy, large fully asynchronous (`sync_offset`)."""

    timeout: float = Field(600.0, gt=0.0)
    """Seconds a sync may take before the role falls back to `checkpoint` (`sync_timeout`)."""

    bucket_mb: float = Field(64.0, gt=0.0)
    """With nccl/mpi: size of the buffers the weights travel in (tensors of one dtype are
    packed together; a large tensor goes in pieces of this size)."""

    checksum: bool = False
    """With nccl/mpi: receivers verify a CRC32 of every version (one more pass over the
    weights on each side)."""

    background: bool = True
    """With `checkpoint`: the trainer copies each version to host memory and a background
    thread writes its files while the next step trains (one write in flight: the next
    publish waits for it). Costs one extra host copy of the weights; off, the trainer
    writes the files itself before it trains on."""

    full_every: int = Field(1, ge=1)
    """Every how many versions written as files, or broadcast by nccl/mpi, one is whole: the
    others go as deltas against the version before (XOR of the raw bits, compressed:
    lossless; about half the bytes of a float32 model and a tenth of a bfloat16 one after an
    AdamW step at lr 1e-5, see docs/weights-format.md), and an explorer that holds that
    version applies just the delta (over nccl/mpi: if one explorer cannot, the version
    follows whole in the same sync). 1 (the default): every version whole. The trainer keeps
    one more host copy of the weights (the next delta's base; over nccl/mpi also of the
    version being sent), and so does each nccl/mpi explorer; versions an evaluator scores
    are always whole as files."""

    idle_publish: float = Field(5.0, ge=0.0)
    """With nccl/mpi: seconds the trainer waits for data before it also writes its current
    weights as files, so that an explorer that (re)started after the last broadcast can go
    on."""
