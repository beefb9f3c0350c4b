"""Whether this installation can train with `trainer.backend: megatron`."""

from __future__ import annotations

import importlib.util


def megatron_problem() -> str | None:
    """Why `trainer.backend: megatron` cannot train here (a sentence that completes
    "trainer.backend megatron ..."), or None when it can: megatron-core must be installed.
    Not a CUDA check: `rft-hpc submit` runs this on login nodes, which have no GPUs, and the
    backend also trains on CPUs (`rft_hpc.megatron.cpu`)."""
    if importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core: pip install 'rft-hpc[megatron]'"
    return None
