"""Inference engines the explorers sample rollouts from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rft_hpc.config.schema import ExperimentConfig
    from rft_hpc.engines.protocol import StreamingEngine


def build_engine(config: ExperimentConfig) -> StreamingEngine:
    """The engine `explorer.engine` names, on the config's model (vLLM imported only then)."""
    if config.explorer.engine == "vllm":
        from rft_hpc.engines.vllm import VLLMEngine

        return VLLMEngine(config.model.path, dtype=config.model.dtype,
                          settings=config.explorer.vllm, seed=config.run.seed,
                          prompt=config.prompt, lora=config.model.lora)
    import torch

    from rft_hpc.engines.hf import HFEngine

    # the job's GPU when it has one (Slurm makes it device 0), as vLLM would take it
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFEngine(config.model.path, dtype=config.model.dtype, device=device,
                    prompt=config.prompt, lora=config.model.lora)
