"""The reward model's Bradley-Terry loss and the config checks of a reward-model stage."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rft_hpc.algorithms.reward_model import bradley_terry_loss
from rft_hpc.config import ConfigError, load_config


def test_the_loss_is_minus_log_sigmoid_of_the_gap_summed_over_pairs():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    loss, sums = bradley_terry_loss(chosen, rejected)
    want = sum(-math.log(1 / (1 + math.exp(-g))) for g in (1.0, 0.0, -2.0))
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert sums == {"correct": 1.0, "reward_gap": pytest.approx(-1.0)}


def test_a_margin_asks_the_chosen_response_to_win_by_it():
    chosen, rejected = torch.tensor([2.0]), torch.tensor([1.0])
    plain, _ = bradley_terry_loss(chosen, rejected)
    with_margin, sums = bradley_terry_loss(chosen, rejected, torch.tensor([1.0]))
    assert float(with_margin) == pytest.approx(math.log(2.0))
    assert float(with_margin) > float(plain) and sums["correct"] == 1.0


def test_gradients_push_the_chosen_score_up_and_the_rejected_down():
    chosen = torch.tensor([0.5], requires_grad=True)
    rejected = torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert float(chosen.grad) < 0 < float(rejected.grad)


BASE = """\
mode: train
algorithm: {algorithm_type: reward_model}
data: {source: tasks, kind: dpo}
"""


def _problems(tmp_path: Path, text: str) -> list[tuple[str, str]]:
    path = tmp_path / "rm.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return [(p.key, p.message) for p in caught.value.problems]


def test_a_reward_model_stage_loads(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text(BASE)
    assert load_config(path).algorithm.algorithm_type == "reward_model"


@pytest.mark.parametrize(("change", "key", "words"), [
    ("mode: both\n", "mode", "mode train"),
    ("data: {source: tasks, kind: sft}\n", "data.kind", "preference pairs"),
    ("trainer: {parallel: fsdp}\n", "trainer.backend", "ddp"),
])
def test_a_reward_model_stage_is_refused_at_its_key(tmp_path, change, key, words):
    text = BASE.replace("mode: train\n", "") if change.startswith("mode") else BASE
    if change.startswith("data"):
        text = text.replace("data: {source: tasks, kind: dpo}\n", "")
    ((got_key, message),) = _problems(tmp_path, text + change)
    assert got_key == key and words in message
