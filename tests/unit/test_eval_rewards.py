"""Held-out evaluation scores answers with each task's own reward: greedy accuracy and
reward, mean@k and pass@k, and reward calls that raise counted and scored 0."""

from __future__ import annotations

import math
from dataclasses import replace

from rft_hpc.config.schema import EvalConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.eval.scoring import heldout_scores, score_tasks
from rft_hpc.tasks.task import Task

TASKS = [Task(f"t{i}", f"{10 + i}+{20 + i}=", str(30 + 2 * i)) for i in range(6)]


def test_eval_uses_the_tasks_reward(tiny_model):
    engine = HFEngine(tiny_model)
    settings = EvalConfig(k=2, max_new_tokens=4)
    exact = heldout_scores(engine, TASKS, settings, temperature=1.0, seed=0)
    assert exact["eval_accuracy"] == 0.0  # an untrained model: no exact answer
    answered = [replace(t, reward="helpers.rewards:answered") for t in TASKS]
    answers: list[dict] = []
    scores = score_tasks(engine, answered, k=2, n=2, temperature=1.0, max_new_tokens=4,
                         batch_size=8, seed=0, answers=answers)
    assert [a["task_id"] for a in answers] == [t.task_id for t in answered]
    assert all(a["reward"] == float(bool(a["answer"].strip())) for a in answers)
    expected = sum(bool(a["answer"].strip()) for a in answers) / len(answers)
    assert expected > 0 and scores["greedy_accuracy"] == expected
    own = heldout_scores(engine, answered, settings, temperature=1.0, seed=0)
    assert own["eval_accuracy"] == own["eval_reward"] == expected
    assert set(own) == {"eval_accuracy", "eval_reward", "eval_reward_errors", "eval_mean@2",
                        "eval_pass@2"}
    assert 0.0 < own["eval_mean@2"] <= own["eval_pass@2"] <= 1.0


def test_a_failing_reward_scores_zero_and_is_counted(tiny_model):
    engine = HFEngine(tiny_model)
    failing = [replace(t, reward="helpers.rewards:fails_on_odd") for t in TASKS]
    scores = heldout_scores(engine, failing, EvalConfig(k=2, max_new_tokens=4),
                            temperature=1.0, seed=0)
    assert scores["eval_reward_errors"] == 3 * (1 + 2)  # three tasks, greedy + 2 samples
    assert scores["eval_accuracy"] == scores["eval_pass@2"] == 0.5
    greedy_only = heldout_scores(engine, failing, EvalConfig(max_new_tokens=4),
                                 temperature=1.0, seed=0)
    assert set(greedy_only) == {"eval_accuracy", "eval_reward", "eval_reward_errors"}
    assert all(math.isnan(v) for v in heldout_scores(engine, [], EvalConfig(),
                                                     temperature=1.0, seed=0).values())


def test_samples_of_equal_prompts_in_different_batches_differ(tiny_model):
    # one prompt twelve times, four tasks a batch: every task draws its samples with seeds
    # of its own, so no two tasks' samples are the same texts (a batch's offset alone
    # reused an earlier batch's seeds)
    engine = HFEngine(tiny_model)
    same = [Task(f"s{i}", "12+34=", "46") for i in range(12)]
    answers: list[dict] = []
    score_tasks(engine, same, k=2, n=2, temperature=1.0, max_new_tokens=8, batch_size=8,
                seed=0, answers=answers)
    drawn = [tuple(a["samples"]) for a in answers]
    assert len(set(drawn)) == len(drawn)
    assert all(a["sample_rewards"] == [float(s == "46") for s in a["samples"]]
               for a in answers)
    again: list[dict] = []
    score_tasks(engine, same, k=2, n=2, temperature=1.0, max_new_tokens=8, batch_size=8,
                seed=0, answers=again)
    assert again == answers  # seeded: the same again
