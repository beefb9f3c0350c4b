"""Off-policy correction (`rft_hpc.algorithms.off_policy`): each correction's weights and
metrics against values worked out by hand, the PPO loss they weight, and the trainer's
log-probs under the weights a rollout was generated with (`trainer.versions`)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from rft_hpc.algorithms.off_policy import Correction, correction_weights
from rft_hpc.algorithms.policy_losses import PolicyLossInputs, ppo_policy_loss
from rft_hpc.buffer.reader import Batch
from rft_hpc.config import load_config
from rft_hpc.core.errors import UserError
from rft_hpc.explorer.workflow import completion_to_experience
from rft_hpc.tasks.source import build_tasks
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.trainer import Trainer

# Two rollouts, three and two trained tokens; token ratios rho = trainer / engine probability
RHO = [[0.4, 1.0, 3.0], [1.5, 0.9, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ENGINE = torch.full((2, 3), -1.0)
TRAINER = ENGINE + torch.log(torch.tensor(RHO))
# sequence ratios: 0.4 * 1 * 3 = 1.2 and 1.5 * 0.9 = 1.35; geometric means 1.2 ** (1/3) =
# 1.063 and 1.35 ** (1/2) = 1.162


def weights(type: str, **kw: object) -> tuple[list[list[float]], dict[str, float]]:
    w, metrics = correction_weights(TRAINER, ENGINE, MASK, Correction.of(type, **kw))
    return w.tolist(), metrics


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


CASES = [  # type, settings, weights, masked fraction, truncated fraction
    ("none", {}, [[1, 1, 1], [1, 1, 0]], 0.0, 0.0),
    ("tis", {"cap": 2.0}, [[0.4, 1, 2], [1.5, 0.9, 0]], 0.0, 1 / 5),
    ("tis", {"level": "sequence", "cap": 2.0}, [[1.2] * 3, [1.35, 1.35, 0]], 0.0, 0.0),
    ("tis", {"level": "sequence", "cap": 1.3}, [[1.2] * 3, [1.3, 1.3, 0]], 0.0, 2 / 5),
    ("mis", {"cap": 2.0}, [[0.4, 1, 0], [1.5, 0.9, 0]], 1 / 5, 0.0),
    ("mis", {"level": "sequence", "cap": 1.3}, [[1.2] * 3, [0, 0, 0]], 2 / 5, 0.0),
    ("icepop", {"low": 0.5, "high": 2.0}, [[0, 1, 0], [1.5, 0.9, 0]], 2 / 5, 0.0),
    ("icepop", {}, [[0, 1, 3], [1.5, 0.9, 0]], 1 / 5, 0.0),  # IcePop's [0.5, 5]
    ("geo_mask", {"low": 0.9, "high": 1.1}, [[1, 1, 1], [0, 0, 0]], 2 / 5, 0.0),
    ("geo_mask", {}, [[0, 0, 0], [0, 0, 0]], 1.0, 0.0),  # within 1 %: neither
]


@pytest.mark.parametrize(("type", "settings", "expected", "masked", "truncated"), CASES)
def test_each_correction_gives_the_hand_computed_weights(type, settings, expected, masked,
                                                         truncated):
    w, metrics = weights(type, **settings)
    assert flat(w) == pytest.approx(flat(expected), abs=1e-6)
    assert metrics["correction/masked_fraction"] == pytest.approx(masked)
    assert metrics["correction/truncated_fraction"] == pytest.approx(truncated)
    on = [x for row, m in zip(expected, MASK.tolist(), strict=True)
          for x, k in zip(row, m, strict=True) if k]
    assert metrics["correction/weight_mean"] == pytest.approx(sum(on) / 5)


def test_ratio_metrics_are_those_of_the_trained_tokens():
    _, metrics = weights("tis")
    # k3 of KL(engine || trainer): mean of rho - 1 - ln rho over 0.4, 1, 3, 1.5, 0.9
    assert metrics["correction/mismatch_kl"] == pytest.approx(0.2635148, abs=1e-6)
    # sorted 0.4, 0.9, 1, 1.5, 3, linear interpolation: 5 % at 0.2 -> 0.5; 95 % at 3.8 -> 2.7
    assert metrics["correction/ratio_p05"] == pytest.approx(0.5)
    assert metrics["correction/ratio_p50"] == pytest.approx(1.0)
    assert metrics["correction/ratio_p95"] == pytest.approx(2.7)
    assert metrics["correction/ratio_max"] == pytest.approx(3.0)
    _, same = correction_weights(ENGINE, ENGINE, MASK, Correction.of("tis"))
    assert same["correction/mismatch_kl"] == 0.0 and same["correction/ratio_max"] == 1.0


def test_the_weights_scale_each_token_of_the_ppo_loss():
    logp = TRAINER.clone().requires_grad_(True)  # ratio 1 to the trainer's log-probs
    w, _ = correction_weights(TRAINER, ENGINE, MASK, Correction.of("tis", cap=2.0))
    inputs = PolicyLossInputs(logp=logp, mask=MASK, old_logp=TRAINER,
                              advantages=torch.ones(2), weights=w)
    loss, _ = ppo_policy_loss(inputs, clip_ratio_c=None)
    assert float(loss.detach()) == pytest.approx(-(0.4 + 1 + 2 + 1.5 + 0.9) / 5)
    loss.backward()  # d/d logp of -w * exp(logp - old) at ratio 1: -w / 5 per trained token
    assert flat(logp.grad.tolist()) == pytest.approx([-0.08, -0.2, -0.4, -0.3, -0.18, 0.0])


def _config(tmp_path, model, **correction):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"root": str(tmp_path)}, "model": {"path": str(model)},
        "tasks": {"type": "arithmetic", "digits": 1, "eval_size": 8},
        "trainer": {"lr": 1e-2}, "algorithm": {"correction": correction}}))
    return load_config(path)


def test_a_level_or_a_loss_the_correction_does_not_apply_to_is_refused(tmp_path, tiny_model):
    with pytest.raises(UserError, match="level: sequence is for tis and mis"):
        _config(tmp_path, tiny_model, type="icepop", level="sequence")
    config = _config(tmp_path, tiny_model, type="tis")
    config.algorithm.policy_loss_fn = "opmd"
    with pytest.raises(UserError, match="the opmd loss takes no ratio"):
        AlgorithmPlan.of(config)


def test_the_trainer_computes_each_rollout_under_the_weights_it_was_generated_with(
        tmp_path, tiny_model):
    trainer = Trainer(_config(tmp_path, tiny_model, type="tis", version_window=2))
    tasks, _ = build_tasks(trainer.config.tasks, 0)
    records = []
    for gid, task in enumerate(tasks[:4]):  # generated with version 0, the starting weights
        prompt = trainer.engine.prompt_ids(task)
        for j, c in enumerate(trainer.engine.generate([prompt], n=4, max_new_tokens=3,
                                                      temperature=1.0, seed=gid)[0]):
            records.append(completion_to_experience(task, prompt, c, reward=float(j % 2),
                                                    group_id=gid, version=0, step=0))
    batch = Batch(records=records, weights=[1.0] * 16, uses=[0] * 16)
    first = trainer.step(batch, version=0)
    # the trainer's forward and the engine's sampling agree for the same weights
    assert first["correction/mismatch_kl"] < 1e-6
    assert first["correction/ratio_p05"] == pytest.approx(1.0, abs=1e-3)
    assert first["correction/ratio_p95"] == pytest.approx(1.0, abs=1e-3)
    assert first["staleness/0"] == 1.0 and first["correction/unknown_version_records"] == 0
    # one step later the same rollouts are one version old: computed under version 0 again
    second = trainer.step(batch, version=1)
    assert second["staleness/1"] == 1.0 and second["staleness/mean"] == 1.0
    assert second["correction/mismatch_kl"] == pytest.approx(first["correction/mismatch_kl"],
                                                             abs=1e-9)
    assert second["correction/unknown_version_records"] == 0
    # under the current weights (a version not held) the gap is the two steps' change
    for r in records:
        r.policy_version = -7
    third = trainer.step(batch, version=2)
    assert third["correction/unknown_version_records"] == 16
    assert third["correction/mismatch_kl"] > 100 * max(first["correction/mismatch_kl"], 1e-9)
    assert not math.isnan(third["loss"])


def test_each_token_is_computed_under_the_version_that_sampled_it():
    import numpy as np

    from rft_hpc.buffer.records import Experience
    from rft_hpc.trainer.prepare import token_versions

    spanning = Experience(tokens=np.arange(7), prompt_length=3, policy_version=0,
                          info={"last_version": 2, "version_spans": [[0, 0], [2, 2]]})
    plain = Experience(tokens=np.arange(5), prompt_length=3, policy_version=1)
    # target column c predicts token c + 1: response tokens 3..6 are columns 2..5
    assert token_versions([spanning, plain], 6, 9).tolist() == [[0, 0, 0, 0, 2, 2],
                                                                [1, 1, 1, 1, 1, 1]]
