"""The algorithm a trainer runs, resolved from the config: presets, plug-ins, defaults.

`AlgorithmPlan.of(config)` turns the `algorithm` section into the functions and keyword
arguments each step calls, so a typo in a function name or an argument fails when the
trainer starts, not at its first step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rft_hpc.algorithms.off_policy import Correction
from rft_hpc.algorithms.registry import REFERENCE_LOSSES, resolve_advantage, resolve_policy_loss
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError

PRESETS: dict[str, tuple[str | None, str]] = {
    # algorithm_type: (advantage_fn, policy_loss_fn), as Trinity-RFT's presets
    "grpo": ("grpo", "ppo"),
    "ppo": ("ppo", "ppo"),
    "rloo": ("rloo", "ppo"),
    "reinforceplusplus": ("reinforceplusplus", "ppo"),
    "opmd": ("opmd", "opmd"),
    "sft": (None, "sft"),
    "dpo": (None, "dpo"),
    "mix": ("grpo", "mix"),
    # GRPO's group advantages with each paper's loss (docs/algorithms.md)
    "gspo": ("grpo", "gspo"),
    "dr_grpo": ("grpo", "ppo"),
    "cispo": ("grpo", "cispo"),
    "sapo": ("grpo", "sapo"),
    "clip_cov": ("grpo", "clip_cov"),
    "kl_cov": ("grpo", "kl_cov"),
    "remax": ("remax", "ppo"),
    # a teacher's per-token log-probs of the student's own rollouts as the advantage
    "on_policy_distill": ("on_policy_distill", "ppo"),
    # offline preference losses without a reference model
    "simpo": (None, "simpo"),
    "orpo": (None, "orpo"),
    # offline, each response of a pair judged on its own against a reference point
    "kto": (None, "kto"),
}
"""The advantage function (None: none) and policy loss of each `algorithm_type`."""

PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "gspo": {"loss_agg_mode": "seq-mean-token-mean"},
    # Dr. GRPO (Liu et al. 2025): no division by the group's std, and each response's token
    # sum over a constant length instead of its own length
    "dr_grpo": {"advantage_fn_args": {"std_normalize": False},
                "loss_agg_mode": "seq-mean-token-sum-norm"},
    "sapo": {"loss_agg_mode": "seq-mean-token-mean"},
}
"""What a preset sets unless the config says otherwise: its paper's aggregation
(`loss_agg_mode`) and advantage arguments (merged under the config's own)."""

DEFAULT_KL_COEF = 0.001
DEFAULT_ENTROPY_COEF = 0.001


@dataclass(frozen=True)
class AlgorithmPlan:
    """What one trainer step computes, with every default filled in."""

    type: str
    advantage_fn: str | None
    advantage_args: dict[str, Any]
    policy_loss_fn: str
    policy_loss_args: dict[str, Any]
    loss_agg_mode: str
    kl_penalty: str | None = None
    kl_penalty_coef: float = 0.0
    kl_loss: str | None = None
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    critic_lr: float | None = None
    """Set for algorithms with a critic (GAE advantages)."""
    cliprange_value: float | None = 0.5
    correction: Correction = field(default_factory=Correction)
    """Off-policy correction of the policy loss (`algorithms.off_policy`)."""
    correction_window: int = 1
    """Versions of its own weights the trainer keeps for the correction's log-probs."""
    norm_tokens: float | None = None
    """The constant of `seq-mean-token-sum-norm` (`LossNorm.max_tokens`): the most trained
    tokens a rollout can have (`explorer.max_new_tokens`, times `max_turns` of a multi-turn
    workflow), so that the loss's scale is the same from batch to batch."""

    @property
    def is_rl(self) -> bool:
        """True when the batch holds scored rollouts that get advantages."""
        return self.advantage_fn is not None

    @property
    def needs_reference(self) -> bool:
        """True when a frozen copy of the starting policy is needed (KL, DPO)."""
        return bool(self.kl_penalty or self.kl_loss or self.type == "dpo"
                    or self.policy_loss_fn in REFERENCE_LOSSES)

    @classmethod
    def of(cls, config: ExperimentConfig) -> AlgorithmPlan:
        """Resolve the algorithm of `config` (raises `UserError` for unknown names or
        arguments the chosen functions do not take)."""
        alg = config.algorithm
        adv_name, loss_name = PRESETS[alg.algorithm_type]
        preset = PRESET_DEFAULTS.get(alg.algorithm_type, {})
        if adv_name is not None and alg.advantage_fn is not None:
            adv_name = alg.advantage_fn
        loss_name = alg.policy_loss_fn or loss_name
        adv_args = {**preset.get("advantage_fn_args", {}), **alg.advantage_fn_args} \
            if alg.advantage_fn is None else dict(alg.advantage_fn_args)
        if adv_name is not None:
            _check_args(resolve_advantage(adv_name), adv_args, "advantage_fn", skip=1)
        agg = alg.loss_agg_mode if "loss_agg_mode" in alg.model_fields_set \
            else preset.get("loss_agg_mode", alg.loss_agg_mode)
        loss_fn = resolve_policy_loss(loss_name)
        loss_args = dict(alg.policy_loss_fn_args)
        if "loss_agg_mode" in _parameters(loss_fn):
            loss_args["loss_agg_mode"] = agg
        _check_args(loss_fn, loss_args, "policy_loss_fn", skip=1)
        kl_loss, kl_loss_coef = None, 0.0
        if alg.kl_loss_fn != "none":
            kl_loss = alg.kl_loss_fn
            kl_loss_coef = _coef(alg.kl_loss_fn_args, "kl_loss_fn_args", "kl_coef",
                                 DEFAULT_KL_COEF)
        kl_penalty, kl_penalty_coef = None, 0.0
        if alg.kl_penalty_fn != "none":
            kl_penalty = alg.kl_penalty_fn
            kl_penalty_coef = _coef(alg.kl_penalty_fn_args, "kl_penalty_fn_args", "kl_coef",
                                    DEFAULT_KL_COEF)
            if adv_name is None:
                raise UserError(f"algorithm.kl_penalty_fn: {alg.algorithm_type} has no "
                                "rewards to put a KL penalty into")
        entropy = 0.0
        if alg.entropy_loss_fn != "none":
            entropy = _coef(alg.entropy_loss_fn_args, "entropy_loss_fn_args", "entropy_coef",
                            DEFAULT_ENTROPY_COEF)
        critic = adv_name in ("ppo", "gae")
        c = alg.correction
        correction = Correction.of(c.type, c.level, c.cap, c.low, c.high)
        if correction.on and (adv_name is None or loss_name in ("opmd", "sft", "dpo")):
            raise UserError(f"algorithm.correction.type {c.type}: the {loss_name} loss takes "
                            "no ratio to the rollout policy to correct (use ppo or mix, or "
                            "correction.type none)")
        return cls(type=alg.algorithm_type, advantage_fn=adv_name, advantage_args=adv_args,
                   policy_loss_fn=loss_name, policy_loss_args=loss_args,
                   loss_agg_mode=agg, kl_penalty=kl_penalty,
                   kl_penalty_coef=kl_penalty_coef, kl_loss=kl_loss, kl_loss_coef=kl_loss_coef,
                   entropy_coef=entropy,
                   critic_lr=(alg.critic_lr or config.trainer.lr) if critic else None,
                   cliprange_value=alg.cliprange_value, correction=correction,
                   correction_window=_version_window(config),
                   norm_tokens=_norm_tokens(config))


def _norm_tokens(config: ExperimentConfig) -> float:
    """The most trained tokens one rollout can have (`AlgorithmPlan.norm_tokens`)."""
    turns = getattr(config.explorer.workflow, "max_turns", 1)
    return float(config.explorer.max_new_tokens * turns)


def _version_window(config: ExperimentConfig) -> int:
    """`algorithm.correction.version_window`, or the most versions a rollout can lag."""
    window = config.algorithm.correction.version_window
    if window is not None:
        return window
    if config.buffer.max_staleness is not None:
        return config.buffer.max_staleness
    return (config.sync.offset + 1) * config.sync.interval


def _parameters(fn: Callable[..., object]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: accept anything
        return {}


def _check_args(fn: Callable[..., object], args: dict[str, Any], key: str, skip: int) -> None:
    params = list(_parameters(fn).values())[skip:]
    if not params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params}
    unknown = sorted(set(args) - names)
    if unknown:
        raise UserError(f"algorithm.{key}_args: {', '.join(unknown)} not taken by "
                        f"{getattr(fn, '__name__', fn)}; it takes {', '.join(sorted(names))}")


def _coef(args: dict[str, Any], key: str, name: str, default: float) -> float:
    unknown = sorted(set(args) - {name})
    if unknown:
        raise UserError(f"algorithm.{key}: unknown {', '.join(unknown)}; only {name}")
    value = args.get(name, default)
    if not isinstance(value, int | float) or value < 0:
        raise UserError(f"algorithm.{key}.{name} must be a number >= 0, got {value!r}")
    return float(value)
