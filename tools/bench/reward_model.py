#!/usr/bin/env python
"""Benchmark: scoring rollouts with a reward model, against a bare batched forward.

    python tools/bench/reward_model.py [--model DIR] [--groups 16] [--repeat 8] [--batch 32]
                                       [--reps 20] [--steps 8] [--json OUT]

(a) Throughput: one explorer step of the RLHF recipe (configs/recipes/rlhf-cpu.yaml):
    `--groups` groups of `--repeat` (prompt, response) calls, "Describe the <topic>." and a
    few words, scored by the same reward model on the same device in forwards of up to the
    term's `--batch` calls, three ways, calls/s (median of `--reps`):
    - bare: the model's tokenizer and the forwards of the padded batches, nothing else:
      the physical limit any scorer is held to;
    - explorer: `ModelScorer`, the scorer the explorer runs model terms through (its chat
      template rendering, batching, normalisation), given the step's calls group by group
      as the explorer gives them;
    - reward job: a reward-job process of its own (the role `reward_job.count: 1` starts;
      on CPUs on a core of its own, as on a device of its own) answering the requests an
      explorer-side client writes to the run directory, one per group as an explorer sends
      them: the client's send-to-answer rate;
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
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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


def recipe_groups(model: Path, groups: int, repeat: int, batch: int,
                  ) -> list[list[tuple[Any, str]]]:
    """`groups` groups of `repeat` (task, response) calls of the recipe's shape (a group's
    calls share their task), each scored by `model` in forwards of up to `batch`."""
    import random
    from dataclasses import replace

    from rft_hpc.config.rewards import RewardModelSpec
    from rft_hpc.tasks.preferences import describe_tasks, prompt_topic, random_response

    train, _ = describe_tasks(train_size=groups, eval_size=0)
    term = RewardModelSpec(model=model, batch_size=batch)
    rng = random.Random(0)
    return [[(replace(t, reward=f"model:{model}", reward_terms=(term,)),
              random_response(rng, prompt_topic(t.prompt) or "cat")) for _ in range(repeat)]
            for t in train]


def score_groups(scorer: Any, groups: list[list[tuple[Any, str]]]) -> None:
    """Submit each group to `scorer` as an explorer does, then pump it until all are
    scored; every call must succeed."""
    scorings = [scorer.submit(group) for group in groups]
    while not all(s.done for s in scorings):
        scorer.pump(None)
    for scoring in scorings:
        assert not any(o.failed for o in scoring.result()), scoring.result()[0].error


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


def throughput(root: Path, model: Path, groups: int, repeat: int, batch: int,
               reps: int) -> dict[str, Any]:
    """(a): calls/s of the bare forward, of the explorer's scorer and through a reward job,
    on the same batch and the same device, timed in the same rounds, with the threads a
    role gets there."""
    import torch

    from rft_hpc.runtime.placement import role_threads
    from rft_hpc.tasks.model_reward import ModelScorer, RewardModel, engine_device

    device = engine_device()
    allowed = os.sched_getaffinity(0)
    # on CPUs the reward job gets a core of its own, as a device of its own, and the bare
    # forward and the explorer's scorer run on that same core (the same device) while the
    # job waits; the explorer-side client of the job waits on another core
    cores = sorted(allowed)
    job_cores = {cores[-1]} if device == "cpu" and len(cores) >= 2 else None
    client_cores = {cores[0]} if job_cores else allowed
    device_cores = job_cores or allowed

    def on(where: set[int], fn: Any) -> Any:
        def placed() -> None:
            os.sched_setaffinity(0, where)
            fn()
        return placed

    # the threads the reward job takes on its core (`role_threads` there), as the forwards
    # here run on that core too
    threads = len(device_cores) if job_cores else role_threads(None, None)[0]
    torch.set_num_threads(threads)
    step = recipe_groups(model, groups, repeat, batch)
    calls = [call for group in step for call in group]
    scorer = ModelScorer(device)
    rm = RewardModel(model, device)  # the same folder, loaded once more for the bare forward
    texts = rm.texts(calls)  # what both read (the scorer renders them itself each time)
    templated = bool(rm.tokenizer.chat_template)

    def bare() -> None:
        for i in range(0, len(texts), batch):
            ids = rm.tokenizer(texts[i:i + batch], padding=True, return_tensors="pt",
                               add_special_tokens=not templated).to(device)
            with torch.inference_mode():
                rm.model(**ids).logits.float().cpu()

    try:
        with reward_job_client(root, model, job_cores) as client:
            rate_bare, rate_explorer, rate_job = _median_rates(
                [on(device_cores, bare), on(device_cores, lambda: score_groups(scorer, step)),
                 on(client_cores, lambda: score_groups(client, step))], len(calls), reps)
    finally:
        os.sched_setaffinity(0, allowed)  # (b)'s roles place themselves
    return {"bare": rate_bare, "explorer": rate_explorer, "reward_job": rate_job,
            "device": device, "threads": threads}


@contextlib.contextmanager
def reward_job_client(root: Path, model: Path, cores: set[int] | None = None,
                      ) -> Iterator[Any]:
    """A reward job process of its own (`rft-hpc role reward`, as `reward_job.count: 1`
    starts it; on `cores` when given) on a stage of its own, and the explorer-side scorer
    that sends it requests (`RemoteModelScorer`); the job ends when the block does."""
    import subprocess

    from rft_hpc.config import load_config
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.runtime.common import freeze_config, write_heartbeat
    from rft_hpc.tasks.remote_reward import RemoteModelScorer

    stage = root / "reward-job-stage"
    run = RunDir(stage)
    run.config.parent.mkdir(parents=True, exist_ok=True)
    freeze_config(load_config(shape_config(root, model, 1, 1)), run.config)
    job = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", "role", "reward", str(stage),
                            "--index", "0"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores
                           else None)
    client = RemoteModelScorer(stage, explorer=0, count=1)
    try:
        yield client
    finally:
        client.close()
        write_heartbeat(run, "explorer-0", status="done")  # the reward job's cue to end
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()


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
    parser.add_argument("--groups", type=int, default=16, help="groups of a step")
    parser.add_argument("--repeat", type=int, default=8, help="calls of a group")
    parser.add_argument("--batch", type=int, default=32, help="the term's batch_size")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rm-") as tmp:
        root = Path(tmp)
        model = args.model or build_reward_model(root / "rm")
        rates = throughput(root, model, args.groups, args.repeat, args.batch, args.reps)
        print(f"(a) a step of {args.groups} x {args.repeat} calls in forwards of up to "
              f"{args.batch} on {rates['device']} ({rates['threads']} threads): bare "
              f"{rates['bare']:.0f} calls/s; explorer's scorer {rates['explorer']:.0f} "
              f"calls/s = {rates['explorer'] / rates['bare']:.2f} x bare; through a reward "
              f"job {rates['reward_job']:.0f} calls/s = "
              f"{rates['reward_job'] / rates['bare']:.2f} x bare (targets >= 0.8)")
        shares = {}
        for jobs, where in ((0, "in the explorer (default)"), (1, "in a reward job")):
            shares[jobs] = waiting(root, model, args.steps, jobs)
            print(f"(b) recipe shape, reward model {where}: {shares[jobs]['wait_share']:.3f} "
                  f"of the explorer's step time on model rewards, "
                  f"{shares[jobs]['steps_per_s']:.2f} steps/s")
        if args.json:
            args.json.write_text(json.dumps({"throughput": rates, "waiting": shares},
                                            indent=1))


if __name__ == "__main__":
    main()
