"""Advantage functions against numbers worked out by hand (and GAE against a plain loop)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rft_hpc.algorithms import (
    AdvantageBatch,
    gae,
    grpo,
    kl_reward_penalty,
    masked_whiten,
    opmd,
    reinforce_plus_plus,
    rloo,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_token_rewards_and_scores():
    # reward sits at the last trained token; a row without trained tokens gets none
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 2.0, 3.0]),
                           mask=_t([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]]),
                           kl_penalty=_t([[9, 0.1, 0.2, 9], [0.5, 9, 0, 0.25], [9, 9, 9, 9]]))
    # penalties count on trained tokens only: row 0: [0, -0.1, 1 - 0.2, 0]
    # row 1: [-0.5, 0, 0, 2 - 0.25]
    torch.testing.assert_close(batch.token_rewards(), torch.tensor(
        [[0, -0.1, 0.8, 0], [-0.5, 0, 0, 1.75], [0, 0, 0, 0]], dtype=torch.float64))
    # scores: 1 - 0.3 = 0.7, 2 - 0.75 = 1.25, row 2 keeps its reward
    assert batch.scores().tolist() == pytest.approx([0.7, 1.25, 3.0])


def test_grpo_by_hand_per_token():
    # group 0: rewards 1, 0 -> mean 0.5, population std 0.5 -> +-0.5/(0.5+eps)
    # group 1: rewards 2, 5 -> mean 3.5, std 1.5 -> -+1.5/(1.5+eps)
    mask = _t([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]])
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.0, 2.0, 5.0]), mask=mask,
                           group_ids=torch.tensor([0, 0, 1, 1]))
    eps = 1e-6
    a, b = 0.5 / (0.5 + eps), 1.5 / (1.5 + eps)
    adv, returns = grpo(batch, epsilon=eps)
    torch.testing.assert_close(adv, _t([[0, a, a], [0, -a, 0], [-b, -b, -b], [0, 0, b]]))
    assert torch.equal(adv, returns)
    # without std normalisation: r - mean
    adv, _ = grpo(batch, std_normalize=False)
    torch.testing.assert_close(adv, _t([[0, .5, .5], [0, -.5, 0], [-1.5] * 3, [0, 0, 1.5]]))


def test_grpo_scores_include_the_kl_penalty():
    # 0.25 per trained token: row 0 (2 tokens) 1 - 0.5 = 0.5, row 1 (1 token) 0 - 0.25 = -0.25
    # mean 0.125, deviations +-0.375, std 0.375 -> +-1 (up to eps)
    mask = _t([[0, 1, 1], [0, 1, 0]])
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), mask=mask,
                           group_ids=torch.tensor([4, 4]), kl_penalty=0.25 * torch.ones(2, 3))
    adv, _ = grpo(batch, epsilon=0.0)
    torch.testing.assert_close(adv, _t([[0, 1, 1], [0, -1, 0]]))


def test_rloo_by_hand():
    # group 7: 3, 0, 6 -> baselines (0+6)/2 = 3, (3+6)/2 = 4.5, (3+0)/2 = 1.5
    #   -> 0, -4.5, 4.5; group 8 holds one rollout: raw reward 2
    batch = AdvantageBatch(rewards=torch.tensor([3.0, 0.0, 6.0, 2.0]), mask=torch.ones(4, 2),
                           group_ids=torch.tensor([7, 7, 7, 8]))
    adv, _ = rloo(batch)
    torch.testing.assert_close(adv, _t([[0, 0], [-4.5, -4.5], [4.5, 4.5], [2, 2]]))


def test_opmd_mean_and_logavgexp_baselines_by_hand():
    mask = torch.ones(4, 1)
    groups = torch.tensor([1, 1, 1, 2])
    # mean baseline: group 1 mean 3 -> 0, -3, 3; a single rollout keeps its reward (baseline 0)
    adv, _ = opmd(AdvantageBatch(torch.tensor([3.0, 0.0, 6.0, 2.0]), mask, groups))
    assert adv[:, 0].tolist() == pytest.approx([0, -3, 3, 2])
    # logavgexp, tau 2, group [0, 2 ln3]: 2 * ln((e^0 + e^ln3) / 2) = 2 ln2
    two = AdvantageBatch(torch.tensor([0.0, 2 * LN3]), torch.ones(2, 1), torch.tensor([0, 0]))
    adv, _ = opmd(two, opmd_baseline="logavgexp", tau=2.0)
    assert adv[:, 0].tolist() == pytest.approx([-2 * LN2, 2 * LN3 - 2 * LN2])
    with pytest.raises(ValueError, match="opmd_baseline"):
        opmd(two, opmd_baseline="max")  # type: ignore[arg-type]


def test_reinforce_plus_plus_by_hand():
    # gamma 0.5; row 0 mask [0,1,1], reward 1 at t=2: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5
    # row 1 mask [1,1,0], reward 2 at t=1: G1 = 2, G0 = 0.5 * 2 = 1
    mask = _t([[0, 1, 1], [1, 1, 0]])
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 2.0]), mask=mask)
    adv, returns = reinforce_plus_plus(batch, gamma=0.5)
    torch.testing.assert_close(returns, _t([[0, 0.5, 1], [1, 2, 0]]))
    # whitened over the 4 trained returns 0.5, 1, 1, 2: mean 1.125, unbiased var 1.1875 / 3
    g = [0.5, 1.0, 1.0, 2.0]
    mean, std = statistics.mean(g), math.sqrt(statistics.variance(g) + 1e-8)
    assert (mean, statistics.variance(g)) == pytest.approx((1.125, 1.1875 / 3))
    want = [[0, (0.5 - mean) / std, (1 - mean) / std], [(1 - mean) / std, (2 - mean) / std, 0]]
    torch.testing.assert_close(adv, _t(want))


def test_reinforce_plus_plus_with_kl_in_the_reward_and_a_multi_turn_hole():
    # row 0: mask [0,1,1], reward 1, penalties 0.1, 0.2 -> token rewards [0, -0.1, 0.8]
    #   gamma 0.5: G2 = 0.8, G1 = -0.1 + 0.4 = 0.3
    # row 1: mask [1,0,1] (t=1 an environment token): reward 1 at t=2, G2 = 1, and t=0 sees
    #   t=2 as the next token: G0 = 0 + 0.5 * 1 = 0.5 (one discount, not two)
    mask = _t([[0, 1, 1], [1, 0, 1]])
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 1.0]), mask=mask,
                           kl_penalty=_t([[0, 0.1, 0.2], [0, 0, 0]]))
    adv, returns = reinforce_plus_plus(batch, gamma=0.5)
    torch.testing.assert_close(returns, _t([[0, 0.3, 0.8], [0.5, 0, 1]]))
    torch.testing.assert_close(adv, masked_whiten(returns, mask))
    assert adv[1, 1].item() == 0.0 and adv[0, 0].item() == 0.0


def test_kl_reward_penalty_feeds_the_token_rewards():
    # k1 = old - ref = ln2 on the trained token; kl_coef 0.1 -> 0.1 ln2; masked -> 0
    old = _t([[-1.0, -2.0]])
    ref = _t([[-1.0 - LN2, 40.0]])
    penalty = kl_reward_penalty(old, ref, _t([[1, 0]]), "k1", kl_coef=0.1)
    torch.testing.assert_close(penalty, _t([[0.1 * LN2, 0.0]]))
    assert not penalty.requires_grad


def test_gae_by_hand():
    # mask [0,1,1,1], reward 1 at t=3, values [9 (prompt, unused), 0.5, 0.25, 0.5]
    # gamma 0.9, lam 0.5:
    #   t=3: delta = 1 + 0.9 * 0 - 0.5 = 0.5                 A3 = 0.5
    #   t=2: delta = 0 + 0.9 * 0.5 - 0.25 = 0.2              A2 = 0.2 + 0.45 * 0.5 = 0.425
    #   t=1: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275           A1 = -0.275 + 0.45 * 0.425
    #                                                           = -0.08375
    # returns = A + V: 0.41625, 0.675, 1.0
    batch = AdvantageBatch(rewards=torch.tensor([1.0]), mask=_t([[0, 1, 1, 1]]),
                           values=_t([[9.0, 0.5, 0.25, 0.5]]))
    adv, returns = gae(batch, gamma=0.9, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, _t([[0, -0.08375, 0.425, 0.5]]))
    torch.testing.assert_close(returns, _t([[0, 0.41625, 0.675, 1.0]]))
    whitened, same_returns = gae(batch, gamma=0.9, lam=0.5)
    a = [-0.08375, 0.425, 0.5]
    mean, std = statistics.mean(a), math.sqrt(statistics.variance(a) + 1e-8)
    torch.testing.assert_close(whitened, _t([[0] + [(x - mean) / std for x in a]]))
    assert torch.equal(same_returns, returns)
    with pytest.raises(ValueError, match="values"):
        gae(AdvantageBatch(rewards=torch.tensor([1.0]), mask=_t([[1]])))


def _gae_reference(rewards, mask, values, kl, gamma, lam):
    """Plain per-record loop over the trained positions, in Python floats."""
    b, t = len(mask), len(mask[0])
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        steps = [j for j in range(t) if mask[i][j] > 0]
        following, next_value = 0.0, 0.0
        for k in reversed(range(len(steps))):
            j = steps[k]
            r = -kl[i][j] + (rewards[i] if k == len(steps) - 1 else 0.0)
            following = r + gamma * next_value - values[i][j] + gamma * lam * following
            adv[i][j], ret[i][j] = following, following + values[i][j]
            next_value = values[i][j]
    return adv, ret


def test_gae_matches_a_plain_loop_with_multi_turn_masks(rng):
    b, t = 5, 9
    mask = [[float(rng.random() < 0.7) for _ in range(t)] for _ in range(b)]
    mask[0] = [0.0] * t  # a record with nothing to train
    mask[1] = [0, 0, 1, 1, 0, 0, 1, 1, 0]  # two turns with an observation between them
    rewards = [rng.uniform(-1, 1) for _ in range(b)]
    values = [[rng.uniform(-1, 1) for _ in range(t)] for _ in range(b)]
    kl = [[rng.uniform(0, 0.1) for _ in range(t)] for _ in range(b)]
    gamma, lam = 0.95, 0.8
    batch = AdvantageBatch(rewards=torch.tensor(rewards), mask=torch.tensor(mask),
                           values=torch.tensor(values, dtype=torch.float64),
                           kl_penalty=torch.tensor(kl, dtype=torch.float64))
    adv, ret = gae(batch, gamma=gamma, lam=lam, whiten=False)
    want_adv, want_ret = _gae_reference(rewards, mask, values, kl, gamma, lam)
    # float32 results of float32 rewards
    torch.testing.assert_close(adv, torch.tensor(want_adv), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor(want_ret), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [grpo, rloo, opmd])
def test_group_methods_name_the_missing_group_ids(fn):
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 1))
    with pytest.raises(ValueError, match=f"the {fn.__name__} advantage needs group_ids"):
        fn(batch)
