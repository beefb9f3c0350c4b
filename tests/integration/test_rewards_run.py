"""Rewards through the CLI, as a user's: a reward that cannot be used is refused by
`validate`, `run` and `submit` with one message and exit 2 before anything starts; at run
time a reward that raises on some tasks and one that hangs past `explorer.reward_timeout`
cost only their rollouts (scored 0, counted in the metrics, logged with the task ids), and
a reward failing more often than `explorer.reward_failure_limit` stops the run with one
message. The user's module sits next to the config, where `rft-hpc` is run; the rewards
are given to two task sets, one with arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers.runs import rollouts

from rft_hpc.config.tasks import ArithmeticTasks
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.source import build_tasks

USER_REWARDS = '''
import time

def raises_on_odd(task, response):
    """Raises for the tasks whose first operand is odd."""
    if int(task.task_id.split("+")[0]) % 2:
        raise ValueError(f"cannot score {task.task_id}")
    return float(response.strip() == task.answer)

def hangs(task, response, *, seconds, spare):
    """Hangs `seconds` on every task but those in `spare`."""
    if task.task_id not in spare:
        time.sleep(seconds)
    return float(response.strip() == task.answer)

def always_raises(task, response):
    raise RuntimeError("this reward is broken")
'''


def rft(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def held_out_ids() -> list[str]:
    """The eval split of the hanging task set: the trainer scores it with the reward in its
    own process, without the workers' time limit (docs/rewards.md), so it must not hang."""
    _, held_out = build_tasks(ArithmeticTasks(digits=1, eval_size=4), 0)
    return [t.task_id for t in held_out]


def experiment(tmp_path, tiny_model, *, limit=0.2, raising="user_rewards:raises_on_odd"):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    config = tmp_path / "exp.yaml"
    config.write_text(f"""\
run: {{name: rewards, root: {tmp_path / 'runs'}}}
model: {{path: {tiny_model}}}
tasks: {{type: arithmetic, eval_size: 4}}
explorer:
  count: 1
  tasks_per_step: 2
  repeat: 4
  max_new_tokens: 4
  reward_timeout: 1.0
  reward_failure_limit: {limit}
trainer: {{steps: 4, batch_size: 8}}
eval: {{interval: 0, max_new_tokens: 4}}
sync: {{method: checkpoint, interval: 1, offset: 1}}
pipeline:
  tasksets:
    - name: raising
      tasks: {{type: arithmetic, digits: 1, eval_size: 4, reward: "{raising}"}}
    - name: hanging
      tasks:
        type: arithmetic
        digits: 1
        eval_size: 4
        reward:
          name: user_rewards:hangs
          args: {{seconds: 120, spare: {json.dumps(held_out_ids())}}}
""")
    return config


BAD = {
    "unknown": ("math_verfy", "unknown reward 'math_verfy'; built-in: exact_match"),
    "failing import": ("broken_rewards:score", "reward function 'broken_rewards:score' cannot "
                       "be imported: No module named 'package_not_installed_xyz'"),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["validate", "run", "submit"])
def test_a_reward_that_cannot_be_used_is_refused_before_anything_starts(tmp_path, tiny_model,
                                                                       case, command):
    reward, expected = BAD[case]
    (tmp_path / "broken_rewards.py").write_text("import package_not_installed_xyz\n")
    config = experiment(tmp_path, tiny_model, raising=reward)
    result = rft(command, config, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    line = next(n for n, text in enumerate(config.read_text().splitlines(), 1) if reward in text)
    assert result.stderr.count("error:") == 1, result.stderr
    assert f"exp.yaml:{line}: pipeline.tasksets[0].tasks.reward: {expected}" in \
        re.sub(r"\s+", " ", result.stderr), result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(600)
def test_rewards_that_raise_or_hang_cost_their_rollouts_and_the_run_finishes(tmp_path,
                                                                           tiny_model):
    result = rft("run", experiment(tmp_path, tiny_model, limit=0.9), cwd=tmp_path, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    stage = tmp_path / "runs" / "rewards" / "stages" / "0-main"
    steps = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    errors = sum(s["reward_errors"] for s in steps)
    timeouts = sum(s["reward_timeouts"] for s in steps)
    records = rollouts(stage)
    failed = [r for r in records if "reward_failure" in r.info]
    # every rollout of a raising task fails, and every one of the hanging set, killed at 1 s
    odd = [r for r in records if r.taskset == "raising" and int(r.task_id[0]) % 2]
    assert errors == len(odd) > 0
    assert timeouts == sum(r.taskset == "hanging" for r in records) > 0
    assert len(failed) == errors + timeouts and all(r.reward == 0.0 for r in failed)
    log = (stage / "jobs" / "explorer-0.log").read_text()
    for r in failed:
        assert f"on task {r.task_id} (rollout" in log
    assert f"reward user_rewards:raises_on_odd on task {odd[0].task_id} (rollout " in log
    assert f"raised ValueError: cannot score {odd[0].task_id}; scored 0" in log
    hung = next(r for r in failed if r.taskset == "hanging")
    assert f"reward user_rewards:hangs on task {hung.task_id} (rollout 0): timed out (no " \
           "result within 1 s); scored 0" in log


@pytest.mark.timeout(600)
def test_a_reward_failing_past_the_limit_stops_the_run_with_one_message(tmp_path, tiny_model):
    config = experiment(tmp_path, tiny_model, raising="user_rewards:always_raises")
    result = rft("run", config, cwd=tmp_path, timeout=540)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    text = re.sub(r"\s+", " ", result.stderr)
    # one explorer: colocated with the trainer (launch.colocate auto), the loop named
    assert "role colocated failed (exit 2)" in text and "error: explorer-0: " in text
    assert re.search(r"error: explorer-0: \d+ of 8 reward calls failed \(raised or timed "
                     r"out\), more than "
                     r"explorer.reward_failure_limit 0.2 of them", text), result.stderr
    stage = tmp_path / "runs" / "rewards" / "stages" / "0-main"
    assert rollouts(stage) == []  # the step that tripped the limit was never committed
