"""The trainer's backend interface: how the policy is held, run and gathered over the ranks.

`Trainer` (`rft_hpc.trainer.trainer`) is one loop for every backend: rank 0 prepares the
batch and scatters the shards, each rank computes its share of the loss, backward, the
optimizer step, the metrics. Everything that depends on the training engine is behind a
`TrainerBackend`, chosen once by `build_backend`:

- `ddp`: `rft_hpc.trainer.torch_backend.TorchBackend` (`trainer.backend: torch`, with
  `parallel: ddp` or a single rank): a whole replica on every rank, gradients summed;
- `fsdp`: `rft_hpc.trainer.fsdp.FSDPBackend` (`backend: torch`, `parallel: fsdp` on several
  ranks): FSDP2 shards of the replica;
- `megatron`: `rft_hpc.trainer.megatron_backend.MegatronBackend` (`backend: megatron`): this
  rank's megatron-core GPTModel shard.

docs/trainer.md says how to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.trainer.distributed import DistContext
from rft_hpc.trainer.fsdp import FSDPBackend
from rft_hpc.trainer.megatron_backend import MegatronBackend
from rft_hpc.trainer.torch_backend import TorchBackend


class TrainerBackend(Protocol):
    """What the trainer loop asks of a training engine. The loop calls, in this order,
    `place`, `build`, `distribute` once, then per step `logits` (and `idle_pass`) with the
    backward passes, `reduce_gradients`, `clip_gradients`; the state methods when it
    publishes, evaluates, saves or restores. Methods that are collectives say so: every rank
    calls them together."""

    name: str
    """The name `build_backend` knows it by."""
    device: torch.device
    """Where this rank's policy (shard) lives."""
    compute_dtype: torch.dtype
    """The dtype forward and backward compute in."""
    sharded: bool
    """True when no rank holds the full weights (they exist only when gathered, a
    collective) and every forward and backward is a collective: the ranks then run the same
    number of passes per step, and `full_state` and `checkpoint_parts` are collectives."""
    model_parallel: int
    """Consecutive ranks that hold one model between them and train on the same rows (a
    tensor-parallel group); 1 when each rank holds a whole model or an FSDP shard."""
    rank0_forward: bool
    """True when rank 0 can run the policy's forward by itself (the whole-batch log-probs
    that a KL penalty in the reward needs, computed before the batch is split)."""
    packs_prompts: bool
    """True when `logits` takes packed prompts (a 4D attention mask and position ids)."""
    model: torch.nn.Module
    """The policy being trained (set by `build`): its `parameters()` are what the optimizer
    steps; called with `input_ids`, `attention_mask`, `use_cache` it returns `.logits`."""

    def place(self, hf_model: torch.nn.Module) -> None:
        """Move the freshly loaded whole HF model to where this rank keeps it (before the
        start weights are loaded into it)."""

    def build(self, engine: HFEngine, reference: bool) -> torch.nn.Module | None:
        """Make `model`, the trainable policy, from `engine.model` (the HF model with the
        stage's start weights); every rank starts from the same weights. With `reference`
        also return a frozen copy of the starting policy (eval mode, no gradients), else
        None. May drop `engine.model` on ranks that do not evaluate."""

    def distribute(self) -> None:
        """Spread `model` over the ranks, after the trainer has copied what stays a whole
        replica (the critic); nothing for a backend that is spread by `build` or not at
        all."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The policy's float32 logits [B, T, V] for a batch, computed in `compute_dtype`
        with autograd (a collective when `sharded`): of padded rows (a [B, T] mask), or of
        packed prompts (`rft_hpc.batch.shared_prompts`: a 4D mask and position ids)."""

    def idle_pass(self, pad_id: int) -> None:
        """A forward and backward that adds nothing to the gradients: a rank with no micro-
        batch left takes part in the others' collectives (only called when `sharded`)."""

    def reduce_gradients(self) -> None:
        """After the backward passes: make every rank's gradients the sum over the ranks
        that trained on different rows (a collective)."""

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients so that the full model's gradient norm is at most
        `max_norm`; returns the norm before (a collective when the model is cut)."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights with HF names (what is published and checkpointed);
        when `sharded` a collective, complete on rank 0 only."""

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """(model, optimizer) as `save_trainer_state` takes them (objects with a
        `state_dict()` of the full state); when `sharded` a collective that gathers both
        (complete on rank 0, which saves)."""

    def restore_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """(model, optimizer) as `load_trainer_state` takes them: their `load_state_dict`
        takes a full state and keeps this rank's part (every rank loads together)."""


BACKENDS: dict[str, Callable[[ExperimentConfig, DistContext], TrainerBackend]] = {
    TorchBackend.name: TorchBackend,
    FSDPBackend.name: FSDPBackend,
    MegatronBackend.name: MegatronBackend,
}


def backend_name(config: ExperimentConfig, dist: DistContext) -> str:
    """The `BACKENDS` key that trains `config` on the ranks of `dist`."""
    tcfg = config.trainer
    if tcfg.backend == "megatron":
        return MegatronBackend.name
    # one rank trains the same way with either setting: there is nothing to shard
    return FSDPBackend.name if tcfg.parallel == "fsdp" and dist.distributed else \
        TorchBackend.name


def build_backend(config: ExperimentConfig, dist: DistContext) -> TrainerBackend:
    """The backend `config` names, set up for this rank of `dist` (megatron: its model-
    parallel groups). Raises `UserError` for a backend this installation or `config` cannot
    run."""
    return BACKENDS[backend_name(config, dist)](config, dist)
