"""The example configs that no other test runs, run shrunk to a few steps as `rft-hpc run`
runs them: the SFT warm-up (configs/sft.yaml) and SFT-then-DPO (configs/dpo.yaml). The others
run elsewhere: demo and the RL algorithms in test_rl_algorithms_learn.py, pipeline.yaml in
test_pipeline_run.py, multiturn.yaml in test_multiturn.py, the CPU recipes in
test_real_workload.py, test_tool_recipe.py and test_rlhf_recipe.py. The GPU recipes cannot
run here: they are validated and rendered."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.paths import ROOT
from helpers.runs import rft

from rft_hpc.core.rundir import read_jsonl

SHRUNK = {
    # config -> (overrides, {stage folder: trainer steps})
    "sft.yaml": (("trainer.steps=4", "trainer.save_interval=4"), {"0-main": 4}),
    "dpo.yaml": (("stages.0.trainer.steps=4", "stages.0.trainer.save_interval=4",
                  "stages.1.trainer.steps=3", "stages.1.trainer.save_interval=3"),
                 {"0-sft": 4, "1-dpo": 3}),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", list(SHRUNK))
def test_an_example_config_runs_shrunk(tmp_path: Path, config: str) -> None:
    overrides, stages = SHRUNK[config]
    sets = (f"run.root={tmp_path}", f"model.path={tmp_path}/models/tiny",
            "tasks.eval_size=16", "eval.interval=2", *overrides)
    result = rft("run", ROOT / "configs" / config, *[a for s in sets for a in ("--set", s)],
                 timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    run = next(p.parent for p in tmp_path.glob("*/summary.json"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer"]["steps"] == sum(stages.values()), summary["trainer"]
    for folder, steps in stages.items():
        trained = [m for m in read_jsonl(run / "stages" / folder / "metrics" / "trainer.jsonl")
                   if "loss" in m]
        assert len(trained) == steps, (folder, trained)
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gpu_recipe_validates_and_renders_with_its_paths_set(tmp_path: Path) -> None:
    """configs/recipes/gsm8k-gpu.yaml cannot run here (GPUs); with MODEL_DIR, DATA_DIR and
    RUN_ROOT pointing at a tiny Qwen2 chat model and word problems in GSM8K's layout it
    validates (its data read) and renders every role's sbatch script."""
    env = {**os.environ, "MODEL_DIR": str(tmp_path / "model"),
           "DATA_DIR": str(tmp_path / "data"), "RUN_ROOT": str(tmp_path / "runs")}
    steps = (("model", "init", "tiny", "--arch", "qwen2", "--chat", "--out", env["MODEL_DIR"]),
             ("data", "wordproblems", "--out", env["DATA_DIR"], "--train", "200",
              "--test", "50"),
             ("validate", "configs/recipes/gsm8k-gpu.yaml"),
             ("render", "configs/recipes/gsm8k-gpu.yaml", "--out", str(tmp_path / "scripts")))
    for args in steps:
        result = rft(*args, env=env, timeout=300)
        assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-2000:])
    scripts = sorted(p.name for p in (tmp_path / "scripts").iterdir())
    assert "submit.sh" in scripts and any("explorer" in s for s in scripts) \
        and any("trainer" in s for s in scripts), scripts


def test_the_gpu_tool_recipe_validates_and_renders_with_its_paths_set(tmp_path: Path) -> None:
    """configs/recipes/tools-gpu.yaml cannot run here (GPUs); with MODEL_DIR and RUN_ROOT
    pointing at a tiny Qwen2 chat model (whose template takes tools) it validates and
    renders every role's sbatch script, the SFT stage's trainer included."""
    env = {**os.environ, "MODEL_DIR": str(tmp_path / "model"),
           "RUN_ROOT": str(tmp_path / "runs")}
    steps = (("model", "init", "tiny", "--arch", "qwen2", "--out", env["MODEL_DIR"]),
             ("validate", "configs/recipes/tools-gpu.yaml"),
             # 200 demonstrations, not the recipe's 20,000 (the stage's data is prepared)
             ("render", "configs/recipes/tools-gpu.yaml", "--out", str(tmp_path / "scripts"),
              "--set", "tasks.train_size=200"))
    for args in steps:
        result = rft(*args, env=env, timeout=300)
        assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-2000:])
    scripts = sorted(p.name for p in (tmp_path / "scripts").iterdir())
    assert "submit.sh" in scripts and any("sft" in s and "trainer" in s for s in scripts) \
        and any("explorer" in s for s in scripts), scripts


def test_the_gpu_rlhf_recipe_validates_and_renders_with_its_paths_set(tmp_path: Path) -> None:
    """configs/recipes/rlhf-gpu.yaml cannot run here (GPUs); with MODEL_DIR at a tiny Qwen2
    chat model, DATA_DIR at comparisons in WebGPT's layout (generated) and RUN_ROOT, it
    validates and renders every job: the reward-model stage's trainer, the GRPO stage's
    explorers, trainer and reward job array with its own Slurm settings."""
    from rft_hpc.tasks.preferences import write_preference_file

    env = {**os.environ, "MODEL_DIR": str(tmp_path / "model"),
           "DATA_DIR": str(tmp_path / "data"), "RUN_ROOT": str(tmp_path / "runs")}
    (tmp_path / "data").mkdir()
    write_preference_file(tmp_path / "data" / "comparisons.parquet", 2000)
    # 2000 comparisons, not the recipe's 19500 rows (the stages' data are read and prepared)
    small = [a for key, value in (("tasks.rows", "[0, 1000]"), ("tasks.eval_rows", "[1000, 1100]"),
                                  ("stages.0.data.rows", "[0, 1800]"),
                                  ("stages.0.data.eval_rows", "[1800, 2000]"))
             for a in ("--set", f"{key}={value}")]
    steps = (("model", "init", "tiny", "--arch", "qwen2", "--out", env["MODEL_DIR"]),
             ("validate", "configs/recipes/rlhf-gpu.yaml", *small),
             ("render", "configs/recipes/rlhf-gpu.yaml", "--out", str(tmp_path / "scripts"),
              *small))
    for args in steps:
        result = rft(*args, env=env, timeout=300)
        assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-2000:])
    scripts = sorted(p.name for p in (tmp_path / "scripts").iterdir())
    assert {"rm.trainer.sbatch", "grpo.explorer.sbatch", "grpo.trainer.sbatch",
            "grpo.reward.sbatch", "submit.sh"} <= set(scripts), scripts
    reward = (tmp_path / "scripts" / "grpo.reward.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=1" in reward and "#SBATCH --array=0-0" in reward
