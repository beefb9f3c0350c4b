"""`trainer.megatron`: how the Megatron-core backend cuts the model over the trainer's GPUs.

Read only with `trainer.backend: megatron`. docs/megatron.md describes the weight layout
these settings produce.
"""

from __future__ import annotations

from pydantic import Field

from rft_hpc.core.config_section import ConfigSection


class MegatronSettings(ConfigSection):
    """Megatron-core parallelism of the trainer (`trainer.backend: megatron`)."""

    tensor_parallel: int = Field(1, ge=1)
    """GPUs that each layer's weights are cut over (tensor parallelism): attention by query
    groups, the MLP by its hidden units, the vocabulary by rows. Must divide the model's
    key/value heads; the trainer's rank count must be a multiple of it (the rest is data
    parallelism)."""

    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline stages that the layers are split into, in equal contiguous ranges (must
    divide the layer count); the first stage holds the embedding, the last the final norm
    and the output layer. Only 1 trains yet: more is refused before a run (the weight
    layout and gather support it, the training loop has no pipeline schedule)."""

    make_vocab_size_divisible_by: int = Field(128, ge=1)
    """The vocabulary is padded with zero rows to a multiple of this times
    `tensor_parallel` (Megatron's vocab-parallel layers need equal cuts); published weights
    drop the padding again."""
