"""Whether this installation can train with `trainer.backend: megatron`."""

from __future__ import annotations

import importlib.util


def megatron_problem() -> str | None:
    """Why `trainer.backend: megatron` cannot train here (a sentence that completes
    "trainer.backend megatron ..."), or None when it can."""
    if importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core: pip install 'rft-hpc[megatron]'"
    import torch

    if not torch.cuda.is_available():
        return ("needs NVIDIA GPUs (CUDA), and this machine has none: megatron-core runs "
                "a GPTModel's forward only on CUDA. Use trainer.backend torch on CPUs")
    return ("is not wired into the trainer's training loop yet (the HF <-> Megatron weight "
            "conversion and the TP/PP gather are, see docs/megatron.md; "
            "tools/device/megatron_check.py trains one step); use trainer.backend torch")
