#!/usr/bin/env python
"""Benchmark over-rollout: explorer step time with a few 10x slower tasks, in one run.

    python tools/bench/over_rollout.py [--steps 3] [--tasks 8] [--slow 2] [--factor 10]

Each explorer step runs `--tasks` multi-turn guessing-game tasks (tiny model, HF engine,
`--repeat` trajectories each, environments in worker processes) whose environment calls
sleep `--sleep` s, except `--slow` of them that sleep `--factor` times longer. Three
explorers take turns, step by step (so that the machine's speed drift hits all three):

- `on`: over-rollout on (ratio = fast tasks / tasks, stragglers dropped), all tasks;
- `fast`: the fast tasks only, over-rollout off: the time over-rollout should approach;
- `off`: over-rollout off, all tasks: every step waits for the slow tasks.

A first, unmeasured step warms up (the fork server of the environment workers, the model).
It prints the median step time of each and the ratios on/fast and off/fast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rft_hpc.envs.faulty import is_bad
from rft_hpc.tasks.task import Task

EVERY = 4  # FaultyGuess picks a task as slow when crc32(id) + 2 is a multiple of this


def pick_tasks(steps: int, n: int, slow: int) -> list[tuple[list[Task], list[Task]]]:
    """Per step: (all tasks, the fast ones), with exactly `slow` slow tasks in each."""
    out, i = [], 0
    for _ in range(steps):
        fast: list[Task] = []
        slow_tasks: list[Task] = []
        while len(fast) < n - slow or len(slow_tasks) < slow:
            task = Task(task_id=f"g{i}", prompt="", answer=str(i))
            i += 1
            bad = is_bad(task.task_id, "slow", EVERY)
            if bad and len(slow_tasks) < slow:
                slow_tasks.append(task)
            elif not bad and len(fast) < n - slow:
                fast.append(task)
        out.append((fast + slow_tasks, fast))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--slow", type=int, default=2)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    # Heavy imports here, not at the top: the environment workers' fork server re-imports
    # this script (its __main__) in every worker.
    import torch

    from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.explorer.multiturn import SerialEngine, TurnSettings
    from rft_hpc.explorer.overrollout import MultiTurnExplorer
    from rft_hpc.models.tiny import init_tiny_model

    torch.set_num_threads(1)  # as an explorer role does (explorer.threads)

    with tempfile.TemporaryDirectory() as tmp:
        engine = SerialEngine(HFEngine(init_tiny_model(Path(tmp) / "tiny")))
        workflow = MultiTurnWorkflow(
            env="rft_hpc.envs.faulty:FaultyGuess", max_turns=args.turns, max_timeout=600,
            env_args={"sleep": args.sleep, "slow_every": EVERY, "slow_factor": args.factor})
        turn = TurnSettings(args.repeat, 2, 1.0)
        ratio = (args.tasks - args.slow) / args.tasks
        explorers = {
            "on": MultiTurnExplorer(engine, workflow, turn, OverRolloutConfig(ratio=ratio)),
            "fast": MultiTurnExplorer(engine, workflow, turn, OverRolloutConfig()),
            "off": MultiTurnExplorer(engine, workflow, turn, OverRolloutConfig()),
        }
        times: dict[str, list[float]] = {name: [] for name in explorers}
        dropped = 0.0
        for step, (everything, fast) in enumerate(pick_tasks(args.steps + 1, args.tasks,
                                                             args.slow)):
            for name, mt in explorers.items():
                if step == 0:  # warm-up
                    mt.run_step(fast[:1], first_group_id=0, step=0, seed=0)
                    continue
                t0 = time.monotonic()
                _, metrics = mt.run_step(fast if name == "fast" else everything,
                                         first_group_id=step * args.tasks, step=step, seed=step)
                times[name].append(time.monotonic() - t0)
                dropped += metrics["over_rollout/dropped"] if name == "on" else 0.0
                time.sleep(0.2)  # let cancelled stragglers' workers go
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {"median_seconds": median, "seconds": times, "dropped_tasks": dropped,
              "on_over_fast": median["on"] / median["fast"],
              "off_over_fast": median["off"] / median["fast"], "settings": vars(args)}
    print(json.dumps(result))
    print(f"step time: over-rollout on {median['on']:.2f} s, fast tasks only "
          f"{median['fast']:.2f} s, over-rollout off {median['off']:.2f} s")
    print(f"on / fast = {result['on_over_fast']:.2f}   off / fast = "
          f"{result['off_over_fast']:.2f}   ({dropped:.0f} slow tasks dropped)")


if __name__ == "__main__":
    main()
