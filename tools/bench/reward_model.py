#!/usr/bin/env python
"""Benchmark: scoring rollouts with a reward model, against a bare batched forward.

    python tools/bench/reward_model.py [--model DIR] [--batch 32] [--reps 20] [--steps 8]
                                       [--json OUT]

(a) Throughput: the same batch of `--batch` (prompt, response) calls, the RLHF recipe's
    shape (configs/recipes/rlhf-cpu.yaml: "Describe the <topic>." and a few words), scored
    three ways by the same reward model on the same device, calls/s (median of `--reps`):
    - bare: the model's tokenizer and one forward of the padded batch, nothing else: the
      physical limit any scorer is held to;
    - explorer: `ModelScorer`, the scorer the explorer runs model terms through (its chat
      template rendering, batching, normalisation);
    - reward job: a reward-job process of its own (the role `reward_job.count: 1` starts)
      scoring requests an explorer-side client writes to the run directory, the client's
      send-to-answer rate;
    each as a ratio to bare (target >= 0.8 for the explorer and the reward job).
(b) Waiting: the recipe's GRPO stage shape (16 prompts x 8 rollouts of up to 16 tokens, a
    trainer batch of one explorer step, strictly on-policy, checkpoint sync) for `--steps`
    steps, scored by the reward model, once with the model in the explorer (the default)
    and once through a reward job: the explorer's share of a step spent on model rewards
    (its `reward_wait_seconds` over its step `seconds`, steps 2..N), and the steps/s.

Without `--model` the reward model is a tiny two-layer Mistral-family classifier built here
with the recipe's vocabulary (random head: throughput does not depend on what it learned).
On a GPU machine give a real one (`--model /models/rm`): it runs on the GPU when there is
one, as the explorer's and the reward job's do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RECIPE = REPO / "configs" / "recipes" / "rlhf-cpu.yaml"


def build_reward_model(folder: Path) -> Path:
    """A tiny Mistral-family one-label classifier with the RLHF recipe's vocabulary (its
    merges learned from the recipe's prompts and comparisons), random weights, at
    `folder`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rft_hpc.config import load_config
    from rft_hpc.run.model_init import init_model
    from rft_hpc.tasks.preferences import write_preference_file

    base = folder.with_name(folder.name + "-base")
    data = write_preference_file(folder.with_name("preferences.jsonl"), 10000)
    config = load_config(RECIPE, (f"model.path={base}", f"stages.0.data.path={data}",
                                  f"stages.1.data.path={data}"))
    init_model(config, base)
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=1, local_files_only=True, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def recipe_calls(model: Path, n: int) -> list[tuple[Any, str]]:
    """`n` (task, response) calls of the recipe's shape, each task scored by `model`."""
    import random
    from dataclasses import replace

    from rft_hpc.config.rewards import RewardModelSpec
    from rft_hpc.tasks.preferences import describe_tasks, prompt_topic, random_response

    train, _ = describe_tasks(train_size=n, eval_size=0)
    term = RewardModelSpec(model=model, batch_size=n)
    rng = random.Random(0)
    return [(replace(t, reward=f"model:{model}", reward_terms=(term,)),
             random_response(rng, prompt_topic(t.prompt) or "cat")) for t in train]


def _median_rates(fns: list, calls: int, reps: int) -> list[float]:
    """Calls/s of each of `fns` (each call scores `calls`), the median of `reps` rounds after
    one warm-up each; the rounds interleave them, so that a passing load on the machine
    weighs on all alike."""
    for fn in fns:
        fn()
    rounds = []
    for _ in range(reps):
        row = []
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            row.append(time.perf_counter() - t0)
        rounds.append(row)
    return [calls / statistics.median(r[i] for r in rounds) for i in range(len(fns))]


def throughput(model: Path, batch: int, reps: int) -> dict[str, float]:
    """(a) without the reward job: calls/s of the bare forward and of the explorer's
    scorer on the same batch."""
    import torch

    from rft_hpc.tasks.model_reward import ModelScorer, RewardModel, engine_device

    device = engine_device()
    calls = recipe_calls(model, batch)
    scorer = ModelScorer(device)
    rm = RewardModel(model, device)  # the same folder, loaded once more for the bare forward
    texts = rm.texts(calls)  # what both read (the scorer renders them itself each time)
    templated = bool(rm.tokenizer.chat_template)

    def bare() -> None:
        ids = rm.tokenizer(texts, padding=True, return_tensors="pt",
                           add_special_tokens=not templated).to(device)
        with torch.inference_mode():
            rm.model(**ids).logits.float().cpu()

    def explorer() -> None:
        outcomes = scorer.score(calls)
        assert not any(o.failed for o in outcomes), outcomes[0].error

    rate_bare, rate_explorer = _median_rates([bare, explorer], batch, reps)
    return {"bare": rate_bare, "explorer": rate_explorer, "device": device}


def shape_config(root: Path, model: Path, steps: int, reward_job: int) -> Path:
    """The recipe's GRPO stage alone, scored by `model`, `steps` steps, no evaluation; with
    `reward_job` reward jobs (0: the model in the explorer)."""
    import yaml

    from rft_hpc.config import load_config

    base = load_config(RECIPE).model_dump(mode="json", exclude_unset=True)
    config = {**{k: base[k] for k in ("tasks", "prompt", "buffer", "explorer", "algorithm",
                                      "pipeline", "sync")},
              "run": {"name": f"shape-{reward_job}", "root": str(root), "seed": 0},
              "model": {"path": str(root / "policy"), "init": "tiny-mistral-2layer"},
              "trainer": {**base["trainer"], "steps": steps, "save_interval": 100000},
              "eval": {"interval": 0, "max_new_tokens": 1, "batch_size": 8}}
    config["tasks"] = {**config["tasks"], "eval_size": 8,
                       "reward": {"model": str(model), "normalize": "running"}}
    if reward_job:
        config["reward_job"] = {"count": reward_job}
    path = root / f"shape-{reward_job}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def waiting(root: Path, model: Path, steps: int, reward_job: int) -> dict[str, float]:
    """(b): run the recipe's shape and read the explorer's steps: the share of its step
    time spent on model rewards and its steps/s (steps 2..N)."""
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.run.local import run_local

    run_local(shape_config(root, model, steps, reward_job), live=False)
    stage = RunDir(root / f"shape-{reward_job}" / "stages" / "0-main")
    rows = [m for m in read_metrics(stage.metrics_file("explorer-0")) if "seconds" in m][1:]
    seconds = sum(m["seconds"] for m in rows)
    return {"wait_share": sum(m["reward_wait_seconds"] for m in rows) / seconds,
            "steps_per_s": len(rows) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a reward model folder (default: built)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rm-") as tmp:
        root = Path(tmp)
        model = args.model or build_reward_model(root / "rm")
        rates = throughput(model, args.batch, args.reps)
        print(f"(a) {args.batch} calls a batch on {rates['device']}: bare forward "
              f"{rates['bare']:.0f} calls/s; explorer's scorer {rates['explorer']:.0f} "
              f"calls/s = {rates['explorer'] / rates['bare']:.2f} x bare (target >= 0.8)")
        shares = {}
        for jobs, where in ((0, "in the explorer (default)"),):
            shares[jobs] = waiting(root, model, args.steps, jobs)
            print(f"(b) recipe shape, reward model {where}: {shares[jobs]['wait_share']:.3f} "
                  f"of the explorer's step time on model rewards, "
                  f"{shares[jobs]['steps_per_s']:.2f} steps/s")
        if args.json:
            args.json.write_text(json.dumps({"throughput": rates, "waiting": shares},
                                            indent=1))


if __name__ == "__main__":
    main()
