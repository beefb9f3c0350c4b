"""`rft-hpc` as a separate process on this machine, and the demo shrunk to seconds of work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.paths import ROOT
from rft_hpc.buffer.jsonl import iter_segments
from rft_hpc.buffer.segment import read_segment
from rft_hpc.monitor.metrics import read_metrics

EVALUATOR = ("--set", "stages.1.eval.evaluator=true", "--set", "stages.1.eval.every=3")
"""Overrides that score the demo's grpo stage with an evaluator array every 3 versions."""


def short(tmp_path: Path, model: Path, *extra: str) -> list[str]:
    """Overrides that shrink the demo to a few seconds of work in `tmp_path`."""
    return ["--set", f"run.root={tmp_path}", "--set", f"model.path={model}",
            "--set", "tasks.eval_size=64", "--set", "stages.0.trainer.steps=8",
            "--set", "stages.0.eval.interval=4", "--set", "trainer.steps=6",
            "--set", "eval.interval=3", "--set", "explorer.tasks_per_step=2",
            "--set", "trainer.batch_size=32", *extra]


def rft(*args: object, **kwargs) -> subprocess.CompletedProcess[str]:
    """The CLI as a separate process, run from the checkout; output captured as text."""
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, **kwargs)


def rollouts(stage: Path) -> list:
    """Every record in a stage's buffer, in segment order."""
    return [r for _, p in iter_segments(stage / "buffer") for r in read_segment(p).records()]


def scores_match_trainer(summary: dict, stage: Path, versions: list[int]) -> bool:
    """The evaluator's scores in summary.json are the trainer's evaluations at the same
    steps (same weights, same greedy decoding of the same eval tasks)."""
    scores = {r["version"]: r["accuracy"] for r in summary["evaluator"]}
    evals = {r["step"]: r["eval_accuracy"] for r in read_metrics(stage / "metrics" /
                                                                 "trainer.jsonl")
             if r.get("eval_accuracy") is not None}
    assert sorted(scores) == versions, summary["evaluator"]
    assert scores == {v: evals[v] for v in versions}, (scores, evals)
    return True
