"""The parts of the demo experiment: tasks, rewards, stream, engine, sync rules, stages."""

import json
import sys

import pytest
import torch
from helpers.explore import explore_step

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.config import load_config
from rft_hpc.config.pipeline import ShuffleSelector
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.role import required_version
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.pipeline.task_stream import MixedTaskStream, TaskSet
from rft_hpc.run.stages import create_run
from rft_hpc.tasks.arithmetic import arithmetic_tasks
from rft_hpc.tasks.rewards import resolve_reward
from rft_hpc.tasks.task import Task, load_task_file


def test_arithmetic_split_is_seeded_and_disjoint():
    train, held_out = arithmetic_tasks(2, "+", 500, seed=3)
    assert len(held_out) == 500 and len(train) == 90 * 90 - 500
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert arithmetic_tasks(2, "+", 500, seed=3)[1] == held_out
    assert arithmetic_tasks(2, "+", 500, seed=4)[1] != held_out
    t = held_out[0]
    a, b = t.prompt[:-1].split("+")
    assert t.answer == str(int(a) + int(b))


def test_task_stream_is_deterministic_and_covers_an_epoch_without_repeats():
    tasks = [Task(f"t{i}", f"p{i}", str(i)) for i in range(24)]
    stream = MixedTaskStream([TaskSet("t", 1.0, tasks, ShuffleSelector())], seed=1,
                             explorers=2, tasks_per_step=3)
    epoch = [t.task_id for s in range(4) for e in range(2) for t in stream.tasks_for(s, e)]
    assert sorted(epoch) == sorted(t.task_id for t in tasks)
    again = MixedTaskStream([TaskSet("t", 1.0, tasks, ShuffleSelector())], seed=1,
                            explorers=2, tasks_per_step=3)
    assert again.tasks_for(7, 1) == stream.tasks_for(7, 1)  # a restart redoes the same step


def test_rewards_by_name_and_by_import_path(tmp_path, monkeypatch):
    task = Task("x", "1+1=", "2")
    assert resolve_reward("exact_match")(task, " 2 ") == 1.0
    assert resolve_reward("exact_match")(task, "3") == 0.0
    assert resolve_reward("exact_match_with_format")(task, "3") == pytest.approx(0.1)
    (tmp_path / "my_rewards.py").write_text(
        "def length(task, response):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:length")(task, "abc") == 3.0
    with pytest.raises(UserError, match="unknown reward function 'exct'"):
        resolve_reward("exct")
    with pytest.raises(UserError, match="cannot be imported"):
        resolve_reward("no_such_module_xyz:f")
    sys.modules.pop("my_rewards", None)


def test_task_file_errors_name_the_line(tmp_path):
    good = tmp_path / "tasks.jsonl"
    good.write_text('{"prompt": "q1", "answer": "a1"}\n{"prompt": "q2", "answer": "a2", '
                    '"reward": "exact_match"}\n')
    assert [t.answer for t in load_task_file(good)] == ["a1", "a2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q1", "answer": "a1"}\n{"prompt": "q2"}\n')
    with pytest.raises(UserError, match="line 2: needs string field"):
        load_task_file(bad)


@pytest.mark.parametrize(("offset", "interval", "expected"), [
    (0, 1, [0, 1, 2, 3, 4, 5]),
    (1, 1, [0, 0, 1, 2, 3, 4]),
    (0, 2, [0, 0, 2, 2, 4, 4]),
    (3, 1, [0, 0, 0, 0, 1, 2]),
])
def test_required_weight_version_follows_offset_and_interval(tmp_path, offset, interval,
                                                             expected):
    cfg = load_config(_write(tmp_path, f"sync: {{offset: {offset}, interval: {interval}}}\n"))
    assert [required_version(s, cfg) for s in range(6)] == expected
    explore = cfg.model_copy(update={"mode": "explore"})
    assert required_version(5, explore) == 0


@pytest.mark.parametrize(("offset", "expected"), [(0, [0, 0, 1, 1, 2, 2]),
                                                  (2, [0, 0, 0, 0, 0, 0, 1])])
def test_a_batch_of_two_explorer_steps_needs_a_version_every_two_steps(tmp_path, offset,
                                                                      expected):
    # 16 records per explorer step, 32 per trainer step: waiting for version s at step s
    # would wait for a trainer step that needs this very step's records (a deadlock)
    cfg = load_config(_write(tmp_path, "explorer: {tasks_per_step: 2, repeat: 8}\n"
                             f"trainer: {{batch_size: 32}}\nsync: {{offset: {offset}}}\n"))
    assert [required_version(s, cfg) for s in range(len(expected))] == expected


def _write(tmp_path, text):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def test_rollout_logprobs_are_what_the_trainer_recomputes(tiny_model):
    """The explorer's log-probs (pi_old) equal the trainer's for the same tokens and weights."""
    engine = HFEngine(tiny_model)
    tasks = [Task(f"t{i}", f"{10 + i}+{20 + i}=", str(30 + 2 * i)) for i in range(3)]
    for temperature in (1.0, 0.7):
        experiences, metrics = explore_step(
            engine, tasks, SamplingSettings(repeat=4, max_new_tokens=6, temperature=temperature),
            first_group_id=10, step=0, seed=5)
        assert len(experiences) == 12 and metrics["reward_mean"] >= 0
        assert [e.group_id for e in experiences] == [10] * 4 + [11] * 4 + [12] * 4
        batch = collate(experiences, pad_id=engine.pad_id)
        with torch.no_grad():
            recomputed = token_logprobs(engine.model, batch, temperature)
        mask = batch.loss_mask.bool()
        assert mask.sum() > 0
        assert torch.allclose(recomputed[mask], batch.old_logprobs[mask], atol=2e-5)
        assert metrics["generated_tokens"] == float(mask.sum())  # the rollout throughput's
        assert metrics["generate_seconds"] > 0
        # rewards are scored in worker processes: the loop waits on them for a share only
        assert 0 < metrics["reward_wait_seconds"] < metrics["generate_seconds"] + \
            metrics["reward_seconds"]


def test_stages_merge_only_the_keys_they_give(tmp_path):
    cfg = load_config(_write(tmp_path, """
trainer: {lr: 1.0e-5, steps: 100, grad_clip: 0.3}
buffer: {max_uses: 1, sampler: {type: priority}}
stages:
  - name: warmup
    mode: train
    algorithm: {algorithm_type: sft}
    trainer: {lr: 3.0e-4}
    buffer: {max_uses: 4}
  - name: rl
"""))
    (n0, s0), (n1, s1) = cfg.stage_configs()
    assert (n0, s0.mode, s0.algorithm.algorithm_type, s0.trainer.lr) == ("warmup", "train",
                                                                          "sft", 3e-4)
    assert (s0.trainer.steps, s0.trainer.grad_clip) == (100, 0.3)
    assert s0.buffer.max_uses == 4 and s0.buffer.sampler.type == "priority"
    assert (n1, s1.mode, s1.trainer.lr, s1.buffer.max_uses) == ("rl", "both", 1e-5, 1)


def test_the_frozen_run_config_gives_the_same_stages_as_the_file(tmp_path, tiny_model):
    # a later job (the `prepare` between stages) reads the stages from the frozen copy
    cfg = load_config(_write(tmp_path, f"""
run: {{root: {tmp_path}}}
model: {{path: {tiny_model}}}
trainer: {{lr: 1.0e-5, steps: 100}}
eval: {{interval: 3, max_new_tokens: 5}}
stages:
  - name: warmup
    trainer: {{steps: 8}}
  - name: rl
    eval: {{evaluator: true}}
"""))
    _, run = create_run(cfg)
    frozen = load_config(run.config)
    assert [s.model_dump() for _, s in frozen.stage_configs()] == [
        s.model_dump() for _, s in cfg.stage_configs()]
    rl = frozen.stage_configs()[1][1]
    assert (rl.eval.interval, rl.eval.max_new_tokens, rl.eval.evaluator) == (3, 5, True)


def test_the_first_stage_keeps_the_configs_start_weights_and_later_ones_follow_on(tmp_path):
    from rft_hpc.run.stages import prepare_stage

    start, ended = tmp_path / "other-run" / "weights" / "v000040", tmp_path / "v000008"
    for folder in (start, ended):
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
    cfg = load_config(_write(tmp_path, f"model: {{start_weights: {start}}}\n"))
    first = prepare_stage(cfg, tmp_path / "0-main", None)
    assert load_config(first.config).model.start_weights == start
    later = prepare_stage(cfg, tmp_path / "1-rl", ended)
    assert load_config(later.config).model.start_weights == ended


def test_the_evaluator_scores_the_start_every_nth_and_the_last_weights():
    from rft_hpc.config.schema import EvalConfig

    assert EvalConfig(every=0).scored_versions(7) == [0, 7]
    assert EvalConfig(every=3).scored_versions(7) == [0, 3, 6, 7]
    assert EvalConfig(every=3).scored_versions(6) == [0, 3, 6]


def test_a_stage_key_typo_is_reported_with_its_path(tmp_path):
    path = _write(tmp_path, "stages:\n  - name: a\n    trainer: {lrr: 1}\n")
    with pytest.raises(UserError, match=r"stages\[0\]\.trainer\.lrr.*did you mean 'lr'"):
        load_config(path)
    for override in ("stages.0.trainer.lr=0.5", "stages[0].trainer.lr=0.5"):
        cfg = load_config(_write(tmp_path, "stages:\n  - name: a\n"), [override])
        assert cfg.stage_configs()[0][1].trainer.lr == 0.5


def test_metrics_are_json_lines_and_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rft_hpc.monitor.metrics import MetricsWriter, read_metrics

    w = MetricsWriter(tmp_path, "trainer")
    w.log(1, {"loss": 0.5, "bad": float("nan")})
    w.log(2, {"loss": 0.25, "records": 64, "done": True, "name": "x"})
    w.close()
    row, _ = read_metrics(tmp_path / "trainer.jsonl")
    assert row["loss"] == 0.5 and row["bad"] is None and row["step"] == 1
    events = EventAccumulator(str(tmp_path / "tb" / "trainer"))
    events.Reload()  # every finite number is a scalar at its step; nan, bools, text are not
    assert sorted(events.Tags()["scalars"]) == ["loss", "records"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("records")] == [(2, 64.0)]
    json.dumps(row)
