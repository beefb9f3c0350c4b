"""Reward-model training (`algorithm_type: reward_model`, docs/reward-models.md), end to
end: preference pairs from a data file, a train stage that fits a scalar head and the
trunk with the Bradley-Terry loss, held-out pairwise accuracy as its evaluation, and its
export as a sequence-classification folder that transformers loads as it is, scoring the
held-out pairs as the run's evaluation did."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import rft

from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model
from rft_hpc.monitor.metrics import read_metrics

GOOD = ("kind", "calm", "clear", "warm", "bright", "gentle")
BAD = ("rude", "dull", "cold", "harsh", "grim", "sour")
TRAIN, HELD_OUT = 320, 80


def _pairs(path: Path, seed: int = 0) -> Path:
    """Pairs whose chosen response holds a word of GOOD and the rejected one a word of BAD,
    among the same filler words."""
    rng = random.Random(seed)
    filler = ("the", "day", "is", "very", "and", "so", "it")
    with path.open("w") as f:
        for i in range(TRAIN + HELD_OUT):
            words = rng.sample(filler, 3)
            at = rng.randrange(4)
            chosen = " ".join([*words[:at], rng.choice(GOOD), *words[at:]])
            rejected = " ".join([*words[:at], rng.choice(BAD), *words[at:]])
            f.write(json.dumps({"task_id": f"pair-{i}", "prompt": "Describe the day.",
                                "chosen": chosen, "rejected": rejected}) + "\n")
    return path


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("reward-model")
    model = init_tiny_model(tmp / "policy", TinyModelSpec(arch="qwen2", num_layers=2))
    config = {
        "run": {"name": "rm", "root": str(tmp), "seed": 0},
        "model": {"path": str(model)},
        "prompt": {"format": "chat"},
        "mode": "train",
        "algorithm": {"algorithm_type": "reward_model"},
        "data": {"source": "file", "path": str(_pairs(tmp / "pairs.jsonl")), "kind": "dpo",
                 "rows": [0, TRAIN], "eval_rows": [TRAIN, TRAIN + HELD_OUT]},
        "buffer": {"max_uses": 4},
        "trainer": {"lr": 1.0e-3, "batch_size": 16, "steps": 40, "save_interval": 20,
                    "threads": 1},
        "eval": {"interval": 20},
    }
    path = tmp / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    result = rft("run", path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "rm"


@pytest.mark.timeout(900)
def _stage(run: Path) -> Path:
    return run / "stages" / "0-main"


def test_a_reward_model_learns_the_preferences_and_is_evaluated_on_held_out_pairs(rm_run):
    stage = _stage(rm_run)
    steps = [m for m in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in m]
    assert len(steps) == 40
    assert all(0.0 <= m["accuracy"] <= 1.0 and m["pairs"] == 16 for m in steps)
    assert sum(m["loss"] for m in steps[-5:]) < sum(m["loss"] for m in steps[:5])
    evals = {m["step"]: m for m in read_metrics(stage / "metrics" / "trainer.jsonl")
             if "eval_accuracy" in m}
    assert sorted(evals) == [0, 20, 40]
    assert evals[0]["eval_accuracy"] == 0.0  # a fresh head scores every response 0
    assert evals[40]["eval_accuracy"] >= 0.9
    answers = read_jsonl(RunDir(stage).heldout_answers(40))
    assert [a["task_id"] for a in answers] == [f"pair-{i}" for i in
                                               range(TRAIN, TRAIN + HELD_OUT)]
    assert sum(a["correct"] for a in answers) / HELD_OUT == evals[40]["eval_accuracy"]
    summary = json.loads((rm_run / "summary.json").read_text())
    assert summary["eval"]["final_accuracy"] == evals[40]["eval_accuracy"]


@pytest.mark.timeout(900)
def test_the_exported_reward_model_loads_in_transformers_and_scores_the_same(rm_run,
                                                                             tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rft_hpc.config import load_config
    from rft_hpc.eval.pairwise import heldout_pairs

    out = tmp_path / "rm-export"
    result = rft("export", rm_run, "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    pairs = heldout_pairs(load_config(_stage(rm_run) / "config.yaml"), tokenizer)
    answers = read_jsonl(RunDir(_stage(rm_run)).heldout_answers(40))
    with torch.no_grad():  # one pair at a time: no padding, transformers' own pooling
        for pair, answer in zip(pairs, answers, strict=True):
            for tokens, want in ((pair.chosen_tokens, answer["chosen"]),
                                 (pair.rejected_tokens, answer["rejected"])):
                got = model(input_ids=torch.as_tensor([tokens.tolist()])).logits[0, 0]
                assert abs(float(got) - want) < 1e-5
