"""A reward model named by its stage (`tasks.reward: {stage: rm}`): the stages after a
reward-model stage score with its export, the stages chain their policy weights past it,
and a reference that cannot work is refused at its key before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rft_hpc.config import ConfigError, load_config
from rft_hpc.run.stages import start_weights

RLHF = """\
run: {{name: rlhf, root: {root}}}
tasks: {{type: describe, reward: {reward}}}
stages:
{stages}
"""
RM = "  - {name: rm, mode: train, algorithm: {algorithm_type: reward_model}, data: {kind: dpo}}"
SFT = "  - {name: sft, mode: train, algorithm: {algorithm_type: sft}, data: {kind: sft}}"
GRPO = "  - {name: grpo, mode: both}"


def _write(tmp_path: Path, reward: str, *stages: str) -> Path:
    path = tmp_path / "rlhf.yaml"
    path.write_text(RLHF.format(root=tmp_path / "runs", reward=reward,
                                stages="\n".join(stages)))
    return path


def test_the_stages_after_the_reward_model_stage_score_with_its_export(tmp_path):
    config = load_config(_write(tmp_path, "{stage: rm, normalize: running}", RM, SFT, GRPO))
    stages = dict(config.stage_configs())
    export = (tmp_path / "runs" / "rlhf" / "stages" / "0-rm" / "reward_model").resolve()
    for name in ("sft", "grpo"):
        reward = stages[name].tasks.reward
        assert (reward.model, reward.stage, reward.normalize) == (export, None, "running")
    assert (stages["rm"].tasks.reward.stage, stages["rm"].tasks.reward.model) == ("rm", None)


def test_a_weighted_sum_names_the_stage_in_one_of_its_terms(tmp_path):
    reward = "[{name: rft_hpc.tasks.preferences:gold_reward, weight: 0.5}, {stage: rm}]"
    config = load_config(_write(tmp_path, reward, RM, GRPO))
    terms = dict(config.stage_configs())["grpo"].tasks.reward
    assert terms[0].name.endswith("gold_reward") and terms[1].model.name == "reward_model"


@pytest.mark.parametrize(("stages", "words"), [
    ((SFT, GRPO), "no stage named 'rm'"),
    ((SFT.replace("sft,", "rm,", 1), GRPO), "trains sft, not a reward model"),
    ((SFT, RM, GRPO), "must come before every stage that is not a reward model"),
])
def test_a_reference_that_cannot_work_is_refused_at_its_key(tmp_path, stages, words):
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, "{stage: rm}", *stages))
    (problem,) = caught.value.problems
    assert problem.key == "tasks.reward.stage" and words in problem.message


def test_a_run_without_stages_cannot_name_one(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("tasks: {type: describe, reward: {stage: rm}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "it has no stages" in caught.value.problems[0].message


@pytest.mark.parametrize("reward", ["{model: /x, stage: rm}", "{normalize: batch, stage: null}"])
def test_a_reward_model_is_a_folder_or_a_stage_never_both(tmp_path, reward):
    path = tmp_path / "one.yaml"
    path.write_text(f"tasks: {{type: describe, reward: {reward}}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "one of the two" in str(caught.value)


def test_policy_stages_start_from_the_last_policy_weights_not_the_reward_models():
    results = [{"weights": "/r/stages/0-sft/weights/v000010"},
               {"weights": "/r/stages/1-rm/weights/v000020",
                "reward_model": "/r/stages/1-rm/reward_model"}]
    assert start_weights(results) == Path("/r/stages/0-sft/weights/v000010")
    assert start_weights(results[1:]) is None


def test_a_gold_reward_that_cannot_be_called_is_refused_at_its_key(tmp_path):
    from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS

    path = tmp_path / "gold.yaml"
    path.write_text("tasks: {type: describe}\neval: {gold: rft_hpc.tasks.nowhere:gold}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, checks=PREFLIGHT_CHECKS)
    (problem,) = caught.value.problems
    assert (problem.key, problem.line) == ("eval.gold", 2)
    path.write_text("tasks: {type: describe}\n"
                    "eval: {gold: rft_hpc.tasks.preferences:gold_reward}\n")
    assert load_config(path, checks=PREFLIGHT_CHECKS).eval.gold.name.endswith("gold_reward")
