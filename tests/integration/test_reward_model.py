"""Reward-model training (`algorithm_type: reward_model`, docs/reward-models.md), end to
end: preference pairs from a data file, a train stage that fits a scalar head and the
trunk with the Bradley-Terry loss, held-out pairwise accuracy as its evaluation, and its
export as a sequence-classification folder that transformers loads as it is, scoring the
held-out pairs as the run's evaluation did."""

from __future__ import annotations

import json
import random
import sys
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


def _rank_step(config_path: str, out: str) -> None:
    """One rank of `test_one_step_on_two_ranks_equals_one_process` (run as a script)."""
    import numpy as np

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import DPOPair
    from rft_hpc.config import load_config
    from rft_hpc.trainer.distributed import init_distributed, shutdown
    from rft_hpc.trainer.reward_model import RewardModelTrainer

    torch.set_num_threads(1)
    ctx = init_distributed()
    trainer = RewardModelTrainer(load_config(Path(config_path)), ctx)
    torch.manual_seed(0)  # a head that is not zero: every parameter gets a gradient
    torch.nn.init.normal_(trainer.model.score.weight, std=0.1)
    rng = np.random.default_rng(0)
    pairs = [DPOPair(rng.integers(3, 200, int(rng.integers(6, 12))),
                     rng.integers(3, 200, int(rng.integers(6, 12))), prompt_length=3,
                     info={"margin": 0.5} if i % 2 else {}) for i in range(5)]
    values = trainer.step(Batch(records=pairs) if ctx.is_main else None)
    torch.save({"params": {k: p.detach().clone() for k, p in trainer.model.named_parameters()},
                "grads": {k: p.grad.clone() for k, p in trainer.model.named_parameters()},
                "values": values}, Path(out) / f"rank{ctx.rank}-of-{ctx.world_size}.pt")
    shutdown()


@pytest.mark.timeout(300)
def test_one_step_on_two_ranks_equals_one_process(tmp_path):
    """The pairs of a batch split over two ranks (one of them with a pair fewer) train the
    reward model as one process does: the same weights after the step, the same metrics."""
    from helpers.ranks import finish, start_ranks, write_config

    model = init_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen2", num_layers=1))
    config = write_config(tmp_path / "rm.yaml", model, mode="train",
                          algorithm={"algorithm_type": "reward_model"},
                          data={"source": "tasks", "kind": "dpo"},
                          trainer={"lr": 1e-3, "batch_size": 5, "grad_clip": 1.0})
    args = [sys.executable, __file__, "step", str(config), str(tmp_path)]
    results = finish(start_ranks(args, 1, None) + start_ranks(args, 2, tmp_path / "rdzv"))
    assert all(rc == 0 for rc, _ in results), [err[-2000:] for _, err in results]
    one = torch.load(tmp_path / "rank0-of-1.pt")
    two = [torch.load(tmp_path / f"rank{r}-of-2.pt") for r in range(2)]
    assert all(torch.equal(two[0]["params"][k], two[1]["params"][k]) for k in one["params"])
    for k, g in one["grads"].items():  # the summed gradient is the whole batch's (clipped)
        assert float((two[0]["grads"][k] - g).abs().max()) <= 2e-6 * float(g.abs().max()), k
        clear = g.abs() >= 1e-6  # AdamW's first step: lr * g / |g| where g is not noise
        torch.testing.assert_close(two[0]["params"][k][clear], one["params"][k][clear],
                                   rtol=1e-6, atol=1e-7, msg=k)
    assert one["values"]["pairs"] == two[0]["values"]["pairs"] == 5
    for key in ("loss", "accuracy", "reward_gap"):
        assert two[0]["values"][key] == pytest.approx(one["values"][key], rel=1e-5)


if __name__ == "__main__" and sys.argv[1] == "step":
    from rft_hpc.runtime.exit import leave_process

    _rank_step(*sys.argv[2:])
    leave_process(0)  # as `rft-hpc role trainer` ends: not through gloo's teardown
