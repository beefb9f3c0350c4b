"""Loss aggregation modes by hand, and micro-batches whose gradients sum to the batch's."""

from __future__ import annotations

import math

import pytest
import torch

from rft_hpc.algorithms import (
    LOSS_AGG_MODES,
    LossNorm,
    PolicyLossInputs,
    aggregate_loss,
    dpo_loss,
    entropy_bonus,
    kl_loss,
    mix_policy_loss,
    opmd_policy_loss,
    ppo_policy_loss,
    sft_policy_loss,
    value_loss,
)
from rft_hpc.core.errors import UserError

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2: padding


@pytest.mark.parametrize(("mode", "want"), [
    ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences (the empty row does not count)
    ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ("seq-mean-token-sum-norm", 7 / 6),  # (3 / 3 + 4 / 3) / 2, max_tokens = T = 3
])
def test_modes_by_hand(mode, want):
    assert aggregate_loss(VALUES, MASK, mode).item() == pytest.approx(want)


def test_norm_constant_and_divisors():
    norm = LossNorm.of(MASK, max_tokens=7)
    assert (norm.num_tokens, norm.num_seqs, norm.max_tokens) == (3.0, 2.0, 7.0)
    # 7 / (2 sequences * 7)
    assert aggregate_loss(VALUES, MASK, "seq-mean-token-sum-norm", norm).item() == 0.5
    # masked inf/NaN never leak
    wild = VALUES.clone()
    wild[2, 0], wild[0, 2] = math.inf, math.nan
    assert aggregate_loss(wild, MASK, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate_loss(VALUES, torch.zeros_like(MASK)).item() == 0.0
    with pytest.raises(UserError, match="seq-mean-token-mean"):
        aggregate_loss(VALUES, MASK, "sum")


def _random_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    mask = torch.zeros(b, t)
    for i in range(b):
        start = int(torch.randint(0, 3, (1,), generator=gen))
        end = int(torch.randint(start, t + 1, (1,), generator=gen))
        mask[i, start:end] = 1.0
    mask[1] = 0.0  # a padding row
    mask[2, 2:5] = torch.tensor([1.0, 0.0, 1.0])  # a multi-turn hole
    return mask


SPLITS = [slice(0, 2), slice(2, 5), slice(5, 6)]


def _trim(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
    return None if t is None else t[:, :width]


def _micro_width(mask: torch.Tensor) -> int:
    """A micro-batch is padded to its own longest row: drop its all-padding tail columns."""
    used = mask.sum(0).nonzero()
    return int(used.max()) + 1 if len(used) else 1


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(1)
    b, t = 6, 8
    mask = _random_mask(gen, b, t)
    values = torch.randn(b, t, dtype=torch.float64, generator=gen, requires_grad=True)
    whole = aggregate_loss(values, mask, mode)
    (g_whole,) = torch.autograd.grad(whole, values)

    norm = LossNorm.of(mask)
    total = torch.zeros((), dtype=torch.float64)
    for rows in SPLITS:
        width = _micro_width(mask[rows])
        total = total + aggregate_loss(values[rows, :width], mask[rows, :width], mode, norm)
    (g_micro,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_micro, g_whole)

    # the divisors of each micro-batch's own tokens would not add up (here the counts differ)
    own = sum(aggregate_loss(values[r], mask[r], mode) for r in SPLITS)
    assert not torch.isclose(own, whole)


def _inputs(gen: torch.Generator, b: int, t: int) -> dict[str, torch.Tensor]:
    mask = _random_mask(gen, b, t)
    mask[mask.sum(-1) == 0, 3] = 1.0  # DPO rows must all hold a response
    logp = (-torch.rand(b, t, dtype=torch.float64, generator=gen) * 2).requires_grad_(True)
    return dict(logp=logp, mask=mask,
                old_logp=logp.detach() + 0.3 * torch.randn(b, t, dtype=torch.float64,
                                                            generator=gen),
                ref_logp=logp.detach() + 0.3 * torch.randn(b, t, dtype=torch.float64,
                                                            generator=gen),
                advantages=torch.randn(b, t, dtype=torch.float64, generator=gen) * 2,
                is_expert=torch.tensor([False, True, False, False, True, False]))


def _ppo(fields, norm, expert_norm):
    return ppo_policy_loss(PolicyLossInputs(**fields, norm=norm),
                           loss_agg_mode="seq-mean-token-mean", clip_ratio_c=2.0)[0]


def _mix(fields, norm, expert_norm):
    return mix_policy_loss(PolicyLossInputs(**fields, norm=norm, expert_norm=expert_norm),
                           mu=0.3, clip_range=0.1)[0]


def _kl_entropy(fields, norm, expert_norm):
    kl = kl_loss(fields["logp"], fields["ref_logp"], fields["mask"], "low_var_kl", 0.1,
                 "seq-mean-token-sum", norm)[0]
    entropy = entropy_bonus(-fields["logp"], fields["mask"], 0.01, "token-mean", norm)[0]
    return kl + entropy


LOSSES = {
    "ppo": _ppo,
    "opmd": lambda f, n, e: opmd_policy_loss(PolicyLossInputs(**f, norm=n), tau=0.5)[0],
    "sft": lambda f, n, e: sft_policy_loss(PolicyLossInputs(**f, norm=n),
                                           loss_agg_mode="seq-mean-token-sum-norm")[0],
    "dpo": lambda f, n, e: dpo_loss(PolicyLossInputs(**f, norm=n), beta=0.5)[0],
    "mix": _mix,
    "kl+entropy": _kl_entropy,
    "value": lambda f, n, e: value_loss(f["logp"], f["old_logp"], f["ref_logp"], f["mask"],
                                        0.2, "seq-mean-token-mean", n)[0],
}


@pytest.mark.parametrize("name", LOSSES)
def test_losses_micro_batched_give_the_whole_batch_gradient(name):
    gen = torch.Generator().manual_seed(2)
    fields = _inputs(gen, 6, 8)
    loss_fn = LOSSES[name]
    expert = fields["is_expert"]
    if name == "mix":
        norm, expert_norm = LossNorm.of(fields["mask"][~expert]), LossNorm.of(
            fields["mask"][expert])
    else:
        norm, expert_norm = LossNorm.of(fields["mask"]), None
    whole = loss_fn(fields, None if name != "mix" else norm, expert_norm)
    (g_whole,) = torch.autograd.grad(whole, fields["logp"])
    assert g_whole.abs().sum() > 0

    total = torch.zeros((), dtype=torch.float64)
    # DPO micro-batches hold whole pairs: rows 0-1, 2-5
    splits = [slice(0, 2), slice(2, 6)] if name == "dpo" else SPLITS
    for rows in splits:
        width = _micro_width(fields["mask"][rows])
        part = {k: (v[rows] if v.dim() == 1 else v[rows, :width]) for k, v in fields.items()}
        total = total + loss_fn(part, norm, expert_norm)
    (g_micro,) = torch.autograd.grad(total, fields["logp"])
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_micro, g_whole)
