"""The `algorithm` section: which advantage, policy loss, KL and entropy terms the trainer
combines (Trinity-RFT's `algorithm:` keys), and how it relates to the `trainer` shorthands.

`algorithm_type` picks a preset (the advantage function and policy loss of GRPO, PPO, ...);
every other key refines it. `trainer.algorithm` is the same knob as `algorithm_type` (both
are kept equal, see `sync_algorithm_type`), `trainer.clip_ratio` the default clip range of
the PPO-style losses and `trainer.kl_coef` a shorthand for a k3 KL term in the loss.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rft_hpc.core.config_section import ConfigSection

AlgorithmType = Literal["grpo", "ppo", "rloo", "reinforceplusplus", "opmd", "sft", "dpo", "mix"]
KLFn = Literal["none", "k1", "k2", "k3", "low_var_kl", "abs"]
LossAggModeName = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                          "seq-mean-token-sum-norm"]


class AlgorithmConfig(ConfigSection):
    """The RFT algorithm (Trinity-RFT's `algorithm` section): a preset by `algorithm_type`,
    refined by the other keys. Names of functions are registered names or user plug-ins
    given as `package.module:function` (docs/algorithms.md)."""

    algorithm_type: AlgorithmType = "grpo"
    """The preset: `grpo`, `ppo` (GAE with a critic), `rloo`, `reinforceplusplus`, `opmd`,
    `sft`, `dpo` (pairs from the buffer, against the frozen starting policy) or `mix` (GRPO
    on rollouts plus SFT on expert samples of the same batch). Same knob as
    `trainer.algorithm`; a stage that sets either one starts from that preset's defaults."""

    advantage_fn: str | None = None
    """Advantage function (`grpo`, `ppo`/`gae`, `rloo`, `reinforceplusplus`, `opmd`, or
    `package.module:function`); null: the preset's."""

    advantage_fn_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the advantage function (e.g. `epsilon`, `std_normalize` for grpo;
    `gamma`, `lam` for ppo)."""

    policy_loss_fn: str | None = None
    """Policy loss (`ppo`, `opmd`, `sft`, `dpo`, `mix`, or `package.module:function`);
    null: the preset's."""

    policy_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the policy loss (e.g. `clip_range`, `clip_range_high`,
    `clip_ratio_c` for ppo; `beta` for dpo; `mu` for mix). `clip_range` defaults to
    `trainer.clip_ratio`; `loss_agg_mode` to this section's."""

    kl_penalty_fn: KLFn = "none"
    """KL to the frozen starting policy subtracted from the reward, per token, before the
    advantages are computed (`k1`, `k2`, `k3`, `low_var_kl`, `abs`; `none`: off)."""

    kl_penalty_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`kl_coef` (default 0.001) of the KL in the reward."""

    kl_loss_fn: KLFn = "none"
    """KL to the frozen starting policy added to the loss (`k1`, `k2`, `k3`, `low_var_kl`,
    `abs`; `none`: off, or `k3` when `trainer.kl_coef` > 0)."""

    kl_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`kl_coef` of the KL in the loss (default `trainer.kl_coef` when > 0, else 0.001)."""

    entropy_loss_fn: Literal["none", "default"] = "none"
    """`default`: add `-entropy_coef * entropy` of the policy's next-token distributions to
    the loss (an exploration bonus); `none`: off."""

    entropy_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`entropy_coef` (default 0.001) of the entropy bonus."""

    loss_agg_mode: LossAggModeName = "token-mean"
    """How per-token losses become one number (policy, KL, entropy and value losses):
    `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`, `seq-mean-token-sum-norm`."""

    critic_lr: float | None = Field(None, gt=0.0)
    """Learning rate of the PPO critic (value head on a copy of the policy); null:
    `trainer.lr`."""

    cliprange_value: float | None = Field(0.5, gt=0.0)
    """Clip range of the PPO critic's value loss around its earlier predictions; null: no
    clipping."""


def sync_algorithm_type(data: Any) -> Any:
    """Make `trainer.algorithm` and `algorithm.algorithm_type` of a raw config (or stage)
    mapping agree: the one given fills the other; both given and different is an error.

    Run before validation, so that a stage naming either one carries both, and its
    `algorithm` section (naming `algorithm_type`) replaces the base config's whole.
    """
    if not isinstance(data, dict):
        return data
    trainer, section = data.get("trainer"), data.get("algorithm")
    short = trainer.get("algorithm") if isinstance(trainer, dict) else None
    full = section.get("algorithm_type") if isinstance(section, dict) else None
    if short is not None and full is not None and short != full:
        raise ValueError(f"trainer.algorithm is {short!r} but algorithm.algorithm_type is "
                         f"{full!r}: they are the same setting, give one of them")
    if short is not None and full is None and isinstance(short, str):
        data = {**data, "algorithm": {**(section if isinstance(section, dict) else {}),
                                      "algorithm_type": short}}
    elif full is not None and short is None and isinstance(full, str):
        data = {**data, "trainer": {**(trainer if isinstance(trainer, dict) else {}),
                                    "algorithm": full}}
    return data
