"""Filesystem faults for tests: `injector` (schedules, wrapped calls) and the
`sitecustomize` preload that installs a schedule in processes started with this folder on
their PYTHONPATH; `environment` builds that environment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers.faults.injector import ENV

FOLDER = Path(__file__).resolve().parent


def environment(schedule: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that runs under `schedule`: `base` (default: this
    process's) with this folder first on PYTHONPATH and the schedule in RFT_TEST_FAULTS."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FOLDER), env.get("PYTHONPATH")) if p)
    env[ENV] = json.dumps(schedule)
    return env
