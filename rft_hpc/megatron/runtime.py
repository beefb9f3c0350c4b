"""Whether this installation can train with `trainer.backend: megatron`."""

from __future__ import annotations

import importlib.util


def megatron_problem() -> str | None:
    """Why `trainer.backend: megatron` cannot train here (a sentence that completes
    "trainer.backend megatron ..."), or None when it can."""
    if importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core: pip install 'rft-hpc[megatron]'"
    # Not a CUDA check: `rft-hpc submit` runs this on login nodes, which have no GPUs. Once
    # the training loop lands, the trainer role checks for CUDA where it runs.
    return ("is not wired into the trainer's training loop yet (the HF <-> Megatron weight "
            "conversion and the TP/PP gather are, see docs/megatron.md; "
            "tools/device/megatron_check.py trains one step on a GPU); use trainer.backend "
            "torch")
