"""The config forms of a reward (a name, `{name, args}`, a reward model `{model}`, a
weighted list) and what tasks they give, the frozen config's round trip, and the checks
before a run: a reward model folder that is missing, a causal LM, more than one label, or
used outside the single-turn workflow is one problem at its key and line."""

from __future__ import annotations

import shutil

import pytest
import yaml
from helpers.reward_models import reward_model

from rft_hpc.config import ConfigError, load_config
from rft_hpc.config.rewards import RewardModelSpec, RewardSpec
from rft_hpc.runtime.common import freeze_config
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return reward_model(tmp_path_factory.mktemp("rm") / "rm")


def write(tmp_path, reward_yaml, extra=""):
    config = tmp_path / "exp.yaml"
    config.write_text(f"run: {{name: r}}\ntasks:\n  type: arithmetic\n  eval_size: 2\n"
                      f"  reward: {reward_yaml}\n{extra}")
    return config


def test_the_existing_forms_mean_what_they_meant(tmp_path):
    cfg = load_config(write(tmp_path, "exact_match"), checks=PREFLIGHT_CHECKS)
    assert cfg.tasks.reward == RewardSpec(name="exact_match")
    task = build_tasks(cfg.tasks, 0)[0][0]
    assert (task.reward, task.reward_args, task.reward_terms) == ("exact_match", {}, ())
    cfg = load_config(write(tmp_path, "{name: math_verify, args: {require_tag: true}}"))
    task = build_tasks(cfg.tasks, 0)[0][0]
    assert (task.reward, task.reward_args, task.reward_terms) == (
        "math_verify", {"require_tag": True}, ())


def test_a_model_and_a_weighted_list_become_the_tasks_terms(tmp_path, rm):
    cfg = load_config(write(tmp_path, f"{{model: {rm}, normalize: running}}"),
                      checks=PREFLIGHT_CHECKS)
    assert cfg.tasks.reward == RewardModelSpec(model=rm, normalize="running")
    task = build_tasks(cfg.tasks, 0)[0][0]
    assert task.reward_terms == (cfg.tasks.reward,) and task.reward == f"model:{rm}"
    cfg = load_config(write(tmp_path, f"[{{name: exact_match, weight: 0.5}}, exact_match, "
                                      f"{{model: {rm}, weight: 2}}]"), checks=PREFLIGHT_CHECKS)
    terms = (RewardSpec(name="exact_match", weight=0.5), RewardSpec(name="exact_match"),
             RewardModelSpec(model=rm, weight=2.0))
    assert tuple(cfg.tasks.reward) == terms
    task = build_tasks(cfg.tasks, 0)[0][0]
    assert task.reward_terms == terms
    assert task.reward == f"0.5*exact_match + exact_match + 2*model:{rm}"
    assert task.to_json()["reward_terms"][2] == {"model": str(rm), "stage": None,
                                                 "normalize": "none", "weight": 2.0,
                                                 "batch_size": 32}


def test_a_weighted_function_sum_is_called_in_process_and_a_model_is_not(rm):
    task = Task("t", "1+1=", "2", reward="sum", reward_terms=(
        RewardSpec(name="exact_match", weight=0.5),
        RewardSpec(name="exact_match_with_format", weight=2.0)))
    assert call_reward(task, "2") == pytest.approx(0.5 + 2 * 1.1)
    with pytest.raises(ValueError, match="score through their model scorers"):
        call_reward(Task("t", "1+1=", "2", reward_terms=(RewardModelSpec(model=rm),)), "2")


@pytest.mark.parametrize("reward", [
    "exact_match", "{name: math_verify, args: {answer_tag: a}}",
    "{model: MODEL, normalize: batch, batch_size: 4}",
    "[{name: exact_match, weight: 0.5}, {model: MODEL, weight: 1.5}]"])
def test_the_frozen_config_loads_back_the_same(tmp_path, rm, reward):
    cfg = load_config(write(tmp_path, reward.replace("MODEL", str(rm))))
    frozen = tmp_path / "frozen.yaml"
    freeze_config(cfg, frozen)
    again = load_config(frozen)
    assert again == cfg
    assert yaml.safe_load(frozen.read_text())["tasks"]["reward"] == \
        cfg.model_dump(mode="json")["tasks"]["reward"]


def problems(config):
    with pytest.raises(ConfigError) as info:
        load_config(config, checks=PREFLIGHT_CHECKS)
    return [str(p) for p in info.value.problems]


def test_a_missing_reward_model_folder_is_named_at_its_key(tmp_path):
    config = write(tmp_path, f"{{model: {tmp_path / 'nowhere'}}}")
    assert problems(config) == [
        f"{config}:5: tasks.reward.model: reward model folder "
        f"'{tmp_path / 'nowhere'}' does not exist"]


def test_a_causal_lm_in_a_list_is_refused_at_its_entry(tmp_path, rm):
    causal = rm.with_name(rm.name + "-base")  # the chat model the reward model was made from
    config = write(tmp_path, f"\n    - exact_match\n    - {{model: {causal}, weight: 2}}")
    assert problems(config) == [
        f"{config}:7: tasks.reward[1].model: '{causal}' is not a sequence-classification "
        "model (architectures: Qwen2ForCausalLM); a reward model is a "
        "...ForSequenceClassification folder with num_labels 1"]


def test_a_classifier_with_two_labels_is_refused(tmp_path, rm):
    from transformers import AutoConfig

    two = tmp_path / "two-labels"
    shutil.copytree(rm, two)
    config = AutoConfig.from_pretrained(str(two), local_files_only=True)
    config.num_labels = 2
    config.save_pretrained(str(two))
    (problem,) = problems(write(tmp_path, f"{{model: {two}}}"))
    assert problem.endswith(f"tasks.reward.model: '{two}' has num_labels 2; a reward model "
                            "gives one score (num_labels 1)")


def test_a_task_sets_model_and_a_multi_turn_run_are_refused_at_their_keys(tmp_path, rm):
    config = tmp_path / "exp.yaml"
    config.write_text(f"pipeline:\n  tasksets:\n    - name: a\n      tasks: {{type: arithmetic}}\n"
                      f"    - name: b\n      tasks:\n        type: arithmetic\n"
                      f"        reward: [exact_match, {{model: {tmp_path / 'no-rm'}}}]\n")
    assert problems(config) == [
        f"{config}:8: pipeline.tasksets[1].tasks.reward[1].model: reward model folder "
        f"'{tmp_path / 'no-rm'}' does not exist"]
    config = write(tmp_path, f"{{model: {rm}}}",
                   "explorer:\n  workflow: {type: multi_turn, env: x.y:Env}\n")
    (problem,) = problems(config)
    assert problem.endswith("tasks.reward: reward models and judges score in the "
                            "explorer's single-turn workflow only; this run uses "
                            "explorer.workflow.type multi_turn")


@pytest.mark.parametrize(("reward", "where", "message"), [
    ("{model: /x, normalize: zscore}", "tasks.reward.normalize",
     "expected one of 'none', 'batch', 'running', got 'zscore'"),
    ("[exact_match, {model: /x, weight: heavy}]", "tasks.reward[1].weight",
     "expected a number, got 'heavy'"),
    ("[exact_match, {model: /x, nrmalize: batch}]", "tasks.reward[1].nrmalize",
     "unknown key; did you mean 'normalize'?"),
    ("[exact_mach]", "tasks.reward[0].name", "unknown reward 'exact_mach'"),
    ("[]", "tasks.reward", "needs at least 1 entry, got 0"),
])
def test_schema_errors_of_reward_terms_are_at_the_users_keys(tmp_path, reward, where, message):
    (problem,) = problems(write(tmp_path, reward))
    assert f"exp.yaml:5: {where}: {message}" in problem, problem
