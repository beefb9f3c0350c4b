"""rft-hpc as a user installs it: a wheel, installed (not editable) into a new venv outside
the checkout, then the demo's commands run from a folder outside the checkout.

The new venv sees the test venv's site-packages through a `.pth` line (torch, transformers
... are not installed again), and the wheel is installed with --no-deps; the test checks
that `rft_hpc` and its sbatch templates are imported from the new venv, not the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers.paths import ROOT
from helpers.wheel import build_wheel, ok

TEMPLATES = "import importlib.resources as r; print(r.files('rft_hpc.slurm'))"

# The demo shrunk to one GRPO stage of 3 trainer steps on a few tasks.
THREE_STEPS = ["--set", "stages=[]", "--set", "trainer.steps=3", "--set", "trainer.batch_size=32",
               "--set", "explorer.tasks_per_step=2", "--set", "tasks.eval_size=16",
               "--set", "eval.interval=3"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding the wheel built from the checkout; its bin folder."""
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    venv = base / "venv"
    ok([sys.executable, "-m", "venv", "--without-pip", venv], cwd=base)
    python = venv / "bin" / "python"
    purelib = Path(ok([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                      cwd=base).stdout.strip())
    # a plain path line: the test venv's own .pth files (its editable rft_hpc finder among
    # them) are not run in the new venv
    seen = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib / "test-venv.pth").write_text("".join(f"{p}\n" for p in sorted(seen)))
    ok([python, "-m", "pip", "install", "--no-deps", "--no-index",
        "--disable-pip-version-check", wheel], cwd=base)
    return venv / "bin"


@pytest.mark.timeout(480)  # ~100 s here under a load of 10 on 2 cores; CI runs slower
def test_the_wheel_installed_outside_the_checkout_runs_the_demo(
        installed: Path, slurm_env: dict[str, str], tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    config = work / "configs" / "demo.yaml"
    shutil.copy2(ROOT / "configs" / "demo.yaml", config)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{installed}{os.pathsep}{env['PATH']}"
    python = installed / "python"
    purelib = Path(ok([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                      cwd=work, env=env).stdout.strip())

    package = Path(ok([python, "-c", "import rft_hpc; print(rft_hpc.__file__)"], cwd=work,
                      env=env).stdout.strip())
    print(f"rft_hpc imported from {package}")
    assert package == purelib / "rft_hpc" / "__init__.py"
    assert not package.is_relative_to(ROOT)

    rft = installed / "rft-hpc"
    ok([rft, "model", "init", "tiny", "--out", "runs/models/tiny"], cwd=work, env=env)
    assert (work / "runs" / "models" / "tiny" / "config.json").is_file()
    assert "OK: configs/demo.yaml" in ok([rft, "validate", "configs/demo.yaml"], cwd=work,
                                         env=env).stdout

    ok([rft, "render", "configs/demo.yaml", "--set", "run.root=rendered", "--out", "scripts"],
        cwd=work, env=env)
    scripts = sorted(p.name for p in (work / "scripts").iterdir())
    assert "submit.sh" in scripts and "sft.trainer.sbatch" in scripts, scripts
    trainer_script = (work / "scripts" / "sft.trainer.sbatch").read_text()
    assert f"{python} -m rft_hpc.cli role trainer" in trainer_script

    cluster_env = {**env, **slurm_env}
    dry = ok([rft, "submit", "configs/demo.yaml", "--set", "run.root=submitted",
              "--dry-run"], cwd=work, env=cluster_env)
    assert "dry run: " in dry.stdout and "nothing was submitted" in dry.stdout
    assert "#SBATCH --job-name=demo.sft.trainer" in dry.stdout
    assert not (work / "submitted").exists()

    templates = Path(ok([python, "-c", TEMPLATES], cwd=work, env=env).stdout.strip())
    print(f"sbatch templates loaded from {templates}")
    assert templates == purelib / "rft_hpc" / "slurm"
    assert (templates / "role.sbatch").read_text() == (ROOT / "slurm" / "role.sbatch").read_text()

    ok([rft, "run", "configs/demo.yaml", *THREE_STEPS], cwd=work, env=env, timeout=600)
    summary = json.loads((work / "runs" / "demo" / "summary.json").read_text())
    print(f"summary: trainer {summary['trainer']}, eval {summary['eval']}")
    assert summary["trainer"]["steps"] == 3
