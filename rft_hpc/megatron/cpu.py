"""Let megatron-core's GPTModel run forward and backward on CPUs (no CUDA present).

This exists so that CI and laptops exercise the real megatron-core code of the Megatron
backend (tensor-parallel layers and their gloo collectives included), not a stand-in. On a
machine with CUDA, `enable_cpu_execution` patches nothing.

megatron-core 0.16 assumes CUDA in four places that the trainer's forward and backward
reach; each shim below replaces exactly one of them:

1. `torch.cuda.current_device()` is the device of every buffer it allocates (rotary
   `inv_freq`, the tensor-parallel all-gather buffers ...): here it answers "cpu";
2. its default causal attention mask is created on "cuda": the trainer always passes its
   own mask (`rft_hpc.megatron.policy`), so nothing is patched for it;
3. its CUDA RNG tracker (`get_cuda_rng_tracker().fork()`, around dropout) needs CUDA RNG
   states: it is replaced by one whose `fork()` does nothing; the backend configures no
   dropout, so no random numbers are drawn inside a fork;
4. activation checkpointing (`tensor_parallel.checkpoint`) saves and restores the CUDA RNG
   state around the recomputed forward: without CUDA there is none, so both are no-ops
   (the CPU generator's state is still saved and restored by megatron-core itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_enabled = False


class _NoRngTracker:
    """Stands in for megatron-core's CUDA RNG tracker on CPUs (no dropout is configured)."""

    def is_initialized(self) -> bool:
        """Always ready."""
        return True

    def get_states(self) -> dict[str, Any]:
        """No per-region RNG states to save."""
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        """Nothing to restore."""

    def add(self, name: str, seed: int) -> None:
        """Seeds for regions that never draw random numbers are ignored."""

    def reset(self) -> None:
        """Nothing to reset."""

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block with the process's ordinary RNG."""
        yield


def enable_cpu_execution() -> bool:
    """Apply the shims of the module doc when CUDA is not available (idempotent); returns
    True when they are in force. Call it before building a GPTModel."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if not _enabled:
        from megatron.core.tensor_parallel import random as mrandom

        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        mrandom._CUDA_RNG_STATE_TRACKER = _NoRngTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
        mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
        _enabled = True
    return True
