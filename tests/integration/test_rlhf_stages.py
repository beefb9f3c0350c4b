"""RLHF's stages as one run (docs/reward-models.md): a reward-model stage trains on
generated preferences (WebGPT's layout, `rft-hpc data preferences`), an SFT stage warms the
policy up, and a GRPO stage explores with the reward model the first stage made (`reward:
{stage: rm}`), the gold rule reported beside it (`eval.gold`), then a PPO stage (its critic,
a KL to its start) with the same reward model. Shrunk to a few steps: what
is checked is the plumbing (which weights each stage starts from, which model scores, what
summary.json and report.png say), not learning."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from helpers.runs import rft, rollouts
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rft_hpc.config import load_config
from rft_hpc.core.rundir import read_jsonl
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model
from rft_hpc.tasks.preferences import gold_score
from rft_hpc.tasks.source import build_tasks

CONFIG = """\
run: {{name: rlhf, root: {root}, seed: 0}}
model: {{path: {model}}}
prompt: {{format: chat}}
tasks: {{type: describe, train_size: 64, eval_size: 8, reward: {{stage: rm}}}}
explorer: {{tasks_per_step: 2, repeat: 4, max_new_tokens: 12}}
trainer: {{steps: 2, batch_size: 8, threads: 1}}
sync: {{method: checkpoint, interval: 1, offset: 0}}
eval: {{interval: 0, max_new_tokens: 12, gold: rft_hpc.tasks.preferences:gold_reward}}
stages:
  - name: rm
    mode: train
    algorithm: {{algorithm_type: reward_model}}
    data: {{source: file, path: {prefs}, kind: dpo, layout: webgpt, rows: [0, 240],
            eval_rows: [240, 300]}}
    trainer: {{steps: 4, batch_size: 8, lr: 1.0e-3}}
  - name: sft
    mode: train
    algorithm: {{algorithm_type: sft}}
    data: {{source: file, path: {prefs}, kind: sft, keys: {{prompt: question,
            response: answer_0}}}}
    trainer: {{steps: 3, batch_size: 8}}
  - name: grpo
    mode: both
  - name: ppo
    mode: both
    algorithm: {{algorithm_type: ppo, critic_lr: 1.0e-4, kl_loss_fn: low_var_kl}}
"""


@pytest.fixture(scope="module")
def rlhf_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("rlhf")
    made = rft("data", "preferences", "--out", tmp / "prefs.jsonl", "--rows", 300)
    assert made.returncode == 0, made.stderr[-2000:]
    model = init_tiny_model(tmp / "policy", TinyModelSpec(arch="qwen2", num_layers=2))
    path = tmp / "rlhf.yaml"
    path.write_text(CONFIG.format(root=tmp / "runs", model=model, prefs=tmp / "prefs.jsonl"))
    result = rft("run", path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "runs" / "rlhf"


@pytest.mark.timeout(1200)
def test_policy_stages_chain_past_the_reward_model_which_scores_the_rl_stage(rlhf_run):
    stages = rlhf_run / "stages"
    export = stages / "0-rm" / "reward_model"
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"]
    sft, grpo = load_config(stages / "1-sft" / "config.yaml"), load_config(
        stages / "2-grpo" / "config.yaml")
    assert sft.model.start_weights is None  # not the reward model's weights
    sft_result = json.loads((stages / "1-sft" / "state" / "result.json").read_text())
    assert grpo.model.start_weights == Path(sft_result["weights"])
    assert grpo.tasks.reward.model == export.resolve() and grpo.tasks.reward.stage is None
    # every rollout's reward is the exported reward model's score of what it read: the
    # prompt as the policy reads it, the response, the end-of-turn token
    tokenizer = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(export),
                                                               local_files_only=True)
    records = [r for r in rollouts(stages / "2-grpo") if hasattr(r, "reward")]
    records += [r for r in rollouts(stages / "3-ppo") if hasattr(r, "reward")][:4]
    assert len(records) > 4
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record in records[:4] + records[-4:]:  # GRPO's and PPO's
        response = [int(t) for t in record.tokens[record.prompt_length:] if int(t) != eot]
        text = tokenizer.decode(record.tokens[:record.prompt_length]) + \
            tokenizer.decode(response, skip_special_tokens=True) + "<|im_end|>"
        with torch.inference_mode():
            want = float(model(**tokenizer(text, return_tensors="pt",
                                           add_special_tokens=False)).logits[0, 0])
        assert abs(record.reward - want) < 1e-4


@pytest.mark.timeout(1200)
def test_the_gold_reward_is_reported_beside_the_trained_one(rlhf_run):
    summary = json.loads((rlhf_run / "summary.json").read_text())
    for key in ("initial_reward", "final_reward", "initial_gold", "final_gold"):
        assert isinstance(summary["eval"][key], float), key
    stage = rlhf_run / "stages" / "3-ppo"  # the last stage's end
    answers = read_jsonl(stage / "eval" / "answers" / "v000002.jsonl")
    _, held_out = build_tasks(load_config(stage / "config.yaml").tasks, 0)
    assert [a["task_id"] for a in answers] == [t.task_id for t in held_out]
    assert [a["gold"] for a in answers] == [gold_score(t.prompt, a["answer"])
                                            for t, a in zip(held_out, answers, strict=True)]
    assert summary["eval"]["final_gold"] == pytest.approx(
        sum(a["gold"] for a in answers) / len(answers))
    png = (rlhf_run / "report.png").read_bytes()
    # four panels: reward, held-out accuracy, off-policy, and the trained and gold rewards
    assert struct.unpack(">I", png[16:20])[0] == 2100


@pytest.mark.timeout(1200)
def test_ppo_trains_its_critic_on_the_reward_models_scores_with_a_kl(rlhf_run):
    stage = rlhf_run / "stages" / "3-ppo"
    assert load_config(stage / "config.yaml").tasks.reward.model == (
        rlhf_run / "stages" / "0-rm" / "reward_model").resolve()
    steps = [m for m in read_jsonl(stage / "metrics" / "trainer.jsonl") if "loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert math.isfinite(m["value_loss"]) and m["value_loss"] > 0
        assert math.isfinite(m["kl_ref"]) and m["kl_ref"] >= 0
