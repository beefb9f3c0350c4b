"""A reward model as a reward, through the CLI as a user's: `rft-hpc run` on a config whose
reward is a weighted sum of a function and a tiny reward model explores, trains and
finishes, and every record's reward is that sum, the model's term a plain transformers
forward of the record's prompt and response in the model's chat template; a missing reward
model folder is refused before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from helpers.reward_models import reward_model
from helpers.reward_runs import reward_run_config
from helpers.runs import rollouts
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rft_hpc.config import load_config
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.rewards import exact_match
from rft_hpc.tasks.source import build_tasks


def rft(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def experiment(tmp_path, tiny_model, rm):
    return reward_run_config(tmp_path, "rm", tiny_model, [
        "{name: exact_match, weight: 0.5}", f"{{model: {rm}, weight: 2.0, batch_size: 3}}"])


def model_scores(folder, pairs):
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder),
                                                               local_files_only=True)
    out = []
    for prompt, response in pairs:
        # the prompt as the policy reads it, the response, the end-of-turn token
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True) \
            + response + "<|im_end|>"
        with torch.inference_mode():
            out.append(float(model(**tokenizer(text, return_tensors="pt",
                                               add_special_tokens=False)).logits[0, 0]))
    return out


@pytest.mark.timeout(600)
def test_a_run_scored_by_a_reward_model_finishes_with_its_scores(tmp_path, tiny_model):
    rm = reward_model(tmp_path / "rm")
    config = experiment(tmp_path, tiny_model, rm)
    result = rft("run", config, cwd=tmp_path, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    stage = tmp_path / "runs" / "rm" / "stages" / "0-main"
    steps = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert sum(s["reward_errors"] + s["reward_timeouts"] for s in steps) == 0
    records = rollouts(stage)
    assert len(records) == 16
    train, _ = build_tasks(load_config(config).tasks, 0)
    tasks = {t.task_id: t for t in train}
    pairs = [(tasks[r.task_id].prompt, r.info["response"]) for r in records]
    expected = [0.5 * exact_match(tasks[r.task_id], r.info["response"]) + 2.0 * score
                for r, score in zip(records, model_scores(rm, pairs), strict=True)]
    assert [r.reward for r in records] == pytest.approx(expected, abs=1e-5)
    assert len({round(r.reward, 6) for r in records}) > 1
    evals = [m for m in read_metrics(stage / "metrics" / "trainer.jsonl")
             if m.get("eval_reward") is not None]
    assert evals and all(m.get("eval_reward_errors", 0) == 0 for m in evals)


def test_a_missing_reward_model_is_refused_before_anything_starts(tmp_path, tiny_model):
    config = experiment(tmp_path, tiny_model, tmp_path / "no-rm")
    result = rft("run", config, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"exp.yaml:9: tasks.reward[1].model: reward model folder '{tmp_path / 'no-rm'}' " \
           "does not exist" in re.sub(r"\s+", " ", result.stderr), result.stderr
    assert not (tmp_path / "runs").exists()
