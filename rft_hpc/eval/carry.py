"""Held-out scores carried from one stage to the next.

A stage that starts from the previous stage's final weights would begin by scoring those
weights on the held-out split again, which that stage's last evaluation just did. When both
stages evaluate the same way (the same model, tasks, prompt format, eval settings, sampling
temperature and seed: what the scores depend on), the new stage's step-0 scores and greedy
answers are copied from the previous stage instead of decoding the held-out split again.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.core.rundir import RunDir, make_dirs
from rft_hpc.monitor.metrics import read_metrics

log = logging.getLogger(__name__)

EVAL_EXCLUDED = {"interval", "evaluator", "every"}
"""Eval settings that say when or by whom the held-out split is scored, not how."""


def evaluation_identity(config: ExperimentConfig) -> dict[str, Any]:
    """What a stage's held-out scores of given weights depend on."""
    return {"model": config.model.model_dump(mode="json", exclude={"start_weights"}),
            "tasks": config.tasks.model_dump(mode="json"),
            "prompt": config.prompt.model_dump(mode="json"),
            "eval": config.eval.model_dump(mode="json", exclude=EVAL_EXCLUDED),
            "temperature": config.explorer.temperature, "seed": config.run.seed,
            # a reward model is scored on held-out pairs, a policy on held-out tasks
            "pairs": config.data.model_dump(mode="json")
            if config.algorithm.algorithm_type == "reward_model" and config.data else None}


def carried_scores(config: ExperimentConfig, run: RunDir) -> dict[str, float] | None:
    """The previous stage's held-out scores of this stage's starting weights, with their
    greedy answers copied to this stage's `eval/answers/v000000.jsonl`; None when the stage
    starts from a model folder, the previous stage evaluated differently or did not score
    those weights (then the caller evaluates them)."""
    start = config.model.start_weights
    if start is None:
        return None
    start = Path(start)
    previous = RunDir(start.parent.parent)
    version = int(start.name[1:])
    answers = previous.heldout_answers(version)
    if not (previous.config.exists() and answers.exists()):
        return None
    if evaluation_identity(load_config(previous.config)) != evaluation_identity(config):
        return None
    rows = [r for r in read_metrics(previous.metrics_file("trainer"))
            if r.get("step") == version and "eval_accuracy" in r]
    if not rows:
        return None
    target = run.heldout_answers(0)
    make_dirs(target.parent)
    shutil.copyfile(answers, target)
    log.info("held-out scores of the starting weights carried from %s (version %d)",
             previous.root.name, version)
    return {k: v for k, v in rows[-1].items() if k.startswith("eval_")}
