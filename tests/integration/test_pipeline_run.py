"""The data pipeline in a real `rft-hpc run` (configs/pipeline.yaml, tiny model),
and the human-in-the-loop round trip: export the run's buffer, relabel the rewards in the
JSONL, import it, train offline on it."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.paths import ROOT

from rft_hpc.buffer.jsonl import iter_segments
from rft_hpc.buffer.segment import read_segment
from rft_hpc.config.loader import load_config
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.pipeline.task_stream import build_task_stream

PIPELINE = ROOT / "configs" / "pipeline.yaml"
DEMO = ROOT / "configs" / "demo.yaml"


def rft(*args):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def records(buffer):
    return [r for _, p in iter_segments(buffer) for r in read_segment(p).records()]


def test_the_example_config_validates():
    result = rft("validate", "configs/pipeline.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("OK: configs/pipeline.yaml (mode=both, 2 explorer(s), "
                                     "trainer grpo)")


@pytest.fixture(scope="module")
def stage(tmp_path_factory, tiny_model):
    """A 4-step GRPO stage of configs/pipeline.yaml straight from the tiny model, one
    explorer, which is stopped after its first step (Slurm's warning signal) and restarted."""
    root = tmp_path_factory.mktemp("pipeline")
    args = ["run", PIPELINE, "--set", f"run.root={root}", "--set", f"model.path={tiny_model}",
            "--set", "stages=[]", "--set", "tasks.eval_size=16", "--set", "explorer.count=1",
            "--set", "explorer.tasks_per_step=4", "--set", "trainer.batch_size=32",
            "--set", "trainer.steps=4", "--set", "eval.interval=0",
            "--set", "pipeline.tasksets.0.tasks.eval_size=16",
            "--set", "pipeline.tasksets.1.tasks.eval_size=16",
            # split: the explorer's process alone is requeued (colocated, both loops would be)
            "--set", "launch.colocate=false"]
    proc = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage = root / "pipeline" / "stages" / "0-main"
    beat = stage / "state" / "explorer-0.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            state = json.loads(beat.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("step", 0) >= 1:
            os.kill(state["pid"], signal.SIGUSR2)  # stop at the next safe point, requeue
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return stage


def test_pipeline_metrics_shaping_and_filters_in_a_run(stage):
    rows = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert sorted({r["step"] for r in rows}) == [0, 1, 2, 3]
    # the explorer was stopped and started again, and went on from its committed steps
    assert json.loads((stage / "state" / "explorer-0.json").read_text())["restarts"] == 1
    for r in rows:  # 4 tasks a step: one round of weights 3:1, 8 rollouts each
        assert r["taskset/add/count"] == 3 * 8 and r["taskset/sub/count"] == 1 * 8
        assert 0.0 <= r["taskset/sub/pass_rate"] <= 1.0 and "taskset/add/reward_mean" in r
    assert all("shaping/format_reward/reward_change" in r
               and "shaping/length_penalty/reward_change" in r for r in rows)
    # every record's reward is its raw reward plus the two shapers' changes
    recs = records(stage / "buffer")
    assert len(recs) == 4 * 32
    for r in recs:
        text = r.info["response"]
        fmt = 0.0 if re.fullmatch(r"-?\d+", text.strip()) else -0.1
        length = -0.05 * max(0, int(r.response_mask.sum()) - 3)
        assert r.reward == pytest.approx(r.info["raw_reward"] + fmt + length, abs=1e-6)
    assert {r.taskset for r in recs} == {"add", "sub"}
    # the sub set's pass rates are kept per explorer step, beside the committed steps
    lines = (stage / "state" / "pipeline" / "explorer-0.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3]
    # each step's tasks are what the stream picks from the pass rates of the steps before it,
    # as the buffer holds them (raw rewards): state derived from committed data only
    stream = build_task_stream(load_config(stage / "config.yaml"))
    for step in range(4):
        before = [r for r in recs if r.step < step]
        rates = {t: (float(sum(r.info["raw_reward"] >= 1.0 for r in before if r.task_id == t)),
                     sum(r.task_id == t for r in before)) for t in {r.task_id for r in before}}
        picked = [t.task_id for t in stream.tasks_for(step, 0, rates)]
        assert [r.task_id for r in recs if r.step == step][::8] == picked
    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    evals = [r for r in rows if "eval_accuracy" in r]  # at the start and the end
    assert [r["step"] for r in evals] == [0, 4]
    assert all(0.0 <= r[f"taskset/{name}/eval_accuracy"] <= 1.0
               for r in evals for name in ("add", "sub"))
    trainer = [r for r in rows if "filter/kept" in r]
    assert len(trainer) == 4
    for r in trainer:
        dropped = r["filter/reward_std_filter/dropped"] + r["filter/response_length_filter/dropped"]
        assert dropped + r["filter/kept"] == 32 and r["filter/reward_std_filter/dropped"] % 8 == 0


def test_human_relabels_exported_records_and_the_trainer_trains_on_them(stage, tmp_path,
                                                                        tiny_model):
    exported = tmp_path / "records.jsonl"
    result = rft("buffer", "export", stage / "buffer", "--out", exported)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in exported.read_text().splitlines()]
    assert len(lines) == 128 and all(x["kind"] == "rl" for x in lines)
    for i, x in enumerate(lines):  # what a person does in an editor: new rewards and a label
        x["reward"] = 10.0 + i % 5
        x["info"]["label"] = f"checked-{i}"
    relabeled = tmp_path / "relabeled.jsonl"
    relabeled.write_text("".join(json.dumps(x) + "\n" for x in lines))

    result = rft("buffer", "import", relabeled, "--kind", "rl", "--out", tmp_path / "buf")
    assert result.returncode == 0, result.stderr
    back = records(tmp_path / "buf")
    assert [r.reward for r in back] == [10.0 + i % 5 for i in range(128)]
    assert [r.info["label"] for r in back] == [f"checked-{i}" for i in range(128)]

    result = rft("run", DEMO, "--set", f"run.root={tmp_path}", "--set", f"model.path={tiny_model}",
                 "--set", "run.name=relabeled", "--set", "stages=[]", "--set", "mode=train",
                 "--set", f"data={{source: jsonl, path: {relabeled}, kind: rl}}",
                 "--set", "tasks.eval_size=16", "--set", "trainer.batch_size=16",
                 "--set", "trainer.steps=2", "--set", "eval.interval=0")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "relabeled" / "stages" / "0-main"
    means = [r["reward_mean"] for r in read_metrics(run / "metrics" / "trainer.jsonl")
             if "reward_mean" in r]
    # fifo over the imported file: step k trains on lines 16k .. 16k+15
    relabels = [10.0 + i % 5 for i in range(128)]
    assert means == pytest.approx([float(np.mean(relabels[16 * k:16 * k + 16]))
                                   for k in range(2)])
