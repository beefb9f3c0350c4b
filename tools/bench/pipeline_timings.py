#!/usr/bin/env python
"""The pipeline bench's (a): isolated timings of its batch shape, each in a child process.

    python tools/bench/pipeline_timings.py KIND --config BENCH.yaml --cpus 0,1 [--reps 15]

KIND is one of:

- `gen`: one explorer step's generation (`HFEngine.generate`, 8 tasks x 8 rollouts);
- `train`: one train step on such a batch (`Trainer.step`);
- `loop`: generate a step, then train on it, back to back in one thread (no sync, no
  files): the ceiling of any synchronous loop;
- `colocated`: the same two loops as `rft-hpc run` colocates them (`rft_hpc.colocate`),
  with nothing else: the explorer's loop in a thread of its own, the trainer's in the main
  one, every computation on one `DeviceThread`, each version handed to the engine through a
  `MemoryHandover`, each step's batch through a queue. What the colocated placement itself
  costs, without the buffer, ledger, metrics, heartbeats and log lines a run writes.

Prints `{"seconds": median seconds of a step}` as its last line (after two unmeasured
steps). `pipeline.py` runs it pinned to one core or to all, with one torch thread per core.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TASKS, REPEAT = 8, 8  # the demo's step: 8 tasks x 8 rollouts (a trainer batch of 64)
KINDS = ("gen", "train", "loop", "colocated")


def measure(kind: str, config_path: Path, cpus: list[int], reps: int = 15,
            idle: float = 0.0) -> float:
    """Median seconds of a `kind` step, in a child pinned to `cpus` with one torch thread
    per core (each step after `idle` seconds of sleep: gen and train only)."""
    cmd = [sys.executable, __file__, kind, "--config", str(config_path),
           "--cpus", ",".join(map(str, cpus)), "--reps", str(reps), "--idle", str(idle)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(len(cpus))))
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def batch_of(tasks: list, prompts: list, groups: list) -> Any:
    """A trainer batch of one explorer step's groups, with random 0/1 rewards."""
    import numpy as np

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.explorer.workflow import completion_to_experience

    rng = np.random.default_rng(0)
    records = [completion_to_experience(task, p, c, reward=float(rng.integers(2)),
                                        group_id=j, version=0, step=0)
               for j, (task, p, group) in enumerate(zip(tasks, prompts, groups, strict=False))
               for c in group]
    return Batch(records=records, weights=[1.0] * len(records), uses=[0] * len(records))


def _measure(kind: str, config_path: Path, reps: int, idle: float, threads: int) -> float:
    """Median seconds of `reps` steps of `kind` in this process (after two unmeasured)."""
    import torch

    from rft_hpc.config import load_config
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.tasks.source import build_tasks
    from rft_hpc.trainer.trainer import Trainer

    config = load_config(config_path)
    tasks, _ = build_tasks(config.tasks, 0)
    if kind == "colocated":
        return _colocated(config, tasks, reps, threads)
    torch.set_num_threads(threads)
    engine = HFEngine(config.model.path)
    prompts = [engine.prompt_ids(t) for t in tasks[:TASKS]]

    def generate(seed: int) -> list:
        return engine.generate(prompts, n=REPEAT, max_new_tokens=config.explorer.max_new_tokens,
                               temperature=1.0, seed=seed)

    trainer = Trainer(config) if kind != "gen" else None
    batch = batch_of(tasks, prompts, generate(0)) if kind == "train" else None

    def work(i: int) -> None:
        if trainer is None:
            generate(i)
        else:  # "loop": generate, then train on it (no sync, no files); "train": one batch
            trainer.step(batch if batch is not None else batch_of(tasks, prompts, generate(i)),
                         version=i)

    times = []
    for i in range(reps + 2):
        time.sleep(idle)
        t0 = time.perf_counter()
        work(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _colocated(config: Any, tasks: list, reps: int, threads: int) -> float:
    """`reps` + 2 strictly on-policy steps of the two colocated loops with nothing else:
    the median seconds between the trainer's handing over of consecutive versions."""
    import torch

    from rft_hpc.colocate.device import DeviceThread
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.sync.memory import MemoryHandover
    from rft_hpc.trainer.trainer import Trainer

    device = DeviceThread(threads)
    torch.set_num_threads(1)  # as in rft_hpc.colocate.role: the loops never start a team
    engine = device.call(HFEngine, config.model.path)
    trainer = device.call(Trainer, config)
    handover, batches = MemoryHandover(), queue.Queue()
    steps = reps + 2

    def explorer() -> None:
        torch.set_num_threads(1)
        for i in range(steps):
            if i:  # strictly on-policy: step i generates with version i, the one sent last
                while (got := handover.take()) is None:
                    handover.wait(1.0)
                version, weights = got
                device.call(engine.load_weights, weights, version)
                handover.give_back(weights)
            part = tasks[i * TASKS % len(tasks):][:TASKS]
            prompts = [engine.prompt_ids(t) for t in part]
            groups = device.call(engine.generate, prompts, n=REPEAT, temperature=1.0, seed=i,
                                 max_new_tokens=config.explorer.max_new_tokens)
            batches.put(batch_of(part, prompts, groups))

    thread = threading.Thread(target=explorer, daemon=True)
    thread.start()
    sent = []
    for i in range(steps):
        device.call(trainer.step, batches.get(), version=i)
        handover.send(device.call(trainer.full_state_dict), i + 1)
        sent.append(time.perf_counter())
    thread.join()
    device.close()
    return statistics.median(b - a for a, b in itertools.pairwise(sent[1:]))


def main() -> int:
    """Run one timing (`KIND`) and print its median step seconds as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--config", type=Path, required=True, help="the bench's config")
    ap.add_argument("--cpus", required=True, help="cores to pin to, e.g. 0,1")
    ap.add_argument("--reps", type=int, default=15, help="measured steps [15]")
    ap.add_argument("--idle", type=float, default=0.0, help="sleep before each step [0]")
    args = ap.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")]
    os.sched_setaffinity(0, cpus)
    print(json.dumps({"seconds": _measure(args.kind, args.config, args.reps, args.idle,
                                          len(cpus))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
