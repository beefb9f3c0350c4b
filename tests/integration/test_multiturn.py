"""Multi-turn workflows: environment feedback in the sequence with mask 0, environments
that raise or hang cost their task only, over-rollout closes steps before the stragglers."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.paths import ROOT
from pydantic import ValidationError

from rft_hpc.buffer.jsonl import iter_segments
from rft_hpc.buffer.segment import read_segment
from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine
from rft_hpc.envs.base import build_env, check_env
from rft_hpc.envs.faulty import is_bad
from rft_hpc.envs.guess import GuessEnv
from rft_hpc.explorer.multiturn import TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.task import Task

FAULTY = "rft_hpc.envs.faulty:FaultyGuess"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(tiny_model)


def tasks(n, start=0):
    return [Task(task_id=f"t{i}", prompt=f"{i}+0=", answer=str(i)) for i in range(start,
                                                                                start + n)]


def explorer(engine, *, env=FAULTY, ratio=1.0, stragglers="drop", turns=3, timeout=5.0,
             retries=1, new_tokens=2, **env_args):
    workflow = MultiTurnWorkflow(env=env, env_args=env_args, max_turns=turns,
                                 max_timeout=timeout, max_retry_times=retries)
    return MultiTurnExplorer(engine, workflow, TurnSettings(repeat=2, max_new_tokens=new_tokens,
                                                            temperature=1.0),
                             OverRolloutConfig(ratio=ratio, stragglers=stragglers))


def test_guess_game_feedback_and_reward():
    env = GuessEnv()
    task = Task(task_id="a", prompt="", answer="47")  # secret 47 % 10 = 7
    assert env.reset(task, seed=0) == "0-9="
    assert env.step("3").observation == "+"
    assert env.step("x").observation == "*"
    assert env.step("9") == type(env.step("9"))("-", 0.0, False)
    final = env.step("7")
    assert final.done and final.observation == "=" and final.reward == pytest.approx(0.2)


def test_unknown_environment_is_a_user_error():
    with pytest.raises(UserError, match=r"explorer\.workflow\.env"):
        build_env("no_such_env", {})
    with pytest.raises(UserError, match="refuses env_args"):
        build_env("guess", {"colour": 1})
    with pytest.raises(UserError, match="refuses env_args"):  # checked without building one
        check_env(FAULTY, {"sleep": 1.0, "colour": 1})
    with pytest.raises(UserError, match="cannot be imported"):
        check_env("no.such.module:Env", {})
    with pytest.raises(ValidationError, match="unknown environment 'gues'"):
        MultiTurnWorkflow(env="gues")


def test_feedback_tokens_have_mask_0_and_replay_the_game(engine):
    mt = explorer(engine, env="guess", turns=3)
    records, metrics = mt.run_step(tasks(3), first_group_id=10, step=0, seed=1)
    assert len(records) == 6 and metrics["tasks_finished"] == 3
    assert sorted({r.group_id for r in records}) == [10, 11, 12]
    for r in records:
        mask, tokens = r.response_mask, r.tokens
        assert not mask[:r.prompt_length].any()
        # replay the game with the recorded actions: the mask-0 tokens after the prompt are
        # exactly the environment's feedback, the mask-1 tokens the policy's turns
        env, reward, feedback = GuessEnv(), 0.0, ""
        env.reset(Task(task_id=r.task_id, prompt="", answer=r.task_id[1:]), 0)
        for i, action in enumerate(r.info["actions"]):
            result = env.step(action)
            reward += result.reward
            if not result.done and i + 1 < 3:
                feedback += result.observation
        after = slice(r.prompt_length, None)
        assert engine.tokenizer.decode(tokens[after][mask[after] == 0]) == feedback
        assert r.reward == pytest.approx(reward)
        assert r.info["turns"] == len(r.info["actions"]) >= 1
        assert np.all(r.logprobs[mask == 1] < 0) and np.all(r.logprobs[mask == 0] == 0)
        assert mask.sum() > 0 and (mask[r.prompt_length:] == 0).sum() == len(feedback)


def test_raising_dying_and_hanging_environments_cost_their_task_only(engine):
    batch = tasks(6)
    raising = [t.task_id for t in batch if is_bad(t.task_id, "raise", 5)]
    raising += [t.task_id for t in batch if is_bad(t.task_id, "die", 4)]  # os._exit
    hanging = [t.task_id for t in batch if is_bad(t.task_id, "hang", 4)
               and t.task_id not in raising]
    assert len(raising) >= 2 and hanging
    mt = explorer(engine, raise_every=5, die_every=4, hang_every=4, timeout=1.0, retries=1)
    records, metrics = mt.run_step(batch, first_group_id=0, step=0, seed=1)
    failed = {r.task_id: r.info.get("placeholder") for r in records if "placeholder" in r.info}
    assert failed == {**dict.fromkeys(raising, "error"), **dict.fromkeys(hanging, "timeout")}
    assert all(not r.response_mask.any() for r in records if "placeholder" in r.info)
    good = {r.task_id for r in records if "placeholder" not in r.info}
    assert good == {t.task_id for t in batch} - set(raising) - set(hanging)
    assert metrics["env/errors"] == 2 * len(raising)  # first attempt and one retry each
    assert metrics["env/timeouts"] == 2 * len(hanging)
    assert metrics["env/failed_tasks"] == len(raising) + len(hanging)
    assert metrics["tasks_finished"] == len(good)
    assert len(records) == 2 * len(batch)  # the step keeps its record count


def test_over_rollout_drops_the_stragglers(engine):
    batch = tasks(6)
    slow = {t.task_id for t in batch if is_bad(t.task_id, "slow", 3)}
    assert 0 < len(slow) < 6
    ratio = (6 - len(slow)) / 6
    mt = explorer(engine, ratio=ratio, sleep=0.01, slow_every=3, slow_factor=3000)
    records, metrics = mt.run_step(batch, first_group_id=0, step=0, seed=1)
    trained = [r for r in records if "placeholder" not in r.info]
    assert {r.task_id for r in trained} == {t.task_id for t in batch} - slow
    assert {r.task_id for r in records if r.info.get("placeholder") == "dropped"} == slow
    assert metrics["over_rollout/dropped"] == len(slow) and metrics["over_rollout/carried"] == 0
    assert mt.in_flight == 0


def test_over_rollout_carries_the_stragglers_into_the_next_step(engine):
    batch = tasks(4)
    slow = {t.task_id for t in batch if is_bad(t.task_id, "slow", 5)}
    assert len(slow) == 1
    mt = explorer(engine, ratio=0.75, stragglers="carry", sleep=0.01, slow_every=5,
                  slow_factor=20)
    first, m0 = mt.run_step(batch, first_group_id=0, step=0, seed=1)
    assert {r.task_id for r in first} == {t.task_id for t in batch} - slow
    assert m0["over_rollout/carried"] == 1 and mt.in_flight == 1
    engine.version = 7  # new weights arrive between the steps
    try:
        second, m1 = mt.run_step([], first_group_id=4, step=1, seed=2)  # waits for the carried
    finally:
        engine.version = 0
    assert {r.task_id for r in second} == slow and m1["over_rollout/carried_in"] == 1
    assert all(r.info["carried_from"] == 0 and r.step == 1 for r in second)
    assert all(r.info["first_version"] == 0 and r.policy_version == 7 for r in second)
    assert mt.in_flight == 0
    mt.run_step(batch, first_group_id=8, step=2, seed=3)  # carries the slow one again
    mt.close()  # a stop: the cancelled straggler is still reported for the next process
    assert mt.in_flight == 1


def test_guess_game_trains_end_to_end_with_faulty_environments(tmp_path, tiny_model):
    env_args = json.dumps({"raise_every": 8, "hang_every": 4, "hang_seconds": 600})
    result = subprocess.run(
        [sys.executable, "-m", "rft_hpc.cli", "run", ROOT / "configs" / "multiturn.yaml",
         "--set", f"run.root={tmp_path}", "--set", f"model.path={tiny_model}",
         "--set", "trainer.steps=2", "--set", "trainer.batch_size=16",
         "--set", f"explorer.workflow.env={FAULTY}",
         "--set", f"explorer.workflow.env_args={env_args}",
         "--set", "explorer.workflow.max_timeout=2", "--set", "explorer.workflow.max_turns=3"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    stage = tmp_path / "multiturn" / "stages" / "0-main"
    records = [r for _, p in iter_segments(stage / "buffer")
               for r in read_segment(p).records()]
    assert len(records) == 2 * 16
    played = [r for r in records if "placeholder" not in r.info]
    assert any(r.info["turns"] > 1 for r in played)
    for r in played:  # feedback tokens inside the response are never trained on
        after = r.response_mask[r.prompt_length:]
        assert after.sum() > 0
        if r.info["turns"] > 1:
            assert (after == 0).any()
    errors = [r for r in records if r.info.get("placeholder") == "error"]
    timeouts = [r for r in records if r.info.get("placeholder") == "timeout"]
    assert errors and timeouts
    explorer_metrics = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert sum(m["env/errors"] for m in explorer_metrics) == 2 * len(errors) / 4
    assert sum(m["env/timeouts"] for m in explorer_metrics) == 2 * len(timeouts) / 4
    trainer_metrics = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert max(m["step"] for m in trainer_metrics) == 2


def test_stragglers_in_flight_at_a_restart_are_counted_as_lost(engine, tmp_path):
    heartbeat = tmp_path / "explorer-0.json"
    heartbeat.write_text(json.dumps({"status": "stopped", "in_flight": 3}))
    mt = MultiTurnExplorer(engine, MultiTurnWorkflow(max_turns=1),
                           TurnSettings(repeat=2, max_new_tokens=2, temperature=1.0),
                           OverRolloutConfig(), heartbeat=heartbeat)
    _, first = mt.run_step(tasks(1), first_group_id=0, step=5, seed=1)
    _, second = mt.run_step(tasks(1, start=1), first_group_id=1, step=6, seed=1)
    assert first["over_rollout/lost_on_restart"] == 3
    assert second["over_rollout/lost_on_restart"] == 0


def test_trajectories_stop_before_they_outgrow_the_model_context(engine):
    limit = engine.model.config.max_position_embeddings
    # a 13-digit secret that 12-token guesses never hit, ~13 tokens per turn: past the limit
    mt = explorer(engine, env="guess", turns=200, new_tokens=12, low=10**12, high=10**12 + 9)
    records, _ = mt.run_step(tasks(1), first_group_id=0, step=0, seed=1)
    assert all(len(r.tokens) <= limit for r in records)
    assert any(r.info["truncated"] for r in records)
    assert all(r.info["truncated"] != r.info["done"] for r in records)


def test_async_environments_wait_together_in_one_process(engine):
    workflow = MultiTurnWorkflow(env="helpers.agent_envs:RemoteWait", max_turns=1,
                                 max_timeout=60.0, env_args={"seconds": 0.5})
    mt = MultiTurnExplorer(engine, workflow, TurnSettings(repeat=4, max_new_tokens=2,
                                                          temperature=1.0), OverRolloutConfig())
    try:
        tasks = [Task(task_id=f"t{i}", prompt="", answer=str(i)) for i in range(16)]
        records, metrics = mt.run_step(tasks, first_group_id=0, step=0, seed=1)
        assert len(records) == 64 and metrics["tasks_finished"] == 16
        assert all(r.reward == 1.0 and r.info["turns"] == 1 for r in records)
        # 64 trajectories, one host process, and most of them waiting at once in it
        assert mt.rollouts.hosts.started == 1
        assert max(r.info["in_flight"] for r in records) > 32
    finally:
        mt.close()


def test_a_trajectorys_next_turn_does_not_wait_for_its_group(engine):
    workflow = MultiTurnWorkflow(env="helpers.agent_envs:UnevenPace", max_turns=3,
                                 max_timeout=60.0, env_args={"seconds": 1.0})
    mt = MultiTurnExplorer(engine, workflow, TurnSettings(repeat=6, max_new_tokens=2,
                                                          temperature=1.0), OverRolloutConfig())
    try:
        records, _ = mt.run_step([Task(task_id="t0", prompt="", answer="3")],
                                 first_group_id=0, step=0, seed=4)
    finally:
        mt.close()
    slow = [r.info for r in records if r.info["slow"]]
    fast = [r.info for r in records if not r.info["slow"]]
    assert slow and fast and all(r["turns"] == 3 for r in slow + fast)
    # every fast trajectory played its three turns while the slow ones were in their first
    assert max(r["end_3"] for r in fast) < min(r["end_1"] for r in slow)


def test_steps_in_flight_run_together_and_are_handed_back_in_order(engine):
    from rft_hpc.explorer.protocols import StepTasks

    workflow = MultiTurnWorkflow(env="helpers.agent_envs:PacedByTask", max_turns=1,
                                 max_timeout=60.0, env_args={"seconds": 1.0})
    mt = MultiTurnExplorer(engine, workflow, TurnSettings(repeat=2, max_new_tokens=2,
                                                          temperature=1.0),
                           OverRolloutConfig(), window=2)
    try:
        slow, fast = Task("s", prompt="", answer="slow"), Task("f", prompt="", answer="1")
        mt.submit(StepTasks(0, [slow, fast], [0, 1], seed=1))
        assert mt.has_room
        mt.submit(StepTasks(1, [Task("g", prompt="", answer="2")], [2], seed=2))
        assert not mt.has_room and len(mt) == 2
        done = []
        while len(done) < 2:
            mt.advance()
            done += list(mt.completed())
    finally:
        mt.close()
    assert [d.step for d in done] == [0, 1] and len(mt) == 0
    ends = {r.task_id: r.info["end"] for d in done for r in d.experiences}
    # step 1 played while step 0 waited on its slow task, and was handed back after it
    assert ends["g"] < ends["s"] and all(r.step == 1 for r in done[1].experiences)


def test_an_agent_explorer_killed_with_trajectories_in_flight_resumes_and_audits(
        tmp_path, tiny_model):
    # an async environment (one trajectory in eight waits 1 s), two steps in flight
    args = [sys.executable, "-m", "rft_hpc.cli", "run", ROOT / "configs" / "multiturn.yaml",
            "--set", f"run.root={tmp_path}", "--set", f"model.path={tiny_model}",
            "--set", "trainer.steps=6", "--set", "trainer.batch_size=16",
            "--set", "sync.offset=1", "--set", "explorer.workflow.max_turns=1",
            "--set", "explorer.workflow.env=tools.bench.pipeline_env:DelayedAnswer",
            "--set", 'explorer.workflow.env_args={"delay": 1.0}']
    stage = tmp_path / "multiturn" / "stages" / "0-main"
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and time.monotonic() < deadline and first.poll() is None:
        try:
            beat = json.loads((stage / "state" / "explorer-0.json").read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("step", 0) >= 2 and beat.get("in_flight", 0) > 0:
            os.kill(beat["pid"], signal.SIGKILL)
            killed = beat
        time.sleep(0.02)
    first.communicate(timeout=120)
    assert killed is not None and first.returncode != 0
    second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    audit = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "audit",
                            tmp_path / "multiturn", "--json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["ok"], audit.stdout[-4000:]
    records = [r for _, p in iter_segments(stage / "buffer")
               for r in read_segment(p).records()]
    # every step once: the killed process's uncommitted steps were redone, none twice
    keys = [(r.step, r.group_id, r.task_id) for r in records]
    assert len(records) == 6 * 16 and len(set((r.step, r.group_id) for r in records)) == 6 * 4
    assert sorted({r.step for r in records}) == list(range(6)) and len(keys) == 6 * 16
    beat = json.loads((stage / "state" / "explorer-0.json").read_text())
    assert beat["restarts"] >= 1


def test_an_async_host_that_stops_answering_is_replaced(engine, tmp_path):
    workflow = MultiTurnWorkflow(env="helpers.agent_envs:BlocksItsLoopOnce", max_turns=1,
                                 max_timeout=2.0, max_retry_times=1,
                                 env_args={"marker": str(tmp_path / "blocked")})
    mt = MultiTurnExplorer(engine, workflow, TurnSettings(repeat=2, max_new_tokens=2,
                                                          temperature=1.0), OverRolloutConfig())
    try:
        records, metrics = mt.run_step([Task("t0", prompt="", answer="1")], first_group_id=0,
                                       step=0, seed=1)
        # the first attempt overran, its host did not answer a ping and was killed; the
        # retry ran on a new host
        assert metrics["env/timeouts"] == 1 and metrics["env/retries"] == 1
        assert metrics["tasks_finished"] == 1 and all(r.reward == 1.0 for r in records)
        assert mt.rollouts.hosts.started == 2
    finally:
        mt.close()
