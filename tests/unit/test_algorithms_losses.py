"""Policy losses, KL, entropy and the critic against numbers worked out by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from rft_hpc.algorithms import (
    PolicyLossInputs,
    ValueHeadModel,
    dpo_loss,
    entropy_bonus,
    kl_loss,
    kl_per_token,
    mix_policy_loss,
    opmd_policy_loss,
    ppo_policy_loss,
    sft_policy_loss,
    token_entropy,
    value_loss,
)
from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate_dpo
from rft_hpc.buffer.records import DPOPair
from rft_hpc.core.errors import UserError

LN2, LN3 = math.log(2.0), math.log(3.0)


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _ppo_case():
    # old log-prob -1 everywhere; new = old + ln(ratio)
    ratios = _t([[1.5, 0.5], [1.5, 0.5], [5.0, 1.0]])
    old = torch.full_like(ratios, -1.0)
    new = (old + ratios.log()).requires_grad_(True)
    mask = _t([[1, 1], [1, 1], [1, 0]])
    return new, old, mask, torch.tensor([1.0, -1.0, -1.0])


def test_ppo_clip_and_dual_clip_by_hand():
    new, old, mask, adv = _ppo_case()
    # per token l = max(-A r, -A clip(r, 0.8, 1.2)):
    #   row 0 (A=+1): r 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r 0.5 -> max(-0.5, -0.8) = -0.5
    #   row 1 (A=-1): r 1.5 -> max(1.5, 1.2) = 1.5; r 0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    #   row 2 (A=-1): r 5 -> max(5, 1.2) = 5; dual clip c=3: min(5, 3) = 3
    # token-mean over 5 tokens: (-1.2 - 0.5 + 1.5 + 0.8 + 3) / 5 = 0.72
    loss, metrics = ppo_policy_loss(PolicyLossInputs(new, mask, old, adv), clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(0.72, abs=1e-6)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["clip_fraction_lower"].item() == pytest.approx(1 / 5)
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 5) / 5)
    loss.backward()
    # d l / d logp = -A r on unclipped tokens, 0 on clipped and dual-clipped ones; / 5
    torch.testing.assert_close(new.grad, _t([[0, -0.5 / 5], [1.5 / 5, 0], [0, 0]]))

    # without dual clip row 2 costs 5: (-1.2 - 0.5 + 1.5 + 0.8 + 5) / 5 = 1.12, gradient 5/5
    new.grad = None
    loss, metrics = ppo_policy_loss(PolicyLossInputs(new, mask, old, adv), clip_ratio_c=None)
    assert loss.item() == pytest.approx(1.12, abs=1e-6)
    assert "clip_fraction_lower" not in metrics
    loss.backward()
    assert new.grad[2, 0].item() == pytest.approx(1.0)


def test_ppo_per_token_advantages_asymmetric_clip_and_seq_mean():
    new, old, mask, adv = _ppo_case()
    per_token = adv[:, None].expand(3, 2).clone()
    # seq-mean-token-mean with dual clip: rows (-1.2 - 0.5) / 2, (1.5 + 0.8) / 2, 3 / 1
    #   -> (-0.85 + 1.15 + 3) / 3 = 1.1
    loss, _ = ppo_policy_loss(PolicyLossInputs(new, mask, old, per_token),
                              loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(1.1, abs=1e-6)
    # clip_range_high 0.6: row 0's 1.5 is inside (-1.5); clip_range_low 0.1: row 1's 0.5 is
    # clipped to 0.9 (0.9): (-1.5 - 0.5 + 1.5 + 0.9 + 3) / 5 = 0.68
    loss, _ = ppo_policy_loss(PolicyLossInputs(new, mask, old, per_token), clip_range_low=0.1,
                              clip_range_high=0.6)
    assert loss.item() == pytest.approx(0.68, abs=1e-6)
    with pytest.raises(ValueError, match="old_logp"):
        ppo_policy_loss(PolicyLossInputs(new, mask, advantages=adv))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(PolicyLossInputs(new, mask, old, adv), clip_ratio_c=1.0)


def test_opmd_loss_by_hand():
    logp = _t([[-1.0, -2.0], [-0.5, -7.0]]).requires_grad_(True)
    mask = _t([[1, 1], [1, 0]])
    # -A logp: row 0 (A=2): 2, 4; row 1 (A=-1): -0.5 -> token-mean 5.5 / 3; / (1 + tau=1)
    loss, metrics = opmd_policy_loss(PolicyLossInputs(logp, mask, advantages=torch.tensor(
        [2.0, -1.0])))
    assert loss.item() == pytest.approx(5.5 / 6)
    assert metrics["opmd_loss"].item() == pytest.approx(5.5 / 6)
    loss.backward()
    # -A / (3 tokens * 2)
    torch.testing.assert_close(logp.grad, _t([[-1 / 3, -1 / 3], [1 / 6, 0]]))


def test_sft_loss_modes_by_hand():
    logp = _t([[-1.0, -2.0], [-3.0, -50.0]])
    mask = _t([[1, 1], [1, 0]])
    inputs = PolicyLossInputs(logp, mask)
    assert sft_policy_loss(inputs)[0].item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    # per sequence (1.5 + 3) / 2 = 2.25; Trinity's use_token_level_loss=False is the same
    assert sft_policy_loss(inputs, loss_agg_mode="seq-mean-token-mean")[0].item() == 2.25
    assert sft_policy_loss(inputs, use_token_level_loss=False)[0].item() == 2.25


def _dpo_rows():
    # rows: chosen 0, rejected 0, chosen 1, rejected 1 (T=2, chosen 1 is one token long)
    logp = _t([[-1, -1], [-2, -1], [-1, 0], [-1, -1]]).requires_grad_(True)
    ref = _t([[-1.5, -1.5], [-1, -1], [-1, 0], [-1, -1]])
    mask = _t([[1, 1], [1, 1], [1, 0], [1, 1]])
    return logp, ref, mask


def test_dpo_loss_by_hand():
    logp, ref, mask = _dpo_rows()
    # pair 0: chosen -2 vs ref -3 -> +1; rejected -3 vs ref -2 -> -1; z = 0.5 * (1 - -1) = 1
    #   loss -log sigmoid(1) = log(1 + e^-1)
    # pair 1: policy = reference -> z = 0, loss ln2
    loss, metrics = dpo_loss(PolicyLossInputs(logp, mask, ref_logp=ref), beta=0.5)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + LN2) / 2, abs=1e-6)
    assert metrics["accuracy_mean"].item() == 0.5
    assert metrics["chosen_reward"].item() == pytest.approx(0.5 * (1 + 0) / 2)
    assert metrics["rejected_reward"].item() == pytest.approx(0.5 * (-1 + 0) / 2)
    loss.backward()
    # d loss / d chosen token of pair 0 = -beta sigmoid(-z) / 2 pairs; rejected: the opposite
    g0 = 0.5 * (1 / (1 + math.e)) / 2
    g1 = 0.5 * 0.5 / 2  # pair 1: sigmoid(0) = 0.5
    torch.testing.assert_close(logp.grad, _t([[-g0, -g0], [g0, g0], [-g1, 0], [g1, g1]]))

    # label smoothing 0.1: pair 0 0.9 log(1 + e^-1) + 0.1 log(1 + e^1); pair 1 still ln2
    smooth, _ = dpo_loss(PolicyLossInputs(logp, mask, ref_logp=ref), beta=0.5,
                         label_smoothing=0.1)
    want = (0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.e) + LN2) / 2
    assert smooth.item() == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(PolicyLossInputs(logp[:3], mask[:3], ref_logp=ref[:3]))


def test_mix_loss_by_hand():
    # rows 0, 1: rollouts with ratio 1 and A = +1 (2 tokens), -1 (1 token): PPO token-mean
    #   (-1 - 1 + 1) / 3 = -1/3; row 2: expert, NLL token-mean (2 + 4) / 2 = 3
    # mu 0.25: 0.75 * (-1/3) + 0.25 * 3 = 0.5
    logp = _t([[-1, -1], [-1, -9], [-2, -4]]).requires_grad_(True)
    mask = _t([[1, 1], [1, 0], [1, 1]])
    inputs = PolicyLossInputs(logp, mask, old_logp=logp.detach().clone(),
                              advantages=torch.tensor([1.0, -1.0, 0.0]),
                              is_expert=torch.tensor([False, False, True]))
    loss, metrics = mix_policy_loss(inputs, mu=0.25)
    assert loss.item() == pytest.approx(0.5)
    assert metrics["expert/sft_loss"].item() == pytest.approx(3.0)
    assert metrics["usual/pg_loss"].item() == pytest.approx(-1 / 3)
    loss.backward()
    # rollouts: 0.75 * -A / 3; expert: 0.25 * -1 / 2
    torch.testing.assert_close(logp.grad, _t([[-0.25, -0.25], [0.25, 0], [-0.125, -0.125]]))
    # a batch of expert rows only still has a gradient
    only, _ = mix_policy_loss(PolicyLossInputs(logp[2:], mask[2:],
                                               is_expert=torch.tensor([True])), mu=0.25)
    assert only.item() == pytest.approx(0.75) and only.requires_grad


def test_kl_estimators_by_hand():
    # token 0: logr = ref - logp = -ln2; token 1: logr = 30 (far apart)
    logp = _t([[-1.0, -2.0]])
    ref = _t([[-1.0 - LN2, 28.0]])
    first = {"k1": LN2, "k2": LN2**2 / 2, "k3": 0.5 - 1 + LN2, "low_var_kl": 0.5 - 1 + LN2,
             "abs": LN2}
    for kind, want in first.items():
        assert kl_per_token(logp, ref, kind)[0, 0].item() == pytest.approx(want, abs=1e-6)
    # k3 of logr 30 = e^30 - 31; low_var_kl clamps logr to 20 and the result to 10
    assert kl_per_token(logp, ref, "k3")[0, 1].item() == pytest.approx(math.exp(30) - 31,
                                                                       rel=1e-5)
    assert kl_per_token(logp, ref, "low_var_kl")[0, 1].item() == 10.0
    with pytest.raises(UserError, match="low_var_kl"):
        kl_per_token(logp, ref, "k4")
    # in the loss, token 1 masked: coef 0.1 * k3(token 0)
    new = logp.clone().requires_grad_(True)
    loss, metrics = kl_loss(new, ref, _t([[1, 0]]), "k3", kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * (LN2 - 0.5), abs=1e-7)
    assert metrics["kl_loss"].item() == pytest.approx(LN2 - 0.5, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(logr) = 1 - 0.5; the masked token gets exactly 0, not NaN
    assert new.grad[0].tolist() == pytest.approx([0.1 * 0.5, 0.0])


def test_token_entropy_and_bonus_by_hand():
    # position 0: logits [0, 0] -> ln2; position 1: [0, 2 ln3] at temperature 2 -> [0, ln3]
    #   -> p = 1/4, 3/4, H = -(1/4 ln 1/4 + 3/4 ln 3/4); position 2 predicts nothing
    logits = torch.tensor([[[0.0, 0.0], [0.0, 2 * LN3], [5.0, 1.0]]])
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    entropy = token_entropy(logits, temperature=2.0)
    assert entropy.shape == (1, 2)
    assert entropy[0].tolist() == pytest.approx([LN2, h1], abs=1e-6)
    bonus, metrics = entropy_bonus(entropy, _t([[1, 1]]), entropy_coef=0.01)
    assert bonus.item() == pytest.approx(-0.01 * (LN2 + h1) / 2, abs=1e-7)
    assert metrics["entropy"].item() == pytest.approx((LN2 + h1) / 2, abs=1e-6)


def test_token_entropy_gradient_matches_plain_autograd():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    got = token_entropy(logits, 0.7, chunk_size=3)  # several chunks
    logp = torch.log_softmax(logits[:, :-1] / 0.7, -1)
    want = -(logp.exp() * logp).sum(-1)
    weights = torch.randn(2, 4, dtype=torch.float64, generator=gen)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)


def test_value_loss_by_hand():
    values = _t([[1.0, 2.0, 0.0]]).requires_grad_(True)
    old, returns, mask = _t([[0.0, 1.9, 0.0]]), _t([[2.0, 1.0, 0.5]]), _t([[1, 1, 0]])
    # t0: (1 - 2)^2 = 1; clipped 0 + clip(1, +-0.5) = 0.5 -> (0.5 - 2)^2 = 2.25 -> 2.25
    # t1: (2 - 1)^2 = 1; clipped 1.9 + 0.1 = 2 (inside the range) -> 1
    # 0.5 * (2.25 + 1) / 2 = 0.8125
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.8125)
    assert metrics["vf_clipfrac"].item() == 0.5
    loss.backward()
    # t0 takes the clipped (constant) branch: 0; t1: 0.5 * 2 (2 - 1) / 2 = 0.5
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0])
    # unclipped: 0.5 * (1 + 1) / 2
    assert value_loss(values, old, returns, mask, None)[0].item() == pytest.approx(0.5)


def test_value_head_reads_the_last_hidden_state(tiny_model):
    from transformers import AutoModelForCausalLM

    critic = ValueHeadModel.from_pretrained(tiny_model)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model)
    pairs = [DPOPair(chosen_tokens=[3, 4, 5, 6], rejected_tokens=[3, 4, 7], prompt_length=2)]
    batch = collate_dpo(pairs)
    with torch.no_grad():
        assert critic.token_values(batch).abs().max().item() == 0.0  # a fresh head says 0
        torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator()
                              .manual_seed(0))
        critic.value_head.bias.fill_(0.5)
        values = critic(batch.input_ids, batch.attention_mask)
        hidden = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    output_hidden_states=True).hidden_states[-1]
    want = hidden @ critic.value_head.weight[0] + 0.5
    assert values.shape == (2, 4)
    torch.testing.assert_close(values[0], want[0])
    torch.testing.assert_close(values[1, :3], want[1, :3])  # row 1's last column is padding
    assert critic.token_values(batch).shape == (2, 3)
    assert not any(name.startswith("trunk.lm_head") for name in critic.state_dict())


def test_collate_dpo_interleaves_pairs():
    pairs = [DPOPair(chosen_tokens=[1, 2, 3], rejected_tokens=[1, 4], prompt_length=1),
             DPOPair(chosen_tokens=[5, 6], rejected_tokens=[5, 7, 8, 9], prompt_length=1)]
    batch = collate_dpo(pairs, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 0], [1, 4, 0, 0], [5, 6, 0, 0], [5, 7, 8, 9]]
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1]]


def test_dpo_loss_decreases_on_the_tiny_model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(4):
        prompt = list(rng.integers(3, 18, size=3))
        pairs.append(DPOPair(chosen_tokens=prompt + list(rng.integers(3, 18, size=3)),
                             rejected_tokens=prompt + list(rng.integers(3, 18, size=4)),
                             prompt_length=3))
    batch = collate_dpo(pairs)
    with torch.no_grad():
        ref = token_logprobs(reference, batch)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    losses, accuracy = [], 0.0
    for _ in range(6):
        loss, metrics = dpo_loss(PolicyLossInputs(token_logprobs(policy, batch),
                                                  batch.loss_mask, ref_logp=ref), beta=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        accuracy = metrics["accuracy_mean"].item()
    assert losses[0] == pytest.approx(LN2, abs=1e-6)  # policy == reference: z = 0
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.8 * LN2 and accuracy == 1.0
