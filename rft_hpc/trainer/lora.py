"""LoRA training on the torch backend (`model.lora`): what changes against whole-model
training.

- The policy is the HF model with a peft adapter (`HFEngine.enable_lora`); the base is
  loaded once and frozen, so only the adapter's parameters get gradients and optimizer state.
- The reference policy of KL terms and DPO is the same model with the adapter switched off
  (`AdapterOff`): no second copy of the model is held.
- What is published is the adapter alone (peft names); what is checkpointed is the adapter
  under the model's own parameter names (`AdapterCheckpoint`), beside the optimizer state
  of the adapter's parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.models.lora import ADAPTER_PARTS, adapter_state, model_names
from rft_hpc.trainer.algorithm import AlgorithmPlan


class AdapterOff(torch.nn.Module):
    """The adapted policy with its adapter switched off, called like a model: the frozen
    base, i.e. the starting policy (a fresh adapter adds nothing). Runs in eval mode, as a
    frozen copy would; under FSDP each call is a collective, as the policy's forward is."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        # not a submodule: its parameters are the policy's, which this must never move,
        # switch to eval mode or hand to an optimizer
        self._policy = (model,)

    # Any: the HF forward's keyword arguments and output, passed through as they are
    def forward(self, **inputs: Any) -> Any:
        """The base model's output for `inputs` (keyword arguments of the HF forward)."""
        model = self._policy[0]
        was_training = model.training
        model.eval()
        try:
            with model.disable_adapter():
                return model(**inputs)
        finally:
            model.train(was_training)


class AdapterCheckpoint:
    """The adapter of a (not sharded) adapted model as the checkpoint functions see a model:
    `state_dict()` holds the adapter's tensors under the model's parameter names, and
    `load_state_dict` loads exactly those back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (model names, `.lora_A.default.weight`)."""
        return model_names(adapter_state(self.model))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an adapter saved by `state_dict`; every adapter tensor must be there."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        lost = [k for k in missing if any(p in k for p in ADAPTER_PARTS)]
        if unexpected or lost:
            raise ValueError(f"the checkpoint's adapter does not fit the model: missing "
                             f"{lost[:3]}, unexpected {list(unexpected)[:3]}")


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or with an adapter the adapter's."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_unsupported(config: ExperimentConfig, sharded: bool) -> str | None:
    """Why `config` cannot train a LoRA adapter (`model.lora`), or None when it can.
    `sharded`: the trainer's forward is a collective of every rank (FSDP on several ranks)."""
    if config.model.lora is None:
        return None
    if config.trainer.backend == "megatron":
        return ("model.lora trains a LoRA adapter on trainer.backend torch only; the megatron "
                "backend has no adapters yet: set trainer.backend: torch (ddp or fsdp) or "
                "remove model.lora")
    plan = AlgorithmPlan.of(config)
    if plan.critic_lr is not None:
        return (f"model.lora with algorithm {plan.type}: its critic (a value head on a second "
                "copy of the model) has no LoRA support yet; use an algorithm without a critic "
                "(grpo, rloo, reinforceplusplus, opmd) or remove model.lora")
    if sharded and plan.kl_penalty is not None:
        return ("model.lora under trainer.parallel fsdp with algorithm.kl_penalty_fn: rank 0 "
                "would run the sharded reference (the model with its adapter off) alone; use "
                "kl_loss_fn (a KL term in the loss) or trainer.parallel: ddp")
    return None
