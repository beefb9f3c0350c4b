"""Where the evaluator leaves its scores, and reading them back (no torch needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rft_hpc.core.retry import PROCESS_RETRY
from rft_hpc.core.rundir import RunDir, read_json, weights_folder_name

EVAL_RESULT_VERSION = 1
"""Version of the `eval/v<NNNNNN>.json` files (docs/run-directory.md)."""


def result_path(run: RunDir, version: int) -> Path:
    """Where the evaluator leaves the score of weights version `version` of a stage."""
    return run.eval / f"{weights_folder_name(version)}.json"


def evaluation_results(run: RunDir) -> list[dict[str, Any]]:
    """Every score the evaluator left in a stage directory, by weights version (one
    listing of `eval/`, with retries: `core.retry`)."""
    try:
        names = PROCESS_RETRY.read("eval folder", run.eval, lambda: os.listdir(run.eval))
    except FileNotFoundError:
        return []
    found = [read_json(run.eval / n) for n in names
             if n.startswith("v") and n.endswith(".json")]
    return sorted(found, key=lambda r: r["version"])
