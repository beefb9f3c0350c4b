"""The RFT algorithm library: advantages, policy losses, KL, aggregation, PPO critic, registry."""

from rft_hpc.algorithms.advantages import (
    AdvantageBatch,
    Advantages,
    gae,
    grpo,
    grpo_advantages,
    opmd,
    reinforce_plus_plus,
    rloo,
)
from rft_hpc.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossNorm,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from rft_hpc.algorithms.kl import (
    KL_KINDS,
    entropy_bonus,
    kl_loss,
    kl_per_token,
    kl_reward_penalty,
    token_entropy,
)
from rft_hpc.algorithms.policy_losses import (
    PolicyLossInputs,
    dpo_loss,
    dpo_sequence_logps,
    mix_policy_loss,
    opmd_policy_loss,
    ppo_policy_loss,
    sft_policy_loss,
)
from rft_hpc.algorithms.registry import (
    ADVANTAGES,
    POLICY_LOSSES,
    compute_advantages,
    compute_policy_loss,
    register_advantage,
    register_policy_loss,
    resolve_advantage,
    resolve_policy_loss,
)
from rft_hpc.algorithms.value import ValueHeadModel, value_loss

__all__ = [
    "ADVANTAGES", "KL_KINDS", "LOSS_AGG_MODES", "POLICY_LOSSES", "AdvantageBatch", "Advantages",
    "LossNorm", "PolicyLossInputs", "ValueHeadModel", "aggregate_loss", "compute_advantages",
    "compute_policy_loss", "dpo_loss", "dpo_sequence_logps", "entropy_bonus", "gae", "grpo",
    "grpo_advantages", "kl_loss", "kl_per_token", "kl_reward_penalty", "masked_mean",
    "masked_sum", "masked_whiten", "mix_policy_loss", "opmd", "opmd_policy_loss",
    "ppo_policy_loss", "register_advantage", "register_policy_loss", "reinforce_plus_plus",
    "resolve_advantage", "resolve_policy_loss", "rloo", "sft_policy_loss", "token_entropy",
    "value_loss",
]
