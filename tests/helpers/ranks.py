"""Trainer ranks as a launcher starts them: separate processes with RANK / WORLD_SIZE /
LOCAL_RANK and a file rendezvous in their environment, over gloo; and their inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from helpers.paths import ROOT, pythonpath
from rft_hpc.algorithms.advantages import grpo_advantages
from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import Experience, SFTSample
from rft_hpc.trainer.distributed import ENV_BACKEND, ENV_INIT_FILE, Shard, shard_batch

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", ENV_INIT_FILE,
             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
             "SLURM_RESTART_COUNT")


def rank_env(rank: int, world: int, init_file: Path | None) -> dict[str, str]:
    """The environment of one rank (a world of 1: no distributed variables at all)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1", **{ENV_BACKEND: "gloo"})
    if world > 1:
        assert init_file is not None
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   **{ENV_INIT_FILE: str(init_file)})
    return env


def start_ranks(args: list[str], world: int, init_file: Path | None) -> list[subprocess.Popen]:
    """`world` processes running `args` from the checkout, each with its rank's environment."""
    return [subprocess.Popen(args, cwd=ROOT, env=rank_env(r, world, init_file), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    """Each process's (exit status, stderr); all are killed if one outlives `timeout`."""
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err))
    return out


def write_config(path: Path, model: Path, lora: dict | None = None, **sections: dict) -> Path:
    """A config file at `path` for `model` (with a LoRA adapter: `model.lora`), with
    `sections` over a seeded minimal base."""
    model_section = {"path": str(model)} if lora is None else {"path": str(model), "lora": lora}
    data = {"run": {"root": str(path.parent), "seed": 0}, "model": model_section,
            "explorer": {"temperature": 1.0}, **sections}
    path.write_text(yaml.safe_dump(data))
    return path


def fixed_batch(algorithm: str) -> Batch:
    """Eight records of different lengths (tiny vocabulary: ids 4..19)."""
    rng = np.random.default_rng(0)
    records: list = []
    for i in range(8):
        n = int(rng.integers(7, 16))
        tokens = rng.integers(4, 20, n)
        if algorithm == "sft":
            records.append(SFTSample(tokens, prompt_length=3))
            continue
        logprobs = (-3.0 + rng.normal(0, 0.3, n)).astype(np.float32)
        records.append(Experience(tokens, prompt_length=3, reward=float(rng.integers(0, 3)) / 2,
                                  group_id=7 if i < 4 else 9,
                                  logprobs=None if i == 5 else logprobs))  # 5: imported
    weights = [1.0] * 7 + [0.5]
    return Batch(records=records, weights=weights, uses=[0] * 8)


def grpo_shards(batch: Batch, world_size: int) -> list[Shard]:
    """`batch` in `world_size` shards with GRPO advantages computed over the whole batch,
    as a single process computes them, times each record's sample weight."""
    rewards = torch.tensor([r.reward for r in batch.records], dtype=torch.float32)
    groups = torch.tensor([r.group_id for r in batch.records], dtype=torch.long)
    advantages = grpo_advantages(rewards, groups) * torch.tensor(batch.weights)
    return shard_batch(batch, world_size, advantages=advantages)


def sft_stage(tmp_path: Path, model: Path, name: str, lora: dict | None = None,
              **trainer) -> Path:
    """An offline SFT stage directory, prepared as `rft-hpc run` prepares one (training a
    LoRA adapter with `lora`)."""
    from rft_hpc.config import load_config
    from rft_hpc.run.stages import prepare_model, prepare_stage

    settings = {"lr": 3e-4, "batch_size": 16, "steps": 4,
                "save_interval": 2, **trainer}
    path = write_config(tmp_path / f"{name}.yaml", model, lora=lora, mode="train",
                        data={"source": "tasks"}, trainer=settings,
                        algorithm={"algorithm_type": "sft"},
                        tasks={"type": "arithmetic", "digits": 1, "eval_size": 8},
                        eval={"interval": 2, "max_new_tokens": 3})
    config = prepare_model(load_config(path))
    folder = tmp_path / name
    prepare_stage(config, folder, None)
    return folder


def trainer_command(stage: Path) -> list[str]:
    """The command line of the trainer role of a prepared stage."""
    return [sys.executable, "-m", "rft_hpc.cli", "role", "trainer", str(stage)]
