"""FSDP2 over the trainer's ranks (`trainer.parallel: fsdp`): `FSDPBackend`, and its helpers.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to every transformer layer and to
the whole model: each rank keeps 1/N of every parameter, gradient and optimizer state; the
forward and backward passes gather the parameters layer by layer. Gradients are summed over
the ranks (divide factor 1), as the data-parallel path sums them, because each rank's loss is
already its share of the whole batch's loss. Runs on gloo (CPUs) and NCCL alike.

Every forward and backward is a collective under FSDP: all ranks run the same number of
micro-batches (an idle pass fills in on a rank with fewer), and the full weights exist only
when gathered (`full_model_state`, a collective, complete on rank 0 only), which is what the
trainer publishes and checkpoints, so the weight and checkpoint formats do not change.
Rank 0 evaluates on a whole replica it builds once and loads the gathered weights into.
Everything else is `TorchBackend`'s (the reference and the critic stay whole replicas).
With `model.lora` the adapted model is sharded (frozen base and adapter); only the
adapter's parameters are gathered to publish and checkpoint, and the reference is the
sharded policy with its adapter off, so its forward is a collective too.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.models.lora import adapter_state
from rft_hpc.trainer.distributed import DistContext
from rft_hpc.trainer.optim_state import to_named
from rft_hpc.trainer.torch_backend import TorchBackend

# torch.distributed.fsdp and .checkpoint are imported where they are used: together they
# cost half a CPU-second at every trainer start (sympy, DTensor), and most trainers never
# shard.


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (the classes it names in
    `_no_split_modules`), in order; empty when it names none."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: torch.nn.Module, ctx: DistContext,
                compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `model` in place over the ranks of `ctx` (layers first, then the root).

    Every rank must hold the same weights before (rank 0's, broadcast). `compute_dtype`
    (e.g. bfloat16) is FSDP2's mixed precision: parameters are gathered in it, gradients
    reduced in float32, the sharded weights keep their own dtype.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32
                                  if compute_dtype is not None else None)
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` was sharded by `shard_model`."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def full_model_state(model: torch.nn.Module, trainable_only: bool = False,
                     ) -> dict[str, torch.Tensor]:
    """The full (gathered) state dict on CPU (`trainable_only`: of the parameters that
    require gradients, a LoRA adapter's): a collective of every rank; complete on rank 0,
    empty on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                               ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         ) -> dict[str, Any]:
    """The optimizer's full state dict (keyed by parameter names, `optim_state`) on CPU: a
    collective; complete on rank 0, empty on the others. An optimizer that has not stepped
    yet has no state to gather (its param groups alone, on every rank)."""
    if not optimizer.state:  # get_optimizer_state_dict would take a zero step to make one
        return to_named(model, optimizer, optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


class FullState:
    """A sharded model (and optimizer) as the checkpoint functions see a plain one: its
    `state_dict()` is the full state gathered beforehand (so only rank 0, which writes,
    calls it, after a collective gather on every rank), and `load_state_dict` takes a full
    state and keeps this rank's part (a collective too: every rank restores together)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 gathered: dict[str, Any] | None = None, strict: bool = True) -> None:
        self.model, self.optimizer, self.gathered = model, optimizer, gathered
        self.strict = strict
        """False: a model state may hold part of the model (a LoRA adapter's tensors)."""

    def state_dict(self) -> dict[str, Any]:
        """The full state gathered when this view was made."""
        if self.gathered is None:
            raise RuntimeError("gather the full state on every rank first")
        return self.gathered

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state: the model's, or the optimizer's when this views one (named
        or positional, saved by any backend on any number of ranks: `optim_state`)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=self.strict)
        if self.optimizer is None:
            set_model_state_dict(self.model, state, options=options)
            return
        state = to_named(self.model, self.optimizer, state)
        if state["state"]:  # else saved before the first step: nothing to restore
            set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


class FSDPBackend(TorchBackend):
    """`TorchBackend` with the replica sharded by FSDP2 (see the module doc)."""

    name = "fsdp"
    sharded = True

    def __init__(self, config: ExperimentConfig, dist: DistContext) -> None:
        super().__init__(config, dist)
        self.rank0_forward = False  # a forward is a collective of every rank

    def distribute(self) -> None:
        """Shard the policy in place (its compute dtype as FSDP2's mixed precision)."""
        dtype = self.compute_dtype
        shard_model(self.model, self.dist, None if dtype == torch.float32 else dtype)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The policy's float32 logits (FSDP2 gathers the weights in the compute dtype)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False).logits.float()

    def reduce_gradients(self) -> None:
        """Nothing: FSDP2 sums the gradients over the ranks in the backward pass."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """`full_model_state` (with `model.lora` the adapter's, peft names): a collective,
        complete on rank 0."""
        if not self.lora:
            return full_model_state(self.model)
        gathered = full_model_state(self.model, trainable_only=True)
        return adapter_state(self.model, gathered) if gathered else {}

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """Both full states gathered (a collective) into `FullState` views (with
        `model.lora` the adapter's under the model's names, as `AdapterCheckpoint`)."""
        model = full_model_state(self.model, trainable_only=self.lora)
        return (FullState(self.model, None, model, strict=not self.lora),
                FullState(self.model, optimizer, full_optimizer_state(self.model, optimizer)))

    def restore_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """`FullState` views that load a full state into this rank's shards."""
        return FullState(self.model, None, strict=not self.lora), FullState(self.model, optimizer)
