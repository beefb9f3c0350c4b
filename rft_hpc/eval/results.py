"""Where the evaluator leaves its scores, and reading them back (no torch needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rft_hpc.core.rundir import RunDir, read_json, weights_folder_name

EVAL_RESULT_VERSION = 1
"""Version of the `eval/v<NNNNNN>.json` files (docs/run-directory.md)."""


def result_path(run: RunDir, version: int) -> Path:
    """Where the evaluator leaves the score of weights version `version` of a stage."""
    return run.eval / f"{weights_folder_name(version)}.json"


def evaluation_results(run: RunDir) -> list[dict[str, Any]]:
    """Every score the evaluator left in a stage directory, by weights version."""
    if not run.eval.exists():
        return []
    return sorted((read_json(p) for p in run.eval.glob("v*.json")), key=lambda r: r["version"])
