"""Batching, GRPO advantages and log-probs against numbers worked out by hand (the losses:
test_algorithms_losses.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rft_hpc.algorithms.advantages import grpo_advantages
from rft_hpc.batch.logprobs import target_logprobs, token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import Experience, SFTSample
from rft_hpc.models.tiny import init_tiny_model

LN3 = math.log(3.0)


def test_collate_pads_and_shifts():
    a = Experience(tokens=[5, 6, 7, 8], prompt_length=2, logprobs=[0, 0, -0.5, -0.25],
                   reward=1.0, group_id=3)
    b = Experience(tokens=[9, 10, 11], prompt_length=1, reward=-2.0, group_id=4)  # NaN logprobs
    batch = collate([a, b], pad_id=1)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.targets.tolist() == [[6, 7, 8], [10, 11, 1]]
    # response_mask a = [0,0,1,1] -> [0,1,1]; b = [0,1,1,(pad 0)] -> [1,1,0]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert batch.loss_mask.dtype == torch.float32
    assert batch.old_logprobs.tolist() == [[0, -0.5, -0.25], [0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, -2.0]
    assert batch.group_ids.tolist() == [3, 4] and batch.group_ids.dtype == torch.long
    assert batch.has_old_logprobs.tolist() == [True, False]
    assert batch.num_tokens.item() == 4
    moved = batch.to("cpu")
    assert torch.equal(moved.targets, batch.targets) and moved.has_old_logprobs is not None


def test_collate_sft_has_no_rewards():
    batch = collate([SFTSample(tokens=[1, 2, 3], prompt_length=1)])
    assert batch.rewards is None and batch.group_ids is None
    assert batch.loss_mask.tolist() == [[1, 1]]
    assert batch.old_logprobs.tolist() == [[0, 0]]
    with pytest.raises(ValueError):
        collate([])


def test_grpo_advantages_by_hand():
    # group 7: rewards 1,0,0,1 -> mean 0.5, population std 0.5 -> +-0.5/(0.5+eps)
    # group 2: 2,2 (all equal) -> 0; group 9: a single rollout -> 0
    # group 4: 0,1,2 -> mean 1, std sqrt((1+0+1)/3) = sqrt(2/3) -> -1/sqrt(2/3), 0, +1/sqrt(2/3)
    rewards = torch.tensor([1.0, 2.0, 0.0, 0.0, 3.0, 0.0, 1.0, 2.0, 1.0, 2.0])
    groups = torch.tensor([7, 2, 4, 7, 9, 7, 4, 4, 7, 2])
    eps = 1e-6
    half = 0.5 / (0.5 + eps)
    s = math.sqrt(2 / 3) + eps
    expected = [half, 0.0, -1 / s, -half, 0.0, -half, 0.0, 1 / s, half, 0.0]
    adv = grpo_advantages(rewards, groups, eps=eps)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[[1, 4, 6, 9]].tolist() == [0.0, 0.0, 0.0, 0.0]  # exactly 0
    centred = grpo_advantages(rewards, groups, std_normalize=False)
    assert centred.tolist() == pytest.approx([0.5, 0, -1, -0.5, 0, -0.5, 0, 1, 0.5, 0])


def test_all_equal_group_is_exactly_zero_despite_rounding():
    # mean of 0.1,0.1,0.1 in floating point is not exactly 0.1; the advantage still is 0
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64),
                          torch.tensor([0, 0, 0]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


class _FixedLogits(torch.nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask, use_cache=None):
        return SimpleNamespace(logits=self.logits)


def test_token_logprobs_temperature_by_hand():
    # logits [0, 2 ln3, 0] at position 0, target 1:
    #   T=1: softmax = [1, 9, 1] / 11 -> ln(9/11);  T=2: [1, 3, 1] / 5 -> ln(3/5)
    # position 1 (the last) predicts nothing and is dropped
    logits = torch.tensor([[[0.0, 2 * LN3, 0.0], [5.0, 5.0, 5.0]]])
    batch = collate([SFTSample(tokens=[0, 1], prompt_length=1)])
    model = _FixedLogits(logits)
    assert token_logprobs(model, batch)[0, 0].item() == pytest.approx(math.log(9 / 11))
    assert token_logprobs(model, batch, 2.0)[0, 0].item() == pytest.approx(math.log(3 / 5))
    assert token_logprobs(model, batch).shape == (1, 1)


def test_target_logprobs_gradient_matches_plain_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    for temperature in (1.0, 0.7):
        got = target_logprobs(logits, targets, temperature, chunk_size=4)  # several chunks
        plain = torch.log_softmax(logits[:, :-1] / temperature, -1)
        want = plain.gather(-1, targets[..., None]).squeeze(-1)
        weights = torch.randn_like(got)
        (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
        (g_want,) = torch.autograd.grad((want * weights).sum(), logits)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g_got, g_want)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    folder = init_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_token_logprobs_on_tiny_model_equals_per_sequence_computation(tiny_model):
    rng = np.random.default_rng(0)
    records = [SFTSample(tokens=rng.integers(3, 20, size=n), prompt_length=2)
               for n in (9, 4, 13)]
    batch = collate(records)
    with torch.no_grad():
        got = token_logprobs(tiny_model, batch, temperature=0.8)
        for i, record in enumerate(records):
            ids = torch.as_tensor(record.tokens, dtype=torch.long)[None]
            logp = torch.log_softmax(tiny_model(ids).logits[0, :-1] / 0.8, dim=-1)
            want = logp[torch.arange(len(ids[0]) - 1), ids[0, 1:]]
            n = len(record.tokens) - 1
            torch.testing.assert_close(got[i, :n], want, rtol=0, atol=1e-5)
    assert got.shape == (3, 12)

