"""The `algorithm` section: which advantage, policy loss, KL and entropy terms the trainer
combines (Trinity-RFT's `algorithm:` keys).

`algorithm_type` picks a preset (the advantage function and policy loss of GRPO, PPO, ...);
every other key refines it. The `trainer` shorthands of earlier versions (`algorithm`,
`clip_ratio`, `kl_coef`) are refused with their names here (`rft_hpc.config.renamed`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rft_hpc.config.paths import ConfigPath
from rft_hpc.core.config_section import ConfigSection

AlgorithmType = Literal["grpo", "ppo", "rloo", "reinforceplusplus", "opmd", "sft", "dpo", "mix",
                        "reward_model", "gspo", "dr_grpo", "cispo", "sapo", "clip_cov",
                        "kl_cov", "simpo", "orpo", "remax", "on_policy_distill", "kto"]
GROUP_ADVANTAGE_TYPES = ("grpo", "rloo", "opmd", "mix", "gspo", "dr_grpo", "cispo", "sapo",
                         "clip_cov", "kl_cov")
"""The presets whose advantages compare the rollouts of one task (`explorer.repeat` >= 2)."""
KLFn = Literal["none", "k1", "k2", "k3", "low_var_kl", "abs"]
LossAggModeName = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                          "seq-mean-token-sum-norm"]


class CorrectionConfig(ConfigSection):
    """Off-policy correction of the policy loss between the explorer's recorded log-probs
    and the trainer's log-probs of the same tokens under the weights the rollout was
    generated for (`rft_hpc.algorithms.off_policy`, docs/algorithms.md). For losses that
    take a ratio to the rollout policy (`ppo`, `mix`)."""

    type: Literal["none", "tis", "mis", "icepop", "geo_mask"] = "none"
    """`tis` truncated importance sampling, `mis` masked importance sampling, `icepop`
    token masking outside `[low, high]`, `geo_mask` a mask of the rollouts whose
    geometric-mean ratio lies outside `[low, high]`; `none`: off (the PPO ratio is then
    taken against the recorded log-probs)."""

    level: Literal["token", "sequence"] = "token"
    """For `tis` and `mis`: a ratio per token, or one per rollout (the product of its
    tokens' ratios)."""

    cap: float = Field(2.0, gt=0.0)
    """For `tis` and `mis`: the largest weight (`tis`) or ratio kept (`mis`)."""

    low: float | None = Field(None, ge=0.0)
    """For `icepop` and `geo_mask`: the smallest ratio kept; null: 0.5 (`icepop`), 0.99
    (`geo_mask`)."""

    high: float | None = Field(None, gt=0.0)
    """For `icepop` and `geo_mask`: the largest ratio kept; null: 5.0 (`icepop`), 1.01
    (`geo_mask`)."""

    version_window: int | None = Field(None, ge=0)
    """Versions of the trainer's own weights it keeps in host memory (a copy of the model
    each) to compute the log-probs of rollouts generated with them; a rollout of an older
    version (or one from before a restart) is computed with the current weights and counted
    in `correction/unknown_version_records`. null: as many as a rollout can lag,
    `buffer.max_staleness` when set, else `(sync.offset + 1) * sync.interval`."""

    @model_validator(mode="after")
    def _level_applies(self) -> CorrectionConfig:
        if self.level == "sequence" and self.type not in ("tis", "mis"):
            raise ValueError(f"level: sequence is for tis and mis; {self.type} has one level")
        return self


class AlgorithmConfig(ConfigSection):
    """The RFT algorithm (Trinity-RFT's `algorithm` section): a preset by `algorithm_type`,
    refined by the other keys. Names of functions are registered names or user plug-ins
    given as `package.module:function` (docs/algorithms.md)."""

    algorithm_type: AlgorithmType = "grpo"
    """The preset: `grpo`, `ppo` (GAE with a critic), `rloo`, `reinforceplusplus`, `opmd`,
    `sft`, `dpo` (pairs from the buffer, against the frozen starting policy), `mix` (GRPO
    on rollouts plus SFT on expert samples of the same batch), `reward_model` (a scalar
    head on the model trained on preference pairs with the Bradley-Terry loss,
    docs/reward-models.md), or GRPO's advantages with another paper's loss: `gspo`
    (sequence-level ratio), `dr_grpo` (no std division, constant-length sums), `cispo`
    (clipped, detached importance weights), `sapo` (a soft gate for the clip), `clip_cov`
    and `kl_cov` (covariance-selected tokens cut or KL-penalised); or, on preference pairs,
    `simpo` and `orpo` (no reference model) and `kto` (each response judged on its own
    against the frozen starting policy: chosen desirable, rejected not); or `remax` (each
    reward minus that of the greedy response to the same prompt, which the explorer
    generates); or `on_policy_distill` (a teacher model's per-token log-probs of the
    student's own rollouts as the signal, `teacher_model`); docs/algorithms.md. A stage
    that sets it starts from that preset's defaults."""

    advantage_fn: str | None = None
    """Advantage function (`grpo`, `ppo`/`gae`, `rloo`, `reinforceplusplus`, `opmd`,
    `remax`, `on_policy_distill`, or `package.module:function`); null: the preset's."""

    advantage_fn_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the advantage function (e.g. `epsilon`, `std_normalize` for grpo;
    `gamma`, `lam` for ppo; `kl_coef`, `reward_weight` for on_policy_distill)."""

    teacher_model: ConfigPath | None = None
    """A model folder (Hugging Face layout, the policy's tokenizer) whose log-prob of each
    token of every rollout the explorers record (`teacher_logprobs`, docs/buffer-format.md):
    on-policy distillation's signal. Required by `on_policy_distill`; with another
    algorithm, a plug-in advantage function reads them (`AdvantageBatch.teacher_logprobs`)."""

    policy_loss_fn: str | None = None
    """Policy loss (`ppo`, `opmd`, `sft`, `dpo`, `mix`, or `package.module:function`);
    null: the preset's."""

    policy_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the policy loss (e.g. `clip_range`, `clip_range_high`,
    `clip_ratio_c` for ppo; `beta` for dpo; `mu` for mix); `clip_range` is 0.2 unless
    given. The loss aggregates as this section's `loss_agg_mode` says."""

    kl_penalty_fn: KLFn = "none"
    """KL to the frozen starting policy subtracted from the reward, per token, before the
    advantages are computed (`k1`, `k2`, `k3`, `low_var_kl`, `abs`; `none`: off)."""

    kl_penalty_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`kl_coef` (default 0.001) of the KL in the reward."""

    kl_loss_fn: KLFn = "none"
    """KL to the frozen starting policy added to the loss (`k1`, `k2`, `k3`, `low_var_kl`,
    `abs`; `none`: off)."""

    kl_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`kl_coef` (default 0.001) of the KL in the loss."""

    entropy_loss_fn: Literal["none", "default"] = "none"
    """`default`: add `-entropy_coef * entropy` of the policy's next-token distributions to
    the loss (an exploration bonus); `none`: off."""

    entropy_loss_fn_args: dict[str, Any] = Field(default_factory=dict)
    """`entropy_coef` (default 0.001) of the entropy bonus."""

    loss_agg_mode: LossAggModeName = "token-mean"
    """How per-token losses become one number (policy, KL, entropy and value losses):
    `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`, `seq-mean-token-sum-norm`."""

    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Off-policy correction of the policy loss (asynchronous runs, engine mismatch)."""

    critic_lr: float | None = Field(None, gt=0.0)
    """Learning rate of the PPO critic (value head on a copy of the policy); null:
    `trainer.lr`."""

    cliprange_value: float | None = Field(0.5, gt=0.0)
    """Clip range of the PPO critic's value loss around its earlier predictions; null: no
    clipping."""

    @model_validator(mode="after")
    def _distillation_has_a_teacher(self) -> AlgorithmConfig:
        if self.teacher_model is None and "on_policy_distill" in (
                self.algorithm_type, self.advantage_fn):
            raise ValueError("on_policy_distill learns from a teacher: set "
                             "algorithm.teacher_model to the teacher's model folder")
        return self

    def uses_greedy_baseline(self) -> bool:
        """Whether the advantage is ReMax's, whose baseline is the reward of a greedy response
        to each prompt: the explorer then generates and scores one per group."""
        name = self.advantage_fn or ("remax" if self.algorithm_type == "remax" else None)
        return name == "remax"
