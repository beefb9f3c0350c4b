"""The data pipeline's parts: task selectors, task-set mixing, pass-rate state kept across a
restart, reward shaping and experience filters, each against hand-computed expectations."""

import json

import numpy as np
import pytest
from helpers.task_stream import TaskStream

from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import Experience, SFTSample
from rft_hpc.config import ExperimentConfig
from rft_hpc.config.errors import ConfigError
from rft_hpc.config.pipeline import (
    DifficultyBasedSelector,
    DuplicateFilter,
    Easy2HardSelector,
    FormatReward,
    LengthPenalty,
    ResponseLengthFilter,
    RewardStdFilter,
    SequentialSelector,
    ShuffleSelector,
)
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir
from rft_hpc.pipeline.explorer_side import ExplorerPipeline, pass_counts, taskset_metrics
from rft_hpc.pipeline.filters import filter_batch
from rft_hpc.pipeline.selectors import build_selector
from rft_hpc.pipeline.shaping import shape_rewards
from rft_hpc.pipeline.task_stats import TaskStats
from rft_hpc.pipeline.task_stream import MixedTaskStream, TaskSet, build_task_stream, round_pattern
from rft_hpc.tasks.arithmetic import difficulty
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def tasks(n, name="s", **info):
    return [Task(task_id=f"{name}{i}", prompt=f"{i}=", answer=str(i), taskset=name,
                 info={k: v[i] for k, v in info.items()}) for i in range(n)]


def exp(reward, response=(5, 6), group=0, taskset="s", task_id="t", text=""):
    return Experience(tokens=[1, 2, *response], prompt_length=2, reward=reward,
                      group_id=group, taskset=taskset, task_id=task_id,
                      info={"response": text})


NO_RATES = {}


def test_shuffle_default_is_the_old_task_stream_bit_for_bit():
    cfg = ExperimentConfig.model_validate({"explorer": {"count": 3, "tasks_per_step": 5}})
    train, _ = build_tasks(cfg.tasks, 0)
    old = TaskStream(train, seed=0, explorers=3, tasks_per_step=5)
    new = build_task_stream(cfg)
    steps = [0, 1, 2, 539, 540, 541, 5000]  # 8100 tasks / 15 per step: epoch ends at 540
    assert all(old.tasks_for(s, e) == new.tasks_for(s, e) for s in steps for e in range(3))


def test_sequential_easy2hard_and_random_selectors():
    ts = tasks(4, difficulty=[3, 1, 2, 1])
    assert build_selector(SequentialSelector(), ts, [0]).pick(
        3, 3, step=0, explorer=0, pass_rates=NO_RATES) == [3, 0, 1]
    e2h = build_selector(Easy2HardSelector(), ts, [0])  # order 1, 3 (ties by file), 2, 0
    assert e2h.pick(0, 6, step=0, explorer=0, pass_rates=NO_RATES) == [1, 3, 2, 0, 1, 3]
    shuffle = build_selector(ShuffleSelector(), ts, [0])
    epoch = shuffle.pick(0, 4, step=0, explorer=0, pass_rates=NO_RATES)
    assert sorted(epoch) == [0, 1, 2, 3]
    assert shuffle.pick(2, 2, step=9, explorer=1, pass_rates=NO_RATES) == epoch[2:]
    with pytest.raises(UserError, match=r"task 's0'.*info.level"):
        build_selector(Easy2HardSelector(key="level"), ts, [0])


def test_arithmetic_tasks_carry_a_difficulty():
    assert [difficulty(11, "+", 11), difficulty(15, "+", 27), difficulty(55, "+", 55),
            difficulty(52, "-", 27), difficulty(12, "*", 12)] == [0, 1, 2, 1, 3]
    train, _ = build_tasks(ExperimentConfig().tasks, 0)
    assert {t.info["difficulty"] for t in train} == {0, 1, 2}


def test_difficulty_based_prefers_pass_rates_near_the_target():
    ts = tasks(3)
    sel = DifficultyBasedSelector(target=0.5, temperature=0.1)
    rates = {"s0": (0.0, 8), "s1": (4.0, 8), "s2": (8.0, 8)}  # pass rates 0, 0.5, 1
    w = build_selector(sel, ts, [0]).weights(rates)  # type: ignore[attr-defined]
    e5 = np.exp(-5.0)
    assert w == pytest.approx([e5 / (1 + 2 * e5), 1 / (1 + 2 * e5), e5 / (1 + 2 * e5)])
    picks = [build_selector(sel, ts, [0]).pick(0, 1, step=s, explorer=0, pass_rates=rates)[0]
             for s in range(200)]
    assert picks.count(1) > 180  # weight 0.987
    # unseen tasks count as at the target
    w = build_selector(sel, ts, [0]).weights({"s0": (0.0, 8)})  # type: ignore[attr-defined]
    assert w == pytest.approx([e5 / (2 + e5), 1 / (2 + e5), 1 / (2 + e5)])


def test_round_pattern_and_mixing_by_weight():
    assert round_pattern([2, 1]) == [0, 1, 0]
    assert round_pattern([0.7, 0.3]) == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    a, b = tasks(5, "a"), tasks(7, "b")
    stream = MixedTaskStream([TaskSet("a", 2.0, a, SequentialSelector()),
                              TaskSet("b", 1.0, b, SequentialSelector())],
                             seed=0, explorers=2, tasks_per_step=3)
    # slots 0.. go a b a | a b a ...; explorer 1 of step 0 has slots 3, 4, 5
    assert [t.task_id for t in stream.tasks_for(0, 0)] == ["a0", "b0", "a1"]
    assert [t.task_id for t in stream.tasks_for(0, 1)] == ["a2", "b1", "a3"]
    assert [t.task_id for t in stream.tasks_for(1, 0)] == ["a4", "b2", "a0"]
    ids = [t.taskset for s in range(10) for e in range(2) for t in stream.tasks_for(s, e)]
    assert ids.count("a") == 40 and ids.count("b") == 20


def test_tasksets_config_names_each_set_and_refuses_duplicates(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n"
                         for i in range(3)))
    cfg = ExperimentConfig.model_validate({"explorer": {"tasks_per_step": 4}, "pipeline": {
        "tasksets": [{"name": "add", "weight": 3, "tasks": {"type": "arithmetic"}},
                     {"name": "echo", "tasks": {"type": "jsonl", "path": str(f)},
                      "task_selector": {"type": "sequential"}}]}})
    got = build_task_stream(cfg).tasks_for(0, 0)
    assert [t.taskset for t in got] == ["add", "add", "echo", "add"]  # round [0, 0, 1, 0]
    assert got[2].prompt == "0="
    with pytest.raises(ValueError, match="names must differ"):
        ExperimentConfig.model_validate({"pipeline": {"tasksets": [
            {"name": "x", "tasks": {"type": "arithmetic"}},
            {"name": "x", "tasks": {"type": "arithmetic"}}]}})


def test_pass_rates_survive_a_restart_exactly(tmp_path):
    """A restarted explorer (committed up to step 3) redoes steps 3.. with the same tasks,
    although its first life had recorded steps 3 and 4 and torn step 5's line."""
    f = tmp_path / "six.jsonl"
    f.write_text("".join(json.dumps({"task_id": str(i), "prompt": f"{i}=", "answer": "x"})
                         + "\n" for i in range(6)))
    cfg = ExperimentConfig.model_validate({
        "explorer": {"tasks_per_step": 4, "count": 1},
        "tasks": {"type": "jsonl", "path": str(f)},
        "pipeline": {"task_selector": {"type": "difficulty_based"}}})
    run = RunDir(tmp_path / "run")
    solved = {"0": 4, "1": 4, "2": 2, "3": 2, "4": 0, "5": 0}  # of 4 rollouts per task

    def rollouts(picked):
        return [exp(float(i < solved[t.task_id]), task_id=t.task_id, taskset="six")
                for t in picked for i in range(4)]

    first = ExplorerPipeline(cfg, run, 0, committed_step=0)
    seen = []
    for step in range(5):
        picked = first.tasks_for(step)
        seen.append(sorted(t.task_id for t in picked))
        first.process(step, rollouts(picked))
    first.close()
    path = run.state / "pipeline" / "explorer-0.jsonl"
    with path.open("a") as fh:
        fh.write('{"step": 5, "tasks": {"1')  # killed mid-line
    again = ExplorerPipeline(cfg, run, 0, committed_step=3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    redone = []
    for step in range(3, 5):
        picked = again.tasks_for(step)
        redone.append(sorted(t.task_id for t in picked))
        again.process(step, rollouts(picked))
    again.close()
    assert redone == seen[3:]
    # once every task was seen, the half-solved ones (pass rate 0.5) come every step
    assert all({"2", "3"} <= set(s) for s in seen[2:])
    stats = TaskStats(path, committed_step=5, durable=False)
    assert sum(n for _, n in stats.rates.values()) == 5 * 16
    assert stats.rates["2"][0] / stats.rates["2"][1] == 0.5
    stats.close()


def test_taskset_metrics_and_pass_counts():
    es = [exp(1.0, taskset="a", task_id="x"), exp(0.0, taskset="a", task_id="x"),
          exp(1.5, taskset="b", task_id="y")]
    assert taskset_metrics(es, 1.0) == {
        "taskset/a/count": 2.0, "taskset/a/reward_mean": 0.5, "taskset/a/pass_rate": 0.5,
        "taskset/b/count": 1.0, "taskset/b/reward_mean": 1.5, "taskset/b/pass_rate": 1.0}
    assert pass_counts(es, 1.0) == {"x": (1.0, 2), "y": (1.0, 1)}
    # a placeholder (a failed task's record without a response) counts nowhere
    hole = exp(0.0, taskset="a", task_id="x")
    hole.info["placeholder"] = "failed"
    assert taskset_metrics([*es, hole], 1.0)["taskset/a/count"] == 2.0
    assert pass_counts([*es, hole], 1.0)["x"] == (1.0, 2)
    assert shape_rewards([hole], [FormatReward(pattern="x", penalty=-1.0)]) == {}
    assert hole.reward == 0.0 and "raw_reward" not in hole.info


def test_reward_shaping_chain():
    es = [exp(1.0, response=(5,), text=" 42 "), exp(0.0, response=(5, 6, 7, 8), text="4x2")]
    m = shape_rewards(es, [FormatReward(pattern=r"\d+", bonus=0.1, penalty=-0.2),
                           LengthPenalty(max_tokens=2, coef=0.05)])
    assert [e.reward for e in es] == pytest.approx([1.1, -0.3])
    assert [e.info["raw_reward"] for e in es] == [1.0, 0.0]
    assert m == pytest.approx({"shaping/format_reward/reward_change": -0.05,
                               "shaping/length_penalty/reward_change": -0.05})
    anywhere = [exp(0.0, text="the answer is 7.")]
    shape_rewards(anywhere, [FormatReward(pattern=r"\d", full_match=False, bonus=1.0)])
    assert anywhere[0].reward == 1.0


def batch_of(records):
    return Batch(records=list(records), refs=[("w", 0, i) for i in range(len(records))],
                 weights=[1.0] * len(records), uses=[0] * len(records))


def test_filters_drop_what_they_say_and_count_it():
    records = [exp(1.0, group=0, response=(5,)), exp(1.0, group=0, response=(6,)),  # std 0
               exp(1.0, group=1, response=(5, 6)), exp(0.0, group=1, response=(5, 6)),  # dup
               exp(0.0, group=1, response=(7, 7, 7, 7)),  # too long
               SFTSample(tokens=[1, 2, 3], prompt_length=1)]  # passes every filter
    kept, m = filter_batch(batch_of(records), [
        RewardStdFilter(), DuplicateFilter(), ResponseLengthFilter(max_tokens=3)])
    assert kept.records == [records[2], records[5]]
    assert kept.refs == [("w", 0, 2), ("w", 0, 5)]
    assert m == {"filter/reward_std_filter/dropped": 2.0,
                 "filter/duplicate_filter/dropped": 1.0,
                 "filter/response_length_filter/dropped": 1.0, "filter/kept": 2.0}
    # order matters: length first leaves group 1 as [1.0, 0.0] (kept), then no duplicate
    _, m2 = filter_batch(batch_of(records[:5]), [
        ResponseLengthFilter(min_tokens=2), RewardStdFilter(min_std=0.4)])
    assert m2["filter/response_length_filter/dropped"] == 2.0
    assert m2["filter/reward_std_filter/dropped"] == 0.0  # std of [1, 0, 0] = 0.471
    same = batch_of(records)
    assert filter_batch(same, [])[0] is same


def test_bad_pipeline_configs_are_refused(tmp_path):
    from rft_hpc.config.loader import load_config
    f = tmp_path / "c.yaml"
    f.write_text("pipeline:\n  task_selector: {type: easy}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: pipeline.task_selector.type: expected "
                       r"one of .*'offline_easy2hard', 'difficulty_based', got 'easy'"):
        load_config(f)
    f.write_text("pipeline:\n  experience_filters:\n    - {type: reward_std_filter}\n"
                 "    - {type: reward_std_filter}\n")
    with pytest.raises(ConfigError, match="experience_filters: give operators of the same "
                       "type different `name`s"):
        load_config(f)


def test_a_stage_overrides_the_pipeline():
    cfg = ExperimentConfig.model_validate({
        "pipeline": {"experience_filters": [{"type": "duplicate_filter"}]},
        "stages": [{"name": "a"}, {"name": "b", "pipeline": {
            "task_selector": {"type": "sequential"}}}]})
    (_, a), (_, b) = cfg.stage_configs()
    assert isinstance(a.pipeline.task_selector, ShuffleSelector)
    assert isinstance(b.pipeline.task_selector, SequentialSelector)
    assert [f.type for f in b.pipeline.experience_filters] == ["duplicate_filter"]
