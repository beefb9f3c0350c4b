"""The trainer's engine settings: backend, how the ranks share the model, micro-batches.

`TrainerConfig` inherits these fields, so they read as `trainer.backend`,
`trainer.parallel`, ... in a config file. docs/trainer.md explains what each one does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rft_hpc.config.megatron import MegatronSettings
from rft_hpc.core.config_section import ConfigSection

Backend = Literal["torch", "megatron"]
Parallel = Literal["ddp", "fsdp"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]


class TrainerBackendFields(ConfigSection):
    """The trainer's engine: backend, data parallelism, micro-batches, memory savers."""

    backend: Backend = "torch"
    """Training engine: `torch` (plain PyTorch over the trainer's ranks, `parallel` says
    how) or `megatron` (a megatron-core GPTModel cut over the trainer's ranks by tensor
    parallelism, settings in `megatron`; needs megatron-core, runs on GPUs and CPUs; the
    trainer's rank count must be a multiple of `megatron.tensor_parallel` (the rest is data
    parallelism); no pipeline parallelism or critic yet, see docs/megatron.md)."""

    megatron: MegatronSettings = Field(default_factory=MegatronSettings)
    """With backend megatron: tensor and pipeline parallelism, vocabulary padding."""

    parallel: Parallel = "ddp"
    """With backend torch and several ranks: `ddp` (every rank holds a full replica, the
    gradients are summed over the ranks) or `fsdp` (FSDP2, `fully_shard`: parameters,
    gradients and optimizer state are sharded over the ranks; published weights and
    checkpoints are still full state dicts). One rank trains the same way with either."""

    micro_batch_tokens: int = Field(0, ge=0)
    """Token budget of one micro-batch: each rank packs its rows, longest first, into
    micro-batches of at most this many padded tokens (rows x longest row; a DPO pair counts
    as two rows) and accumulates their gradients, so the step's loss is that of the whole
    batch. A sequence longer than the budget is skipped with a warning and counted in the
    `skipped_sequences` metric. 0: each rank's whole shard at once."""

    share_prompts: bool = True
    """Run the rows that begin with the same prompt (a GRPO group, a DPO pair) through the
    model as one sequence, the prompt once (rft_hpc.batch.shared_prompts): the same logits
    and gradients for less work, taken when the estimate says it is cheaper (backend torch,
    sdpa or eager attention). false: every row padded on its own, e.g. to compare."""

    activation_checkpointing: bool = False
    """Recompute the activations of each transformer layer in the backward pass instead of
    keeping them (less memory, about a third more compute); the gradients are the same.
    With backend megatron: megatron-core's full recomputation, one layer per checkpoint."""

    dtype: ComputeDtype = "auto"
    """Compute dtype of forward and backward: `auto` is bfloat16 on GPUs and float32 on
    CPUs. bfloat16 runs under autocast (ddp) or FSDP2's mixed precision (fsdp); weights
    and optimizer state keep `model.dtype`, gradients are reduced in float32. With backend
    megatron the compute dtype is `model.dtype` (`auto` means it; another value is
    refused)."""
