"""The seed and thread count of the suite's learning tests, and the overrides that pin them.

A learning test must pass at every seed and with one or two threads per role, not at the one
the suite runs (seed 0, one thread): `RFT_LEARN_SEED` and `RFT_LEARN_THREADS` run another by
hand (`tools/learning_table.py` runs them all and prints the table). Threads are pinned
because float order alone moves where a warm-up ends, and a test worker's share of the cores
(`RFT_HPC_CORES`) would otherwise choose them.
"""

from __future__ import annotations

import json
import os

SEED = int(os.environ.get("RFT_LEARN_SEED", "0"))
"""Seed of the run, its data and its tiny model's initial weights (0 in the suite)."""
THREADS = int(os.environ.get("RFT_LEARN_THREADS", "1"))
"""CPU threads of every role (1 in the suite)."""


def pinned(trainer_stages: int = 0) -> tuple[str, ...]:
    """`key=value` overrides that set the run's seed and every role's threads: the top-level
    trainer and explorer, and the trainer of each of the first `trainer_stages` stages (those
    whose stage block has a trainer of its own)."""
    stages = tuple(f"stages.{i}.trainer.threads={THREADS}" for i in range(trainer_stages))
    return (f"run.seed={SEED}", *stages, f"trainer.threads={THREADS}",
            f"explorer.threads={THREADS}")


def record(test: str, **figures: float | int | str) -> None:
    """Append one learning test's figures (accuracies, p-values) to the JSON-lines file that
    `RFT_LEARN_RECORD` names, with the seed and threads; nothing without it. The table
    tools/learning_table.py prints is made of these."""
    path = os.environ.get("RFT_LEARN_RECORD")
    if path:
        row = {"test": test, "seed": SEED, "threads": THREADS, **figures}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
