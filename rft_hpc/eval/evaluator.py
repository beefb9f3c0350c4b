"""The evaluator role: score one weights version of a finished stage on its eval task set,
by each task's own reward, on the explorers' engine (vLLM where they use it).

Evaluator task `i` of a stage scores version `eval.scored_versions(trainer.steps)[i]`
(version 0: the stage's starting weights) and writes `eval/v<NNNNNN>.json`. The result file
is written last and atomically, so a requeued or repeated task either finds it and returns,
or scores again from scratch: the same array runs under Slurm and as local processes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, atomic_write_json, make_dirs, read_json
from rft_hpc.engines import build_engine
from rft_hpc.eval.results import EVAL_RESULT_VERSION, result_path
from rft_hpc.eval.scoring import heldout_scores
from rft_hpc.eval.tool_trajectories import plays_tools, tool_task_scores
from rft_hpc.runtime.common import final_heartbeat, load_stage, set_threads, write_heartbeat
from rft_hpc.runtime.logs import at_step, setup_logging, step_line
from rft_hpc.sync.weight_files import load_start_weights, load_weights
from rft_hpc.tasks.source import build_tasks

log = logging.getLogger(__name__)


def run_evaluator(stage_dir: Path, index: int) -> dict[str, Any]:
    """Score the weights version of evaluator task `index` (once; a rerun returns the result
    already written). Its one step is the scoring: one log line, heartbeat step 0/1 -> 1/1."""
    setup_logging(f"evaluator-{index}")
    config, run = load_stage(stage_dir)
    versions = config.eval.scored_versions(config.trainer.steps)
    if not 0 <= index < len(versions):
        raise UserError(f"evaluator task {index} does not exist: stage {run.root.name} scores "
                        f"{len(versions)} weights versions ({versions})")
    version = versions[index]
    if index == len(versions) - 1:  # the last weights, even where training ended early
        version = _final_version(run) or version
    out = result_path(run, version)
    role = f"evaluator-{index}"
    if out.exists():
        write_heartbeat(run, role, status="done", step=1, total=1, version=version)
        log.info("weights v%d were scored already: %s", version, out)
        return read_json(out)
    set_threads(config.trainer.threads)
    started = time.time()
    write_heartbeat(run, role, status="running", step=0, total=1, version=version,
                    started=started, start_step=0)
    at_step(1)
    t0 = time.monotonic()
    engine = build_engine(config)  # the explorers' engine: vLLM where they use it
    try:
        if version == 0:
            load_start_weights(engine, config)
        else:
            engine.load_weights(load_weights(run.weights, version), version)
        _, tasks = build_tasks(config.tasks, config.run.seed)
        scores = tool_task_scores(engine, tasks, config) if plays_tools(config) \
            else heldout_scores(engine, tasks, config.eval,
                                temperature=config.explorer.temperature, seed=config.run.seed)
    finally:  # also when it fails: a vLLM engine's workers would hold the process
        if hasattr(engine, "close"):
            engine.close()
    accuracy = scores.pop("eval_accuracy")
    result = {"format_version": EVAL_RESULT_VERSION, "version": version,
              "taskset": "eval", "metric": "reward", "accuracy": accuracy,
              **{key.removeprefix("eval_"): value for key, value in scores.items()},
              "tasks": len(tasks), "seconds": round(time.monotonic() - t0, 3)}
    make_dirs(run.eval)
    atomic_write_json(out, result)
    at_step(None)
    write_heartbeat(run, role, status="done", step=1, total=1, version=version,
                    started=started, start_step=0)
    log.info(step_line(1, 1, version=version, reward=accuracy, seconds=result["seconds"],
                       tasks=len(tasks)))
    return result


def _final_version(run: RunDir) -> int | None:
    """The last version the (finished) trainer published, from its final heartbeat."""
    version = final_heartbeat(run, "trainer").get("final_version")
    return int(version) if isinstance(version, int) else None
