#!/usr/bin/env python
"""Benchmark a GRPO step with `trainer.share_prompts` (the default) against padded rows.

    python tools/bench/shared_prompts.py [--dir DIR] [--steps 5] [--threads 1]

A GRPO batch is `groups` x `repeat` rollouts; the rows of a group begin with the same prompt.
Padded, every row runs its prompt; packed (rft_hpc.batch.shared_prompts), each group runs it
once. For each batch shape below, a trainer of each setting takes `--steps` steps on the
same batch (after one untimed step), alternating, on the CPU recipe's tiny two-layer Qwen2
(built locally). It prints the default's median step seconds first, padded rows' beside it,
the speedup (padded / shared), and its limit: the tokens the padded rows run over the
tokens the packed sequences run (attention's share of the work not counted).

Shapes: the CPU recipe's GRPO batch (32 problems x 8, prompts of ~90 tokens, replies of
~14: configs/recipes/gsm8k-cpu.yaml) and one with replies as long as the prompt.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    "recipe (32 x 8, prompt 90, reply <= 14)": (32, 8, 90, 14),
    "long replies (32 x 8, prompt 90, reply <= 90)": (32, 8, 90, 90),
}


def batch(groups: int, repeat: int, prompt: int, reply: int, seed: int = 0):
    """Rollouts of `groups` prompts, `repeat` each, replies of 1..`reply` tokens."""
    import numpy as np

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import Experience

    rng = np.random.default_rng(seed)
    records = []
    for g in range(groups):
        head = rng.integers(5, 250, prompt)
        for _ in range(repeat):
            tail = rng.integers(5, 250, int(rng.integers(max(1, reply // 2), reply + 1)))
            records.append(Experience(np.concatenate([head, tail]), prompt,
                                      reward=float(rng.random() < 0.5), group_id=g,
                                      logprobs=np.full(prompt + len(tail), -1.0)))
    return Batch(records=records, weights=[1.0] * len(records), uses=[0] * len(records))


def trainer(folder: Path, model: Path, share: bool, threads: int):
    import yaml

    from rft_hpc.config import load_config
    from rft_hpc.trainer.trainer import Trainer

    path = folder / f"share-{share}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"root": str(folder), "seed": 0}, "model": {"path": str(model)},
        "tasks": {"type": "arithmetic", "digits": 1, "eval_size": 8},
        "algorithm": {"algorithm_type": "grpo"},
        "trainer": {"lr": 1e-4, "threads": threads, "share_prompts": share}}))
    return Trainer(load_config(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    from rft_hpc.batch.shared_prompts import pack_shared_prompts
    from rft_hpc.batch.tokens import collate
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    torch.set_num_threads(args.threads)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-shared-"))
    model = folder / "tiny-qwen2-2layer"
    if not model.exists():
        init_tiny_model(model, TinyModelSpec(arch="qwen2", num_layers=2))
    trainers = {share: trainer(folder, model, share, args.threads) for share in (True, False)}
    print("| batch | shared s/step (default) | padded s/step | speedup | token ratio |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        data = batch(*shape)
        tb = collate(data.records)
        packed = pack_shared_prompts(tb, trainers[True].hidden_size)
        limit = tb.input_ids.numel() / packed.input_ids.numel() if packed else 1.0
        times: dict[bool, list[float]] = {True: [], False: []}
        for share in (True, False):
            trainers[share].step(data, version=0)  # untimed: allocations, first calls
        for _ in range(args.steps):
            for share in (True, False):
                start = time.perf_counter()
                trainers[share].step(data, version=0)
                times[share].append(time.perf_counter() - start)
        shared, padded = (statistics.median(times[s]) for s in (True, False))
        print(f"| {name} | {shared:.3f} | {padded:.3f} | {padded / shared:.2f} | "
              f"{limit:.2f} |")


if __name__ == "__main__":
    main()
