"""`explorer.vllm`: the vLLM engine of each explorer (`explorer.engine: vllm`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rft_hpc.config.paths import ConfigPath
from rft_hpc.core.config_section import ConfigSection


class VLLMConfig(ConfigSection):
    """The vLLM engine of each explorer (explorer.engine: vllm)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one explorer's engine shards the model over (the explorer's job needs as many)."""

    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Share of the GPU's memory vLLM takes for weights, activations and KV cache (on CPUs:
    of the machine's memory, unless `kv_cache_gb` is set)."""

    kv_cache_gb: float | None = Field(None, gt=0.0)
    """KV cache size in GiB; null: what `gpu_memory_utilization` leaves on GPUs, 1 GiB on
    CPUs."""

    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + response in tokens; null: the model's own limit."""

    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (the group of a task shares its prompt);
    dropped at every weight update."""

    enforce_eager: bool = False
    """Run the model eagerly, without CUDA graphs or torch.compile: starts much faster,
    generates slower."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the engine's weights and activations; null: `model.dtype`."""

    multiprocessing: bool = False
    """Run vLLM's engine core in a process of its own; false: in the explorer's process,
    which starts faster and takes new weights straight from memory. vLLM's own processes
    (this, and tensor-parallel workers) start with Slurm's warning signal (USR2) blocked: it
    reaches every process of the job step, and only the explorer acts on it."""

    weight_update: Literal["auto", "memory", "folder"] = "auto"
    """How new weights enter the running engine: `memory` (tensors handed over in-process;
    needs multiprocessing false and tensor_parallel_size 1), `folder` (written as a
    safetensors file to `scratch_dir`, read by every worker) or `auto` (memory when it can)."""

    scratch_dir: ConfigPath | None = None
    """Folder for the weight file of `folder` updates (node-local memory is best); null:
    /dev/shm where it exists, else the system's temporary folder."""

    @model_validator(mode="after")
    def _memory_update_in_process(self) -> VLLMConfig:
        if self.weight_update == "memory" and (self.multiprocessing
                                               or self.tensor_parallel_size > 1):
            raise ValueError("weight_update memory needs multiprocessing false and "
                             "tensor_parallel_size 1 (use folder or auto)")
        return self
