"""Dynamic sampling (pipeline.dynamic_sampling, explorer/step_stream.py): a group whose rewards
are all equal is replaced by a reserve task's group under the same weights; a step that
runs out of reserve fills up with set-aside groups; a strictly on-policy run with it
finishes, writes full steps on-policy, and its audit passes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.protocols import StepTasks
from rft_hpc.explorer.step_stream import StepStream
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

HALF_FLAT = "helpers.rewards:half_flat"
SETTINGS = SamplingSettings(repeat=4, max_new_tokens=4, temperature=1.0)


def task(name: str) -> Task:
    return Task(name, f"{len(name)}+1=", "0", reward=HALF_FLAT)


def run_step(engine, pool, own: list[str], reserve: list[str], **dynamic):
    """One step of `own` tasks with `reserve` tasks (group ids 100+), through the stream."""
    from rft_hpc.config.pipeline import DynamicSampling

    stream = StepStream(engine, SETTINGS, pool, window=1,
                        dynamic=DynamicSampling(enabled=True, **dynamic))
    stream.submit(StepTasks(0, [task(n) for n in own], range(len(own)), seed=7,
                            reserve=[(task(n), 100 + r) for r, n in enumerate(reserve)]))
    done = []
    while len(stream):
        stream.advance()
        done += list(stream.completed())
    assert len(done) == 1
    return done[0]


def groups(done) -> dict[int, tuple[str, float]]:
    """group id -> (task id, reward std) of a completed step's records."""
    by: dict[int, list] = {}
    for e in done.experiences:
        by.setdefault(e.group_id, []).append(e)
    return {g: (es[0].task_id, float(np.std([e.reward for e in es]))) for g, es in by.items()}


def test_groups_with_equal_rewards_are_replaced_from_the_reserve_in_order(tiny_model):
    engine = HFEngine(tiny_model)
    with RewardPool(workers=2, timeout=30.0) as pool:
        done = run_step(engine, pool, ["flat0", "vary1", "flat2"],
                        ["flat-r0", "vary-r1", "flat-r2", "vary-r3", "vary-r4"])
    # round 1: flat0 and flat2 set aside, r0 and r1 drawn; r0 flat: r2 drawn; r2 flat: r3
    assert groups(done).keys() == {1, 101, 103}
    assert [t for t, _ in groups(done).values()] == ["vary1", "vary-r1", "vary-r3"]
    assert all(std > 0 for _, std in groups(done).values())
    assert len(done.experiences) == 3 * SETTINGS.repeat  # the step's size never changes
    m = done.metrics
    assert (m["dynamic/drawn_groups"], m["dynamic/dropped_groups"],
            m["dynamic/kept_equal_groups"]) == (7.0, 4.0, 0.0)
    assert m["groups_all_equal"] == 0.0
    assert 0 < m["dynamic/drawn_reward_mean"] < m["reward_mean"]  # the flat groups scored 0


def test_a_step_whose_reserve_runs_out_fills_up_with_set_aside_groups(tiny_model):
    engine = HFEngine(tiny_model)
    with RewardPool(workers=2, timeout=30.0) as pool:
        done = run_step(engine, pool, ["flat0", "vary1", "flat2"], ["flat-r0", "flat-r1"])
    assert groups(done).keys() == {0, 1, 2}  # the informative one, then the first drawn
    m = done.metrics
    assert (m["dynamic/drawn_groups"], m["dynamic/dropped_groups"],
            m["dynamic/kept_equal_groups"]) == (5.0, 2.0, 2.0)


def test_min_std_sets_aside_groups_that_vary_too_little(tiny_model):
    engine = HFEngine(tiny_model)
    with RewardPool(workers=2, timeout=30.0) as pool:
        done = run_step(engine, pool, ["vary0"], ["vary-r0"], min_std=10.0)
    assert done.metrics["dynamic/kept_equal_groups"] == 1.0  # no group varies by 10
    assert groups(done).keys() == {0}


def test_dynamic_sampling_with_a_multi_turn_workflow_is_refused(tmp_path):
    result = rft("validate", DEMO, "--set", f"run.root={tmp_path}",
                 "--set", "pipeline.dynamic_sampling.enabled=true",
                 "--set", "explorer.workflow={type: multi_turn}")
    assert result.returncode != 0
    assert "pipeline.dynamic_sampling.enabled" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(400)
def test_a_strictly_on_policy_run_with_dynamic_sampling_finishes_on_policy(tmp_path,
                                                                          tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=0",
                                     "--set", "explorer.count=1",
                                     "--set", f"tasks.reward=tests.{HALF_FLAT}",
                                     "--set", "pipeline.dynamic_sampling.enabled=true",
                                     "--set", "pipeline.dynamic_sampling.max_groups=4"),
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "demo"
    stage = run / "stages" / "1-grpo"
    rows = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert len(rows) == 12 and sum(r["dynamic/dropped_groups"] for r in rows) > 0
    records = rollouts(stage)
    assert len(records) == 12 * 2 * 8  # full steps: 6 trainer steps of 32 records
    # two explorer steps per trainer step, offset 0: step s samples with version s // 2
    assert all(r.policy_version == r.step // 2 for r in records)
    kept_equal = sum(r["dynamic/kept_equal_groups"] for r in rows)
    by_group: dict[int, list[float]] = {}
    for r in records:
        by_group.setdefault(r.group_id, []).append(r.reward)
    flat = sum(np.std(v) == 0 for v in by_group.values())
    assert flat == kept_equal < len(by_group) / 2  # half the tasks are flat, drawn away
    audit = rft("audit", run)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]
