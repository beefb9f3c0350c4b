"""Delta versions over the fabric (`nccl`, `mpi`): what sender and receivers keep and check.

With `sync.full_every` K > 1 the sender keeps a host copy of the version it sent last and
sends the next one as its delta (the codec of `rft_hpc.sync.delta`, per tensor), K - 1 times
after each whole version. The delta travels as one uint8 buffer (the tensors' compressed
XORs concatenated in layout order), described by a header `{"base": b, "bytes": [...],
"crc32": [...]}` (each tensor's blob length and the CRC-32 of its new bytes). Each receiver
keeps a host copy of the last version it received (`HeldVersion`): it applies the delta to
that copy and votes in the sync's all-reduce whether it holds `b` and every tensor's
checksum matched. One "no" (a receiver that restarted, joined late, missed a version or
holds bits other than the base's) and the whole version follows in the same sync, to every
receiver: nobody ever ends with wrong weights, and no receiver has to report beforehand
what it holds (docs/weights-format.md, "Fabric sync").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rft_hpc.sync.delta import DeltaChain, DeltaMismatch, decode_into, encode_state, tensor_crc
from rft_hpc.sync.fabric import Destination, Layout


@dataclass(frozen=True)
class DeltaMessage:
    """One version as a delta: its header (what travels in the announcement) and its bytes
    (a flat uint8 CPU tensor, the blobs in layout order)."""

    header: dict[str, Any]
    data: torch.Tensor


def chunks(data: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Views of a flat uint8 tensor, in order, of at most `size` bytes each (none if empty)."""
    return [data[off:off + size] for off in range(0, data.numel(), size)]


class DeltaSender:
    """The sender's side: which version goes as a delta, and its encoding.

    `full_every` is `sync.full_every`; with 1 every version goes whole and nothing is kept.
    """

    def __init__(self, full_every: int) -> None:
        self._full_every = full_every
        self._chain = DeltaChain(full_every)

    @property
    def keep(self) -> bool:
        """Whether receivers should keep a copy of each version (deltas may follow)."""
        return self._chain.active

    def prepare(self, state_dict: Mapping[str, torch.Tensor], version: int,
                ) -> DeltaMessage | None:
        """`version` as a delta against the version sent before, or None: send it whole
        (every K-th version, the first one, after `restart`, or when the tensors' names,
        dtypes or shapes changed). Remembers a host copy of `state_dict` as the next base."""
        if not self._chain.active:
            return None
        snapshot = {n: t.detach().to("cpu", copy=True) for n, t in state_dict.items()}
        base = self._chain.next(snapshot, version)
        if base is None:
            return None
        try:
            blobs = encode_state(snapshot, base[1])
        except DeltaMismatch:
            return None
        order = list(snapshot)
        header = {"base": base[0], "bytes": [blobs[n].numel() for n in order],
                  "crc32": [tensor_crc(snapshot[n]) for n in order]}
        data = torch.cat([blobs[n] for n in order]) if order else \
            torch.empty(0, dtype=torch.uint8)
        return DeltaMessage(header, data)

    def restart(self) -> None:
        """Send the next version whole (after a failed sync: who holds what is unknown)."""
        self._chain = DeltaChain(self._full_every)


class HeldVersion:
    """A receiver's host copy of the last version it received: the base of the next delta."""

    def __init__(self) -> None:
        self.version: int | None = None
        self._digest = ""
        self.tensors: list[torch.Tensor] = []

    def keep(self, version: int, layout: Layout, tensors: list[torch.Tensor]) -> None:
        """Remember a copy of `tensors` (in `layout`'s order) as `version`; reuses the
        previous copy's memory when the layout is the same."""
        digest = layout.digest()
        if digest != self._digest or len(self.tensors) != len(tensors):
            self.tensors = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
            self._digest = digest
        for mine, t in zip(self.tensors, tensors, strict=True):
            mine.copy_(t)
        self.version = version

    def drop(self) -> None:
        """Forget the held version (and free its memory)."""
        self.version, self._digest, self.tensors = None, "", []

    def apply(self, version: int, layout: Layout, header: Mapping[str, Any],
              data: torch.Tensor) -> bool:
        """Turn the held version into `version` by the delta (`header`, `data`): True when it
        held the delta's base in `layout` and every tensor's CRC-32 matches afterwards. On
        False nothing is held any more (a failed delta may have changed some tensors)."""
        lengths, crcs = header["bytes"], header["crc32"]
        if self.version != header["base"] or self._digest != layout.digest() or \
                len(lengths) != len(self.tensors) or len(crcs) != len(self.tensors):
            self.drop()
            return False
        data = data.cpu()
        pos = 0
        try:
            for t, n, crc in zip(self.tensors, lengths, crcs, strict=True):
                if t.numel():
                    decode_into(t, data[pos:pos + n])
                pos += n
                if tensor_crc(t) != crc:
                    raise DeltaMismatch("checksum")
        except DeltaMismatch:
            self.drop()
            return False
        self.version = version
        return True

    def copy_into(self, dest: Destination) -> None:
        """Copy the held tensors into a receive destination of the same layout."""
        for t, mine in zip(dest.tensors, self.tensors, strict=True):
            assert t is not None
            t.copy_(mine)
