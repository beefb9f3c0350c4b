"""Reward functions: the math verifier, the format reward, rewards with arguments from the
config, the checks before a run (unknown, failing import, arguments the function refuses)
and the explorer's failure limit. No processes: rewards are called in this one."""

from __future__ import annotations

import sys

import pytest

from rft_hpc.config import ConfigError, load_config
from rft_hpc.config.rewards import RewardSpec
from rft_hpc.core.errors import UserError
from rft_hpc.explorer.workflow import RewardFailures
from rft_hpc.tasks.format_reward import think_answer_format
from rft_hpc.tasks.math_reward import math_verify, reference_text
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task

GSM8K = ("Natalia sold 48 clips in April and half as many in May.\n"
         "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72")
MATH = r"The probability is $\frac{6}{8} = \boxed{\frac{3}{4}}$."


@pytest.mark.parametrize(("reference", "response", "score"), [
    ("#### 42", "42", 1.0),
    ("#### 42", "The answer is 42.", 1.0),
    ("#### 42", r"so the total is $\boxed{42}$", 1.0),
    ("#### 42", "41", 0.0),
    ("#### 42", "I first got 24, then 41", 0.0),
    (GSM8K, "She sold 72 clips.", 1.0),
    (GSM8K, "She sold 24 clips in May.", 0.0),
    ("#### 1,600", "1600", 1.0),
    (MATH, r"\boxed{\dfrac34}", 1.0),
    (MATH, "0.75", 1.0),
    (MATH, r"$\frac{6}{8}$", 1.0),
    (MATH, r"\boxed{\frac{2}{3}}", 0.0),
    (r"\frac{1}{2}", "1/2", 1.0),
    (r"\frac12", r"$\frac{1}{2}$", 1.0),
    (r"\sqrt{2}", r"\boxed{\sqrt 2}", 1.0),
    ("0.5", r"\frac{1}{2}", 1.0),
    (r"\frac{1}{3}", "0.3333", 0.0),
    ("-3", "x = -3", 1.0),
    ("42", "no number here", 0.0),
    ("not math", "not math", 0.0),
])
def test_math_verify_reads_gsm8k_boxed_latex_and_plain_answers(reference, response, score):
    assert math_verify(Task("t", "", reference), response) == score


def test_math_verify_reads_the_answer_tag():
    task = Task("t", "", "#### 18")
    assert math_verify(task, "<think>5+13 is 18? or 17</think><answer>18</answer>") == 1.0
    assert math_verify(task, "<think>it is 18</think><answer>17</answer>") == 0.0
    assert math_verify(task, "18") == 1.0  # no tag: the whole response
    assert math_verify(task, "18", require_tag=True) == 0.0
    assert math_verify(task, "<think>x</think> 18", answer_tag=None) == 1.0


def test_reference_text_takes_what_follows_the_last_hashes():
    assert reference_text(GSM8K) == "72"
    assert reference_text(MATH) == MATH
    assert reference_text(" 7 ") == "7"


@pytest.mark.parametrize(("response", "score"), [
    ("<think>a</think><answer>1</answer>", 1.0),
    (" <think>a\nb</think>\n<answer> 1 </answer>\n", 1.0),
    ("<think></think><answer>1</answer>", 0.0),
    ("<think>a</think>and<answer>1</answer>", 0.0),
    ("<answer>1</answer>", 0.0),
    ("<think>a<think>b</think><answer>1</answer>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
    ("1", 0.0),
])
def test_think_answer_format(response, score):
    assert think_answer_format(Task("t"), response) == score


def test_think_answer_format_renames_or_drops_the_think_block():
    assert think_answer_format(Task("t"), "<answer>1</answer>", think_tag=None) == 1.0
    assert think_answer_format(Task("t"), "<r>x</r><a>1</a>", think_tag="r",
                               answer_tag="a") == 1.0


def write_module(tmp_path, monkeypatch, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_reward_args_from_the_config_reach_the_function(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "args_reward",
                 "def score(task, response, *, bonus):\n    return 1.0 + bonus\n")
    config = tmp_path / "exp.yaml"
    config.write_text("tasks:\n  type: arithmetic\n  eval_size: 2\n  reward:\n"
                      "    name: args_reward:score\n    args: {bonus: 0.5}\n")
    cfg = load_config(config, checks=PREFLIGHT_CHECKS)
    assert cfg.tasks.reward == RewardSpec(name="args_reward:score", args={"bonus": 0.5})
    train, held_out = build_tasks(cfg.tasks, 0)
    assert call_reward(train[0], "x") == call_reward(held_out[0], "x") == 1.5
    plain = load_config(config, ["tasks.reward=math_verify"])
    assert build_tasks(plain.tasks, 0)[0][0].reward_args == {}


def problem(tmp_path, reward_yaml):
    config = tmp_path / "exp.yaml"
    config.write_text(f"run: {{name: r}}\ntasks:\n  type: arithmetic\n  reward: {reward_yaml}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, checks=PREFLIGHT_CHECKS)
    assert len(info.value.problems) == 1, info.value
    return str(info.value)


def test_unknown_and_unimportable_rewards_are_one_problem_at_their_line(tmp_path, monkeypatch):
    where = f"{tmp_path / 'exp.yaml'}:4: tasks.reward: "
    assert problem(tmp_path, "exact_mach") == where + (
        "unknown reward 'exact_mach'; built-in: exact_match, exact_match_with_format, "
        "math_verify, think_answer_format, or give package.module:function")
    assert problem(tmp_path, "no_such_module_xyz:f") == where + (
        "reward function 'no_such_module_xyz:f' cannot be imported: "
        "No module named 'no_such_module_xyz'")
    write_module(tmp_path, monkeypatch, "broken_reward", "raise RuntimeError('no GPU here')\n")
    assert problem(tmp_path, "broken_reward:score") == where + (
        "reward function 'broken_reward:score' cannot be imported: module broken_reward "
        "raised RuntimeError: no GPU here")
    write_module(tmp_path, monkeypatch, "typo_reward", "def score(task, response):\n    return 1\n")
    assert "has no attribute 'scor'" in problem(tmp_path, "typo_reward:scor")
    assert problem(tmp_path, "{name: math_verify, args: {answer_tg: x}}") == (
        f"{tmp_path / 'exp.yaml'}:4: tasks.reward.args: reward 'math_verify' cannot be called "
        "as fn(task, response, **args): got an unexpected keyword argument 'answer_tg'")


def test_a_reward_that_takes_no_response_is_refused(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "narrow_reward", "def score(task):\n    return 1\n")
    assert "cannot be called as fn(task, response)" in problem(tmp_path, "narrow_reward:score")


def test_a_task_sets_reward_is_checked_at_its_own_key(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text("pipeline:\n  tasksets:\n    - name: a\n      tasks: {type: arithmetic}\n"
                      "    - name: b\n      tasks:\n        type: arithmetic\n"
                      "        reward: nowhere_xyz:f\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, checks=PREFLIGHT_CHECKS)
    assert str(info.value).startswith(f"{config}:8: pipeline.tasksets[1].tasks.reward: reward "
                                      "function 'nowhere_xyz:f' cannot be imported")


def test_rows_that_name_their_own_reward_are_checked(tmp_path):
    (tmp_path / "tasks.jsonl").write_text(
        '{"task_id": "a", "prompt": "1+1=", "answer": "2"}\n'
        '{"task_id": "b", "prompt": "1+2=", "answer": "3", "reward": "gone_xyz:f"}\n')
    config = tmp_path / "exp.yaml"
    config.write_text(f"tasks: {{type: file, path: {tmp_path / 'tasks.jsonl'}}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, checks=PREFLIGHT_CHECKS)
    assert f"{config}:1: tasks.path: task b names a reward that fails: reward function " \
           "'gone_xyz:f' cannot be imported" in str(info.value)


def test_the_failure_limit_counts_all_calls_since_the_start():
    failures = RewardFailures(limit=0.25)
    failures.add(8, {"reward_errors": 1.0, "reward_timeouts": 1.0})  # 2 of 8: at the limit
    failures.add(8, {"reward_errors": 0.0, "reward_timeouts": 0.0})
    with pytest.raises(UserError, match=r"6 of 20 reward calls failed .* more than "
                                        r"explorer.reward_failure_limit 0.25"):
        failures.add(4, {"reward_errors": 3.0, "reward_timeouts": 1.0})
    never = RewardFailures(limit=1.0)
    never.add(8, {"reward_errors": 8.0})
