#!/usr/bin/env python
"""Benchmark LoRA training (`model.lora`) against whole-model training, in one run.

    python tools/bench/lora.py [--dir DIR] [--hidden 640] [--layers 16] [--steps 5] [--rounds 2]

Builds a Llama of the given shape locally (random weights, character vocabulary: ~80 M
parameters at the defaults, large enough that the weights, not Python, dominate on a CPU),
then for each mode, whole model and LoRA (rank 8, all linear layers), in a fresh process:

1. trainer peak memory: the process's peak RSS (`ru_maxrss`) after building the trainer
   (`rft_hpc.trainer.trainer.Trainer`, AdamW) and taking the GRPO steps, less its RSS after
   the imports (what the interpreter, torch and transformers take in either mode);
2. step time: the median of `--steps` GRPO steps (after one untimed step) on a fixed batch
   of 4 rollouts of 32 tokens, on `--threads` threads;
3. bytes per published version: the files `publish_weights` writes for the version (what
   the trainer publishes: the whole state dict, or the adapter and its config);
4. sync seconds: median of three `publish_weights` (written and fsynced) + `load_weights`
   (read back with checksums) + `HFEngine.load_weights` (applied to an explorer's engine:
   the whole model's weights copied in, or the adapter set through peft).

The modes alternate for `--rounds` rounds (whole, adapter, whole, adapter, ...), so that a
busy host's drift hits both alike; each figure is the median over the rounds. It prints the
figures of both modes and the ratios (adapter / whole).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LORA = {"rank": 8, "alpha": 16}


def _rss_mb() -> float:
    """This process's resident memory now (MB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def worker(mode: str, model: Path, folder: Path, steps: int, threads: int) -> dict:
    """One mode's figures (run in a process of its own: peak RSS only ever grows)."""
    import numpy as np
    import torch
    import yaml

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import Experience
    from rft_hpc.config import load_config
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.sync.publisher import WeightPublisher
    from rft_hpc.sync.weight_files import load_weights, version_dir
    from rft_hpc.trainer.trainer import Trainer

    torch.set_num_threads(threads)
    base_rss = _rss_mb()
    data = {"run": {"root": str(folder), "seed": 0}, "model": {"path": str(model)},
            "trainer": {"lr": 1e-4, "batch_size": 4}, "algorithm": {"algorithm_type": "grpo"}}
    if mode == "lora":
        data["model"]["lora"] = LORA
    (folder / f"{mode}.yaml").write_text(yaml.safe_dump(data))
    config = load_config(folder / f"{mode}.yaml")
    trainer = Trainer(config)
    rng = np.random.default_rng(0)
    records = [Experience(rng.integers(4, 20, 32), prompt_length=8, reward=float(i % 2),
                          group_id=0, logprobs=np.full(32, -3.0, dtype=np.float32))
               for i in range(4)]
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        trainer.step(Batch(records=list(records), weights=[1.0] * 4, uses=[0] * 4))
        if i:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state = trainer.full_state_dict()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    del trainer
    engine = HFEngine(model, lora=config.model.lora)
    run = RunDir(folder / f"run-{mode}")
    syncs, nbytes = [], 0
    for version in (1, 2, 3):
        t0 = time.perf_counter()
        WeightPublisher(config, run).write_files(state, version)
        engine.load_weights(load_weights(run.weights, version), version)
        syncs.append(time.perf_counter() - t0)
        nbytes = sum(f.stat().st_size for f in version_dir(run.weights, version).iterdir())
    return {"mode": mode, "parameters": total, "trained_parameters": trained,
            "peak_rss_mb": peak, "base_rss_mb": base_rss, "trainer_mb": peak - base_rss,
            "step_seconds": _median(times), "bytes_per_version": nbytes,
            "sync_seconds": _median(syncs)}


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """A character-level Llama of `layers` blocks of width `hidden` (MLP 2.7x)."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    spec = TinyModelSpec(hidden_size=hidden, intermediate_size=hidden * 27 // 10,
                         num_layers=layers, num_heads=hidden // 64)
    return init_tiny_model(folder / "model", spec)


def main() -> None:
    """Build the model, run both modes in their own processes, print figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a "
                        "temporary one)")
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="rft-bench-lora-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.worker:
        mode, model = args.worker
        print(json.dumps(worker(mode, Path(model), folder, args.steps, args.threads)))
        return
    try:
        model = build_model(folder, args.hidden, args.layers)
        rounds: dict[str, list[dict]] = {"full": [], "lora": []}
        for _ in range(args.rounds):
            for mode in rounds:
                out = subprocess.run([sys.executable, __file__, "--dir", str(folder), "--steps",
                                      str(args.steps), "--threads", str(args.threads),
                                      "--worker", mode, str(model)], cwd=ROOT, text=True,
                                     capture_output=True, check=False)
                if out.returncode:
                    sys.exit(f"the {mode} worker failed:\n{out.stderr[-3000:]}")
                rounds[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(folder / f"run-{mode}", ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    results = {mode: {k: _median([r[k] for r in runs]) if isinstance(runs[0][k], float)
                      else runs[0][k] for k in runs[0]} for mode, runs in rounds.items()}
    full, lora = results["full"], results["lora"]
    print(f"model: {full['parameters'] / 1e6:.1f} M parameters; LoRA rank {LORA['rank']} "
          f"trains {lora['trained_parameters'] / 1e6:.2f} M "
          f"({lora['trained_parameters'] / full['parameters']:.2%})")
    rows = [("bytes per published version", "bytes_per_version", "{:,.0f}"),
            ("sync seconds (publish + load + apply)", "sync_seconds", "{:.3f}"),
            ("trainer peak memory, MB (peak RSS - RSS after imports)", "trainer_mb", "{:.0f}"),
            ("process peak RSS, MB", "peak_rss_mb", "{:.0f}"),
            ("step seconds (median)", "step_seconds", "{:.3f}")]
    print(f"{'figure':58s} {'whole':>14s} {'adapter':>14s} {'adapter/whole':>14s}")
    for label, key, fmt in rows:
        print(f"{label:58s} {fmt.format(full[key]):>14s} {fmt.format(lora[key]):>14s} "
              f"{lora[key] / full[key]:>14.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
