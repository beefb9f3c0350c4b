"""ReMax (`algorithm_type: remax`): the advantage against a worked example, the explorer's
greedy response per group (its reward in every record of the group, as greedy decoding of the
same prompt scores), and the config refusals."""

from __future__ import annotations

import pytest
import torch
import yaml

from rft_hpc.algorithms.advantages import AdvantageBatch
from rft_hpc.algorithms.registry import compute_advantages
from rft_hpc.config import load_config
from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.protocols import StepTasks
from rft_hpc.explorer.step_stream import StepStream
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.source import build_tasks
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.prepare import greedy_baselines


def test_remax_subtracts_the_greedy_responses_reward():
    # rewards 1, 0, 1 against greedy rewards 0.5, 0.5, 1: advantages 0.5, -0.5, 0 on each
    # record's trained tokens
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.0, 1.0]), mask=mask,
                           baselines=torch.tensor([0.5, 0.5, 1.0]))
    adv, returns = compute_advantages("remax", batch)
    assert adv.tolist() == [[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]] and torch.equal(adv, returns)
    with pytest.raises(ValueError, match="baselines"):
        compute_advantages("remax", AdvantageBatch(rewards=torch.ones(3), mask=mask))


def test_the_explorer_scores_a_greedy_response_per_group(tmp_path, tiny_model):
    config = load_config(_config(tmp_path, tiny_model))
    tasks, _ = build_tasks(config.tasks, 0)
    tasks = tasks[:4]
    engine = HFEngine(tiny_model)
    settings = SamplingSettings(repeat=4, max_new_tokens=5, temperature=1.0)
    with RewardPool(workers=1, timeout=60.0) as pool:
        stream = StepStream(engine, settings, pool, window=1, greedy_baseline=True)
        stream.submit(StepTasks(0, tasks, range(4), 7))
        records = []
        while not records:
            stream.advance()
            records = [e for done in stream.completed() for e in done.experiences]
    assert len(records) == 16
    for j, task in enumerate(tasks):
        (greedy,) = engine.generate([engine.prompt_ids(task)], n=1, max_new_tokens=5,
                                    temperature=0.0, seed=0)[0]
        want = exact_match(task, greedy.text)
        group = [r for r in records if r.group_id == j]
        assert [r.info["greedy_reward"] for r in group] == [want] * 4
    assert greedy_baselines(records).tolist() == [r.info["greedy_reward"] for r in records]
    records[0].info.pop("greedy_reward")
    with pytest.raises(Exception, match="greedy baseline"):
        greedy_baselines(records)


def test_remax_is_a_preset_and_refused_with_a_multi_turn_workflow(tmp_path, tiny_model):
    config = load_config(_config(tmp_path, tiny_model))
    plan = AlgorithmPlan.of(config)
    assert (plan.advantage_fn, plan.policy_loss_fn) == ("remax", "ppo")
    assert config.algorithm.uses_greedy_baseline()
    with pytest.raises(Exception, match="greedy response per prompt"):
        load_config(_config(tmp_path, tiny_model,
                            explorer={"workflow": {"type": "multi_turn"}}))


def _config(tmp_path, model, **extra):
    data = {"run": {"root": str(tmp_path), "seed": 0}, "model": {"path": str(model)},
            "tasks": {"type": "arithmetic", "digits": 1, "eval_size": 8},
            "algorithm": {"algorithm_type": "remax"}, **extra}
    path = tmp_path / "remax.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
