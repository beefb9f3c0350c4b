"""tools/device/check_all.py on CPUs: the summary, $OUT/summary.json and a check's time limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_summary_and_a_check_killed_at_its_limit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/device/check_all.py"), "--cpu",
         "--only", "environment,torch_trainer_bf16,nccl", "--limit", "torch_trainer_bf16=2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "OUT": str(out)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    assert json.loads((out / "summary.json").read_text()) == printed
    assert printed["mode"] == "cpu" and printed["setup"]["missing"] == []
    assert printed["setup"]["install"].startswith("already installed")
    checks = printed["checks"]
    assert list(checks) == ["environment", "nccl", "torch_trainer_bf16"]
    assert checks["environment"]["status"] == "ok"
    assert checks["environment"]["figures"]["python"] == sys.version.split()[0]
    assert checks["nccl"]["status"] == "skipped" and "CUDA" in checks["nccl"]["reason"]
    trainer = checks["torch_trainer_bf16"]
    assert trainer["status"] == "failed"
    assert trainer["error"] == "timed out after 2 s (its limit); killed"
    assert 2 <= trainer["seconds"] < 10
    assert printed["counts"] == {"ok": 1, "failed": 1, "skipped": 1} and not printed["ok"]
    assert "===== torch_trainer_bf16" in (out / "checks.log").read_text()


HIDE_VLLM = """import sys


class _NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError("hidden by the test", name=name)


sys.meta_path.insert(0, _NoVLLM())
"""
"""A sitecustomize.py that makes vllm unimportable, as it is on the device image."""


@pytest.mark.parametrize("lora", [0, 8])
def test_grpo_check_without_vllm_runs_grpo_on_hf_and_reports_both_rates(tmp_path: Path,
                                                                        lora: int) -> None:
    """grpo_check.py's tiny shape through `rft-hpc run` where vLLM is missing: the HF engine,
    `"vllm": "missing"`, colocated, every rollout trained once, both rates from the run's
    metrics and each part's rate alone; with `--lora` the versions are adapters
    (grpo_qwen05b_lora)."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_VLLM)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/device/grpo_check.py"), "--steps", "2",
         "--tasks", "2", "--repeat", "2", "--max-new-tokens", "16", "--lora", str(lora)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ")[-1])
    assert result["ok"] and result["run_exit"] == 0
    assert (result["engine"], result["vllm"], result["explorer_device"]) == ("hf", "missing",
                                                                            "cpu")
    assert (result["shape"], result["tokenizer_ids"], result["vocab_size"]) == ("tiny", 1024,
                                                                                1088)
    assert result["explorer_steps"] == result["trainer_steps"] == 2
    assert result["generated_tokens"] == result["trained_tokens"] > 0
    assert result["rollout_tokens_per_s"] > 0 and result["trainer_tokens_per_s"] > 0
    # `rft-hpc run` colocated it (the default), and each part was timed alone after it
    assert result["placement"] == "colocated"
    assert result["rollout_tokens_per_s_alone"] > 0 and result["trainer_tokens_per_s_alone"] > 0
    assert result["rollout_run_over_alone"] > 0 and result["trainer_run_over_alone"] > 0
    assert any(g > 0 for g in result["grad_norms"])  # the rewards differ within a group
    assert result["weights"] == {"version": 2, "dtypes": ["float32"], "finite": True,
                                 "kind": "lora-adapter" if lora else "full"}


def test_reward_check_scores_as_a_bare_forward_on_the_cpu() -> None:
    """reward_check.py's tiny shape on the CPU: the explorer's scorer gives the bare
    forward's scores exactly (fp32, one device) and both rates are reported (the ratio is
    the device's figure: timed, never asserted here)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/device/reward_check.py"), "--reps", "2"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    result = json.loads(proc.stdout.split("RESULT ")[-1])
    assert (result["device"], result["shape"], result["batch"]) == ("cpu", "tiny", 32)
    assert result["max_score_difference"] == 0.0 and result["tokens"] > 32 * 120
    assert result["tokens_per_s"] > 0 and result["bare_tokens_per_s"] > 0
    assert proc.returncode == (0 if result["ok"] else 1)
