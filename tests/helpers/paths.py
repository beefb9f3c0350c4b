"""Where things are: the checkout, the tests, the golden files, the demo config."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (the folder with pyproject.toml)."""
TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"
"""This package: the worker programs that tests run as scripts live here."""
GOLDEN = TESTS / "golden"
"""The rendered sbatch scripts that tests/cluster/test_slurm_launch.py compares against."""
DEMO = ROOT / "configs" / "demo.yaml"


def pythonpath() -> str:
    """PYTHONPATH for a child that runs a test file or a worker as a script: this checkout's
    rft_hpc and the `helpers` package (a script's own folder is all Python adds)."""
    return os.pathsep.join([str(ROOT), str(TESTS)])
