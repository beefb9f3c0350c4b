"""A stage that starts from the previous stage's final weights carries that stage's held-out
scores of them when both evaluate the same way, and scores them itself otherwise."""

from __future__ import annotations

from pathlib import Path

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir, read_jsonl, write_jsonl
from rft_hpc.eval.carry import carried_scores
from rft_hpc.monitor.metrics import MetricsWriter
from rft_hpc.run.stages import freeze_config

ANSWERS = [{"task_id": "t0", "answer": "3", "reward": 1.0},
           {"task_id": "t1", "answer": "5", "reward": 0.0}]


def previous_stage(tmp_path: Path, config: ExperimentConfig) -> RunDir:
    """A finished stage that scored its final weights (version 4)."""
    run = RunDir(tmp_path / "0-sft").create()
    freeze_config(config, run.config)
    metrics = MetricsWriter(run.metrics, "trainer", tensorboard=False)
    metrics.log(4, {"loss": 0.5})
    metrics.log(4, {"eval_accuracy": 0.5, "eval_reward": 0.5, "eval_reward_errors": 0})
    metrics.close()
    write_jsonl(run.heldout_answers(4), ANSWERS)
    return run


def next_stage(tmp_path: Path, config: ExperimentConfig, previous: RunDir,
               ) -> tuple[ExperimentConfig, RunDir]:
    start = config.model.model_copy(update={"start_weights": previous.weights_version(4)})
    return config.model_copy(update={"model": start}), RunDir(tmp_path / "1-grpo").create()


def test_the_same_evaluation_is_carried_with_its_answers(tmp_path):
    base = ExperimentConfig()
    previous = previous_stage(tmp_path, base)
    # when it evaluates (eval.interval) is not how
    changed = base.model_copy(update={"eval": base.eval.model_copy(update={"interval": 7})})
    config, run = next_stage(tmp_path, changed, previous)
    assert carried_scores(config, run) == {"eval_accuracy": 0.5, "eval_reward": 0.5,
                                           "eval_reward_errors": 0}
    assert read_jsonl(run.heldout_answers(0)) == ANSWERS


def test_another_evaluation_or_no_start_weights_is_scored_again(tmp_path):
    base = ExperimentConfig()
    previous = previous_stage(tmp_path, base)
    longer = base.model_copy(update={"eval": base.eval.model_copy(
        update={"max_new_tokens": 32})})
    config, run = next_stage(tmp_path, longer, previous)
    assert carried_scores(config, run) is None
    assert not run.heldout_answers(0).exists()
    assert carried_scores(base, run) is None  # starts from the model folder
    previous.heldout_answers(4).unlink()
    config, run = next_stage(tmp_path, base, previous)
    assert carried_scores(config, run) is None  # those weights were never scored
