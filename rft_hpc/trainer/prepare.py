"""What a trainer step computes over the whole batch before it is split among the ranks.

Advantages (group statistics, whitening), the KL penalty in the reward, the critic's values
and the loss divisors (`LossNorm`) depend on the whole batch, so rank 0 computes them here
and each rank receives its rows with its `Shard`; everything else is per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rft_hpc.algorithms.advantages import AdvantageBatch
from rft_hpc.algorithms.aggregation import LossNorm, masked_mean
from rft_hpc.algorithms.kl import kl_reward_penalty
from rft_hpc.algorithms.off_policy import correction_weights
from rft_hpc.algorithms.registry import PAIR_LOSSES, compute_advantages
from rft_hpc.algorithms.value import ValueHeadModel
from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import KTO_ROWS_PER_PAIR, TokenBatch, collate, collate_dpo, collate_kto
from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import DPOPair, Experience, Record, SFTSample
from rft_hpc.core.errors import UserError
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.distributed import Shard, shard_batch
from rft_hpc.trainer.versions import PolicyVersions

PAIR_LAYOUTS: dict[str, tuple[Callable[..., TokenBatch], int]] = {
    "kto": (collate_kto, KTO_ROWS_PER_PAIR)}
"""The pair losses whose pairs collate otherwise than DPO's two rows: the loss's name ->
(its collate function, rows per pair)."""


def pair_layout(plan: AlgorithmPlan) -> tuple[Callable[..., TokenBatch], int]:
    """How the plan's loss collates a preference pair, and into how many rows (the
    micro-batch budget counts them)."""
    return PAIR_LAYOUTS.get(plan.policy_loss_fn, (collate_dpo, 2))


def collate_for(plan: AlgorithmPlan, records: Sequence[Record], pad_id: int) -> TokenBatch:
    """The records as the plan's loss reads them: preference pairs as `pair_layout` lays
    them out, else one row per record; refuses records the algorithm cannot train on."""
    if plan.type == "dpo" or plan.policy_loss_fn in PAIR_LOSSES:
        if not all(isinstance(r, DPOPair) for r in records):
            raise UserError(f"{plan.policy_loss_fn} trains on preference pairs; the buffer "
                            "holds other records (import pairs with `rft-hpc buffer import "
                            "--kind dpo`)")
        pairs, _ = pair_layout(plan)
        return pairs(records, pad_id=pad_id)
    if any(isinstance(r, DPOPair) for r in records):
        raise UserError(f"{plan.type} cannot train on DPO pairs found in the buffer")
    if plan.is_rl and plan.type != "mix" and not all(isinstance(r, Experience)
                                                     for r in records):
        raise UserError(f"{plan.type} trains on scored rollouts; the buffer holds SFT samples "
                        "(use algorithm_type mix to train on both)")
    return with_known_logprobs(collate(records, pad_id=pad_id), records)  # type: ignore[arg-type]


def expert_rows(records: Sequence[Record]) -> torch.Tensor:
    """[B] bool: the rows that are expert (SFT) samples rather than rollouts (MIX)."""
    return torch.tensor([isinstance(r, SFTSample) for r in records], dtype=torch.bool)


def old_logprobs(tb: TokenBatch, policy_logp: torch.Tensor) -> torch.Tensor:
    """The rollout log-probs of `tb`, with `policy_logp` (detached) for records imported
    without them: such records count as on-policy."""
    old = tb.old_logprobs
    if tb.has_old_logprobs is not None and not bool(tb.has_old_logprobs.all()):
        old = torch.where(tb.has_old_logprobs.unsqueeze(1), old, policy_logp.detach())
    return old


def _experience_view(tb: TokenBatch, records: Sequence[Record], rows: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and group ids of the rollout rows `rows` (an index tensor)."""
    picked = [records[i] for i in rows.tolist()]
    if tb.rewards is not None and len(picked) == len(records):
        return tb.rewards, tb.group_ids  # type: ignore[return-value]
    return (torch.tensor([r.reward for r in picked], dtype=torch.float32),
            torch.tensor([r.group_id for r in picked], dtype=torch.long))


class BatchPreparer:
    """Rank 0's whole-batch computations for one algorithm (see the module doc)."""

    def __init__(self, plan: AlgorithmPlan, policy: torch.nn.Module | None,
                 reference: torch.nn.Module | None, critic: ValueHeadModel | None,
                 temperature: float, pad_id: int, device: torch.device) -> None:
        self.plan, self.policy, self.reference, self.critic = plan, policy, reference, critic
        self.temperature, self.pad_id, self.device = temperature, pad_id, device
        self.versions: PolicyVersions | None = None
        """The trainer's recent weights, for the off-policy correction."""
        if plan.correction.on:
            if policy is None:
                raise UserError("algorithm.correction needs the whole policy on rank 0: "
                                "trainer.parallel ddp with trainer.backend torch")
            self.versions = PolicyVersions(policy, plan.correction_window)

    def shards(self, batch: Batch, world_size: int, version: int | None = None) -> list[Shard]:
        """`batch` split into `world_size` shards, each with its rows of the whole-batch
        tensors and the whole batch's divisors. `version`: that of the policy's weights now
        (the trainer's steps so far), for the staleness metrics and the correction."""
        plan, records = self.plan, batch.records
        tb = collate_for(plan, records, self.pad_id)
        mask = tb.loss_mask
        num_tokens = int(mask.sum())
        if not plan.is_rl:
            return shard_batch(batch, world_size, advantages=None, num_tokens=num_tokens,
                               rows_per_record=tb.input_ids.shape[0] // max(len(records), 1),
                               norm=LossNorm.of(mask))
        expert = expert_rows(records) if plan.type == "mix" else torch.zeros(len(records),
                                                                                dtype=torch.bool)
        rl_rows = (~expert).nonzero().squeeze(1)
        rl_mask = mask * (~expert).unsqueeze(1).to(mask.dtype)
        metrics: dict[str, float] = {}
        rows: dict[str, torch.Tensor] = {}
        advantages = torch.zeros(mask.shape, dtype=torch.float32)
        if len(rl_rows):
            adv, extra, metrics = self._advantages(tb, records, rl_rows)
            weights = torch.tensor(batch.weights, dtype=torch.float32)[rl_rows]
            advantages[rl_rows] = adv * weights.unsqueeze(1)
            if version is not None:
                metrics.update(staleness_metrics([records[i] for i in rl_rows.tolist()],
                                                 version))
            if self.versions is not None:
                extra.update(self._correction(tb.select(rl_rows), records, rl_rows, version,
                                              metrics))
            for name, t in extra.items():
                rows[name] = torch.zeros(mask.shape, dtype=torch.float32)
                rows[name][rl_rows] = t
        if self.versions is not None and version is not None:
            self.versions.remember(version)  # before this step changes the weights
        return shard_batch(batch, world_size, advantages=advantages, rows=rows,
                           num_tokens=num_tokens, norm=LossNorm.of(rl_mask, plan.norm_tokens),
                           expert_norm=LossNorm.of(mask[expert]) if bool(expert.any()) else None,
                           metrics=metrics)

    def _correction(self, sub: TokenBatch, records: Sequence[Record], rl_rows: torch.Tensor,
                    version: int | None, metrics: dict[str, float]) -> dict[str, torch.Tensor]:
        """The trainer's log-probs of the rollout rows `sub` under the weights each was
        generated with and their correction weights (`algorithms.off_policy`); adds the
        correction's metrics to `metrics`."""
        assert self.versions is not None
        if version is None:  # no version known: every row under the current weights
            versions, current = torch.full((len(rl_rows),), -1), -1
        else:
            versions = token_versions([records[i] for i in rl_rows.tolist()],
                                      sub.targets.shape[1], version)
            current = version
        old, fallback = self.versions.logprobs(sub, versions, current, self.temperature)
        behaviour = old_logprobs(sub, old)  # rows imported without log-probs: no gap
        weights, parts = correction_weights(old, behaviour, sub.loss_mask, self.plan.correction)
        metrics.update(parts)
        metrics["correction/unknown_version_records"] = float(fallback)
        return {"correction_old_logp": old, "correction_weights": weights.float()}

    @torch.no_grad()
    def _advantages(self, tb: TokenBatch, records: Sequence[Record], rl_rows: torch.Tensor,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        """Advantages [R, T] of the rollout rows, further per-row tensors (critic values and
        returns) and whole-batch metrics."""
        plan = self.plan
        rewards, groups = _experience_view(tb, records, rl_rows)
        sub = tb.select(rl_rows)
        mask = sub.loss_mask
        metrics = {"reward_mean": float(rewards.float().mean())}
        fields: dict[str, torch.Tensor | None] = {}
        extra: dict[str, torch.Tensor] = {}
        dev = sub.to(self.device) if self.device.type != "cpu" else sub
        if plan.kl_penalty is not None:
            assert self.reference is not None
            ref = token_logprobs(self.reference, dev, self.temperature).cpu()
            old = sub.old_logprobs
            if sub.has_old_logprobs is not None and not bool(sub.has_old_logprobs.all()):
                if self.policy is None:  # sharded over ranks: rank 0 cannot run it alone
                    raise UserError("a KL penalty in the reward needs rollout log-probs under "
                                    "trainer.parallel fsdp (or a sharded trainer.backend "
                                    "megatron); records without them were read (use "
                                    "trainer.parallel: ddp)")
                old = old_logprobs(sub, token_logprobs(self.policy, dev, self.temperature).cpu())
            penalty = kl_reward_penalty(old, ref, mask, plan.kl_penalty, plan.kl_penalty_coef)
            fields["kl_penalty"] = penalty
            metrics["kl_penalty"] = float(masked_mean(penalty, mask))
        if self.critic is not None:
            values = self.critic.token_values(dev).float().cpu()
            fields["values"] = values
            extra["old_values"] = values
        rollouts = [records[i] for i in rl_rows.tolist()]
        if plan.advantage_fn == "remax":
            fields["baselines"] = greedy_baselines(rollouts)
        if plan.advantage_fn == "on_policy_distill" or any(
                getattr(r, "teacher_logprobs", None) is not None for r in rollouts):
            fields["teacher_logprobs"] = teacher_logprobs(rollouts, mask.shape[1],
                                                          plan.advantage_fn)
            fields["logprobs"] = sub.old_logprobs
            gap = (sub.old_logprobs - fields["teacher_logprobs"]) * mask
            metrics["teacher_reverse_kl"] = float(gap.sum() / mask.sum().clamp(min=1))
        adv_batch = AdvantageBatch(rewards=rewards, mask=mask, group_ids=groups, **fields)
        adv, returns = compute_advantages(plan.advantage_fn or "", adv_batch,
                                          **plan.advantage_args)
        if self.critic is not None:
            extra["returns"] = returns
        return adv, extra, metrics


def greedy_baselines(records: Sequence[Record]) -> torch.Tensor:
    """[B] ReMax's baselines: each rollout's `info["greedy_reward"]`, which explorers of a
    `remax` run write; a record without one (another algorithm's, imported) is refused."""
    values = []
    for r in records:
        value = getattr(r, "info", {}).get("greedy_reward")
        if value is None:
            raise UserError("remax needs each rollout's greedy baseline (info.greedy_reward, "
                            "written by explorers of a remax run); the buffer holds rollouts "
                            f"without one (task {getattr(r, 'task_id', '?')})")
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float64)


def teacher_logprobs(records: Sequence[Record], width: int, advantage: str | None,
                     ) -> torch.Tensor:
    """[B, width] each rollout's `teacher_logprobs`, shifted as a `TokenBatch`'s targets
    (position j: token j+1); 0 for a rollout without (refused under `on_policy_distill`,
    whose explorers record them for every rollout)."""
    out = torch.zeros((len(records), width), dtype=torch.float32)
    for i, r in enumerate(records):
        values = getattr(r, "teacher_logprobs", None)
        if values is None:
            if advantage == "on_policy_distill":
                raise UserError("on_policy_distill needs each rollout's teacher log-probs "
                                "(teacher_logprobs, which explorers with "
                                "algorithm.teacher_model record); the buffer holds rollouts "
                                f"without them (task {getattr(r, 'task_id', '?')})")
            continue
        row = torch.from_numpy(np.nan_to_num(values[1:], nan=0.0))
        out[i, :len(row)] = row
    return out


def token_versions(records: Sequence[Record], width: int, default: int) -> torch.Tensor:
    """[B, width] the weight version each target token of `records` was sampled with: the
    record's `policy_version`, and for a rollout that spans versions (`info["version_spans"]`,
    counted from its first response token) each span's own (`default` for records without
    a version)."""
    out = torch.full((len(records), width), default, dtype=torch.long)
    for i, r in enumerate(records):
        out[i] = getattr(r, "policy_version", default)
        for v, start in r.info.get("version_spans", ()) if hasattr(r, "info") else ():
            out[i, max(r.prompt_length + int(start) - 1, 0):] = int(v)
    return out


def staleness_metrics(records: Sequence[Record], version: int) -> dict[str, float]:
    """How many versions behind `version` the rollouts were generated: `staleness/mean`,
    `staleness/max` and the histogram, `staleness/<k>` the share of rollouts k behind."""
    lags = np.array([max(0, version - getattr(r, "policy_version", version)) for r in records])
    if not len(lags):
        return {}
    values, counts = np.unique(lags, return_counts=True)
    return {"staleness/mean": float(lags.mean()), "staleness/max": float(lags.max()),
            **{f"staleness/{v}": float(c) / len(lags) for v, c in zip(values, counts,
                                                                       strict=True)}}


def with_known_logprobs(tb: TokenBatch, records: Sequence[Record]) -> TokenBatch:
    """`tb` with `has_old_logprobs` set for every row, also in a batch that mixes rollouts
    and expert samples (whose log-probs are never read)."""
    if tb.has_old_logprobs is not None or len(records) != tb.input_ids.shape[0]:
        return tb
    known = [not isinstance(r, Experience)
             or not bool(np.isnan(r.logprobs[1:][r.response_mask[1:] > 0]).any())
             for r in records]
    return dataclasses.replace(tb, has_old_logprobs=torch.tensor(known, dtype=torch.bool))
