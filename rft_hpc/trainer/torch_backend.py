"""The torch backend with data parallelism (`trainer.backend: torch`, `parallel: ddp`).

Every rank holds a whole replica of the HF model on its device, starting from rank 0's
weights (broadcast). Each rank's loss is its rows' share of the whole batch's loss; after
the backward passes the gradients are summed over the ranks in buckets, and every rank takes
the same optimizer step, so the replicas stay identical. One process is the same backend
without a process group. A bfloat16 compute dtype runs the forward under `torch.autocast`.
With `model.lora` the replica carries a LoRA adapter, the only part that trains, is
published and checkpointed (`rft_hpc.trainer.lora`).
`FSDPBackend` (`rft_hpc.trainer.fsdp`) is this backend with the replica sharded.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine
from rft_hpc.models.lora import adapter_state
from rft_hpc.trainer.distributed import DistContext, all_reduce_gradients, broadcast_parameters
from rft_hpc.trainer.lora import AdapterCheckpoint, AdapterOff, lora_unsupported
from rft_hpc.trainer.optim_state import NamedOptimizer


class TorchBackend:
    """A whole replica per rank, gradients summed over the ranks (see the module doc)."""

    name = "ddp"
    sharded = False
    model_parallel = 1
    packs_prompts = True
    model: torch.nn.Module

    def __init__(self, config: ExperimentConfig, dist: DistContext) -> None:
        self.config, self.dist = config, dist
        self.device = dist.device
        self.compute_dtype = compute_dtype(config.trainer.dtype, self.device)
        self.rank0_forward = True
        self.lora = config.model.lora is not None
        """Train a LoRA adapter on the frozen model (`model.lora`)."""
        self.shared_reference: torch.nn.Module | None = None
        """The reference when it is the policy with its adapter off (its forward, like the
        policy's, is then a collective under FSDP)."""
        problem = lora_unsupported(config, self.sharded)
        if problem:
            raise UserError(problem)

    def place(self, hf_model: torch.nn.Module) -> None:
        """Every rank keeps the whole model on its device."""
        if self.device.type != "cpu":
            hf_model.to(self.device)

    def build(self, engine: HFEngine, reference: bool) -> torch.nn.Module | None:
        """Train `engine.model` itself, with rank 0's weights; the reference is a copy, or
        with `model.lora` the model with a fresh adapter, the reference the adapter off."""
        if self.lora:
            engine.enable_lora(self.config.run.seed)
        model = engine.model
        broadcast_parameters(model, self.dist)
        model.train()
        if self.config.trainer.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        if not reference:
            return None
        if self.lora:
            self.shared_reference = AdapterOff(model)
            return self.shared_reference
        return frozen_copy(model)

    def distribute(self) -> None:
        """Nothing: every rank keeps its whole replica."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The policy's float32 logits, under autocast to a compute dtype below float32."""
        with self.autocast():
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False).logits.float()

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype when it is below float32 (else nothing)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def idle_pass(self, pad_id: int) -> None:
        """A zero-loss pass of one token (see `idle_pass`), with the reference's forward
        where that is the policy's (a rank's loss passes run both)."""
        idle_pass(self.model, self.device, pad_id, self.shared_reference)

    def reduce_gradients(self) -> None:
        """Sum the gradients over all ranks (a collective; nothing for one process)."""
        all_reduce_gradients(self.model.parameters(), self.dist)

    def clip_gradients(self, max_norm: float) -> float:
        """`torch.nn.utils.clip_grad_norm_` over the policy's parameters."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The replica's own state dict, or with `model.lora` the adapter's (peft names)."""
        return adapter_state(self.model) if self.lora else self.model.state_dict()

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """The model (with `model.lora` its adapter) and the optimizer, its state keyed by
        parameter names (`NamedOptimizer`: FSDP's layout, so any rank count resumes it)."""
        return ((AdapterCheckpoint(self.model) if self.lora else self.model),
                NamedOptimizer(self.model, optimizer))

    def restore_parts(self, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """The model (with `model.lora` its adapter) and the optimizer, which loads a state
        saved by either torch backend on any number of ranks."""
        return self.checkpoint_parts(optimizer)


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype `trainer.dtype` means on `device` (auto: bfloat16 on GPUs, else float32)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (the reference policy of KL terms and DPO)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def idle_pass(model: torch.nn.Module, device: torch.device, token: int,
              reference: torch.nn.Module | None = None) -> None:
    """A forward and backward of one token with a zero loss: a rank with no micro-batch left
    takes part in the others' gathers and reductions, adding nothing to the gradients. With
    `reference`, its forward runs between the two, where a loss pass runs it."""
    ids = torch.tensor([[token]], device=device)
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    if reference is not None:
        with torch.no_grad():
            reference(input_ids=ids, attention_mask=mask, use_cache=False)
    (logits.float().sum() * 0.0).backward()
