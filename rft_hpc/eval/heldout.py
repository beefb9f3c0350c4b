"""The trainer's held-out evaluation: the stage's eval split and each task set's eval split
(`pipeline.tasksets`), scored by `score_tasks` on an engine built for evaluation.

The engine is a whole replica of the configured model that the evaluation builds at its
first use and keeps; each evaluation loads the weights it is given (the trainer's current
weights, under a sharded trainer gathered from every rank) into it with `load_weights`.
The model being trained is never generated from: evaluation neither changes its mode nor
depends on how the trainer holds it (a replica, FSDP or megatron-core shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import write_jsonl
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.eval.scoring import heldout_scores
from rft_hpc.eval.tool_trajectories import plays_tools, tool_task_scores
from rft_hpc.sync.weight_files import load_start_weights
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def taskset_eval_tasks(config: ExperimentConfig) -> dict[str, list[Task]]:
    """name -> eval split of each task set that has one (empty without `tasksets`)."""
    out = {}
    for ts in config.pipeline.tasksets:
        _, held_out = build_tasks(ts.tasks, config.run.seed)
        if held_out:
            out[ts.name] = held_out
    return out


def evaluation_engine(config: ExperimentConfig, device: torch.device) -> HFEngine:
    """An engine on a whole HF replica of the configured model on `device` (eval mode), in
    the stage's prompt format, to load weights into. With `model.lora` the replica holds the
    stage's start weights and an adapter, into which the trainer's adapter weights load."""
    tokenizer, model = load_policy(config.model.path, config.model.dtype)
    engine = HFEngine(model=model.to(device).eval(), tokenizer=tokenizer, device=str(device),
                      prompt=config.prompt, lora=config.model.lora)
    if config.model.lora is not None:
        load_start_weights(engine, config)
        engine.enable_lora()
        engine.model.eval()
    return engine


class HeldOutEvaluation:
    """Scores weights on the stage's eval split (`eval_accuracy`, `eval_reward`, ...) and
    on each task set's (`taskset/<name>/eval_accuracy`, ...), with the `eval` settings: one
    greedy answer per task, or with tools the workflow played greedily
    (`eval.tool_trajectories`)."""

    def __init__(self, config: ExperimentConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        _, self.tasks = build_tasks(config.tasks, config.run.seed)
        self.tasksets = taskset_eval_tasks(config)
        self._engine: HFEngine | None = None

    @property
    def enabled(self) -> bool:
        """True when the stage has an eval split: only then does the trainer evaluate."""
        return bool(self.tasks)

    def score(self, weights: Mapping[str, torch.Tensor], version: int,
              answers: Path) -> dict[str, float]:
        """The held-out scores of `weights` (a full state dict as the trainer publishes it:
        a whole model's, or with `model.lora` the adapter's), and each task set's under its
        `taskset/<name>/` prefix; each eval task's greedy answer and reward are written to
        `answers` (JSONL, in task order). The same weights score the same (greedy
        decoding; the `eval.k` samples are seeded by `run.seed`)."""
        if self._engine is None:
            self._engine = evaluation_engine(self.config, self.device)
        self._engine.load_weights(weights, version)
        rows: list[dict[str, Any]] = []
        scores = self._scores(self.tasks, rows)
        write_jsonl(answers, rows)
        for name, tasks in self.tasksets.items():
            scores.update({f"taskset/{name}/{key}": value
                           for key, value in self._scores(tasks).items()})
        return scores

    def _scores(self, tasks: list[Task], answers: list[dict[str, Any]] | None = None,
                ) -> dict[str, float]:
        assert self._engine is not None
        if plays_tools(self.config):
            return tool_task_scores(self._engine, tasks, self.config, answers)
        return heldout_scores(self._engine, tasks, self.config.eval,
                              temperature=self.config.explorer.temperature,
                              seed=self.config.run.seed, answers=answers)
