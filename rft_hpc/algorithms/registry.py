"""Advantage functions and policy losses by name, extended by users through import paths.

Names are Trinity-RFT's (`advantage_fn`, `policy_loss_fn`). A user's function is given as
`"package.module:function"` and must follow the same contract as the built-in ones:

- advantage: `fn(batch: AdvantageBatch, **advantage_fn_args) -> Advantages`;
- policy loss: `fn(inputs: PolicyLossInputs, **policy_loss_fn_args) -> (loss, metrics)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rft_hpc.algorithms import advantages, kto, policy_losses, preference_losses, ratio_losses
from rft_hpc.algorithms.advantages import AdvantageBatch, Advantages
from rft_hpc.algorithms.policy_losses import PolicyLossInputs
from rft_hpc.core.plugins import register, resolve

AdvantageFn = Callable[..., Advantages]
"""`(AdvantageBatch, **params) -> Advantages`"""
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""`(PolicyLossInputs, **params) -> (loss, metrics)`"""

ADVANTAGES: dict[str, AdvantageFn] = {
    "ppo": advantages.gae,  # Trinity-RFT's name for GAE with a critic
    "gae": advantages.gae,
    "grpo": advantages.grpo,
    "rloo": advantages.rloo,
    "reinforceplusplus": advantages.reinforce_plus_plus,  # Trinity-RFT's spelling
    "reinforce_plus_plus": advantages.reinforce_plus_plus,  # verl's
    "opmd": advantages.opmd,
    "remax": advantages.remax,
    "on_policy_distill": advantages.on_policy_distill,
}

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": policy_losses.ppo_policy_loss,
    "opmd": policy_losses.opmd_policy_loss,
    "sft": policy_losses.sft_policy_loss,
    "dpo": policy_losses.dpo_loss,
    "mix": policy_losses.mix_policy_loss,
    "gspo": ratio_losses.gspo_policy_loss,
    "cispo": ratio_losses.cispo_policy_loss,
    "sapo": ratio_losses.sapo_policy_loss,
    "clip_cov": ratio_losses.clip_cov_policy_loss,
    "kl_cov": ratio_losses.kl_cov_policy_loss,
    "simpo": preference_losses.simpo_loss,
    "orpo": preference_losses.orpo_loss,
    "kto": kto.kto_loss,
}

PAIR_LOSSES = frozenset({"dpo", "simpo", "orpo", "kto"})
"""The losses that train on preference pairs (rows interleaved chosen, rejected; KTO's
three rows per pair: `batch.tokens.collate_kto`)."""
REFERENCE_LOSSES = frozenset({"dpo", "kto"})
"""The losses that read the frozen starting policy's log-probs (`ref_logp`)."""


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make an advantage function available as `advantage_fn: <name>`."""
    return register(ADVANTAGES, name)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a policy loss available as `policy_loss_fn: <name>`."""
    return register(POLICY_LOSSES, name)


def resolve_advantage(name: str) -> AdvantageFn:
    """The advantage function `name`: registered, or "package.module:function".

    Unknown names and failed imports raise `UserError` (listing the registered names).
    """
    return resolve(name, ADVANTAGES, "advantage function")


def resolve_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss `name`: registered, or "package.module:function".

    Unknown names and failed imports raise `UserError` (listing the registered names).
    """
    return resolve(name, POLICY_LOSSES, "policy loss")


def compute_advantages(name: str, batch: AdvantageBatch, **params: object) -> Advantages:
    """Resolve `name` and apply it to `batch` with `params`; checks the result's shapes."""
    out = resolve_advantage(name)(batch, **params)
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"advantage function {name!r} must return Advantages(advantages, "
                        f"returns), got {type(out).__name__}")
    out = Advantages(*out)
    for field, tensor in zip(Advantages._fields, out, strict=True):
        if tuple(tensor.shape) != tuple(batch.mask.shape):
            raise ValueError(f"advantage function {name!r} returned {field} of shape "
                             f"{tuple(tensor.shape)}, expected {tuple(batch.mask.shape)}")
    return out


def compute_policy_loss(name: str, inputs: PolicyLossInputs,
                        **params: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Resolve `name` and apply it to `inputs` with `params`."""
    return resolve_policy_loss(name)(inputs, **params)
