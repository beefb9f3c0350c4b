"""A plain `pip install` of the wheel, as a user on a cluster installs it: a fresh venv, the
CPU torch first (as tools/install.sh does on a machine without a GPU), then the wheel with
no extras, its dependencies resolved by pip. The demo's config, shrunk to a few steps of each
stage, runs to its end there. peft (the `lora` extra) is not installed: nothing outside
`model.lora` may need it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import DEMO, ROOT
from helpers.wheel import build_wheel, ok, sh

# every stage of the demo, shrunk to a few steps on a few tasks
FEW_STEPS = [
    "stages.0.trainer.steps=3", "stages.0.trainer.save_interval=3", "stages.0.eval.interval=3",
    "trainer.steps=3", "trainer.save_interval=3", "trainer.batch_size=32",
    "explorer.tasks_per_step=2", "tasks.eval_size=16", "eval.interval=3",
]


@pytest.mark.timeout(900)  # the install resolves every dependency from the package index
def test_a_plain_pip_install_without_extras_runs_the_demo(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    ok([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    # --no-compile: no .pyc files written ahead for torch's and transformers' thousands of
    # modules (half the install's time here); what is installed, and how, is the same
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    # the versions the suite passed with; a constraint adds no package of its own
    pins = [arg for name in ("constraints.txt", "constraints-cpu.txt")
            for arg in ("-c", ROOT / "tools" / name)]
    ok([*pip, f"torch=={torch.__version__}"], cwd=tmp_path, timeout=600)
    ok([*pip, *pins, wheel], cwd=tmp_path, timeout=600)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    shutil.copy2(DEMO, work / "configs" / "demo.yaml")
    no_peft = sh([venv / "bin" / "python", "-c", "import peft"], cwd=work, env=env)
    assert no_peft.returncode != 0 and "No module named 'peft'" in no_peft.stderr

    sets = [arg for pair in FEW_STEPS for arg in ("--set", pair)]
    ok([venv / "bin" / "rft-hpc", "run", "configs/demo.yaml", *sets], cwd=work, env=env,
       timeout=600)
    summary = json.loads((work / "runs" / "demo" / "summary.json").read_text())
    print(f"summary: {summary}")
    assert [(s["name"], s["trainer_steps"]) for s in summary["stages"]] == [
        ("sft", 3), ("grpo", 3)]
    assert summary["explorer"]["steps"] > 0
    assert (work / "runs" / "demo" / "report.png").is_file()
