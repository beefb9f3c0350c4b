"""The RLHF recipe, end to end (configs/recipes/rlhf-cpu.yaml, docs/reward-models.md):
comparisons in WebGPT's layout generated here and scored by a hidden gold rule; stage `rm`
trains a reward model on them, `sft` warms a tiny chat policy up, `grpo` trains it against
the reward model with a KL to the warm-up, the gold rule reported beside it (`eval.gold`).

The reward model must reach held-out pairwise accuracy >= 0.85, and its exported folder
must score as the run did when transformers loads it as it is. GRPO must raise both the
reward model's held-out score and the gold rule's beyond noise: each of the 500 held-out
prompts is answered four times (seeded samples) by the warm-up's weights and by GRPO's, the
mean scores of each prompt are paired, and the one-sided sign test must give p < 0.001 for
each. Both figures must be in summary.json and in report.png.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers.learning import SEED, pinned, record
from helpers.paths import ROOT
from helpers.runs import rft
from helpers.stats import sign_test_p

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.tasks.model_reward import model_text
from rft_hpc.tasks.preferences import write_preference_file
from rft_hpc.tasks.source import build_tasks

RECIPE = ROOT / "configs" / "recipes" / "rlhf-cpu.yaml"
HELD_OUT = 500
P_MAX = 1e-3
ACCURACY_MIN = 0.85


@pytest.fixture(scope="module")
def rlhf_run(tmp_path_factory) -> Path:
    """A finished three-stage run of the recipe (reward model, warm-up, GRPO against the
    reward model) on 10000 generated comparisons, its data and model seeded by the learning
    seed: at seed 0 the model is built by the run itself, as a user's run builds it."""
    from rft_hpc.run.model_init import init_model

    tmp = tmp_path_factory.mktemp("rlhf-recipe")
    data = write_preference_file(tmp / "preferences.jsonl", 10000, seed=SEED)
    model = tmp / "model"
    sets = [f"run.root={tmp}", f"model.path={model}", f"stages.0.data.path={data}",
            f"stages.1.data.path={data}", *pinned(trainer_stages=2)]
    if SEED != 0:  # the kind's own weights are seed 0's
        init_model(load_config(RECIPE, tuple(sets)), model, seed=SEED)
    result = rft("run", RECIPE, *[a for s in sets for a in ("--set", s)], timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "rlhf-cpu"


def _answers(run: Path, stage: str, version: int) -> list[dict]:
    stage_dir = run / "stages" / stage
    answers = read_jsonl(RunDir(stage_dir).heldout_answers(version))
    _, tasks = build_tasks(load_config(stage_dir / "config.yaml").tasks, SEED)
    assert [a["task_id"] for a in answers] == [t.task_id for t in tasks]
    assert len(answers) == HELD_OUT and all(len(a["samples"]) == 4 for a in answers)
    return answers


def _means(answers: list[dict], key: str) -> list[float]:
    return [sum(a[key]) / len(a[key]) for a in answers]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_reward_model_learns_the_gold_rule_and_exports_as_it_scored(rlhf_run):
    summary = json.loads((rlhf_run / "summary.json").read_text())
    rm = summary["stages"][0]
    print(f"reward model held-out pairwise accuracy {rm['eval_final']:.3f}")
    record("rlhf recipe: reward model", accuracy=rm["eval_final"])
    assert rm["name"] == "rm" and rm["eval_final"] >= ACCURACY_MIN
    # the exported folder, loaded by transformers as it is, gives the scores the GRPO stage's
    # evaluation recorded for its held-out answers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(rm["reward_model"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    _, tasks = build_tasks(load_config(rlhf_run / "stages" / "2-grpo" / "config.yaml").tasks,
                           SEED)
    answers = _answers(rlhf_run, "2-grpo", 40)
    for task, answer in list(zip(tasks, answers, strict=True))[:16]:
        ids = tokenizer(model_text(tokenizer, task, answer["answer"]), return_tensors="pt",
                        add_special_tokens=False)
        with torch.inference_mode():
            score = float(model(**ids).logits[0, 0])
        assert abs(score - answer["reward"]) < 1e-5, (task.task_id, score, answer["reward"])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_grpo_raises_the_reward_models_score_and_the_gold_rules_beyond_noise(rlhf_run):
    before = _answers(rlhf_run, "1-sft", 120)
    after = _answers(rlhf_run, "2-grpo", 40)
    figures = {}
    for what, key in (("reward model", "sample_rewards"), ("gold rule", "sample_golds")):
        b0, a0 = _means(before, key), _means(after, key)
        p, up, down = sign_test_p(b0, a0)
        print(f"held-out {what} score {sum(b0) / HELD_OUT:.3f} -> {sum(a0) / HELD_OUT:.3f}: "
              f"{up} prompts up, {down} down, one-sided p = {p:.2g}")
        figures.update({f"{key}_before": sum(b0) / HELD_OUT, f"{key}_after": sum(a0) / HELD_OUT,
                        f"{key}_p": p})
        assert sum(a0) > sum(b0) and p < P_MAX, (what, up, down, p)
    record("rlhf recipe", **figures)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_both_rewards_are_in_the_summary_and_the_report(rlhf_run):
    summary = json.loads((rlhf_run / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["rm", "sft", "grpo"]
    after = _answers(rlhf_run, "2-grpo", 40)
    before = _answers(rlhf_run, "1-sft", 120)
    for what, key in (("reward", "sample_rewards"), ("gold", "sample_golds")):
        for when, answers in (("initial", before), ("final", after)):
            assert summary["eval"][f"{when}_{what}_mean@4"] == pytest.approx(
                sum(_means(answers, key)) / HELD_OUT)
        assert summary["eval"][f"final_{what}"] == pytest.approx(
            sum(a[what] for a in after) / HELD_OUT)
    png = (rlhf_run / "report.png").read_bytes()
    # four panels: reward, held-out accuracy, off-policy (the GRPO stage's staleness), and
    # the trained and gold rewards side by side
    assert struct.unpack(">I", png[16:20])[0] == 2100
