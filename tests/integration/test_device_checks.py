"""tools/device/check_all.py on CPUs: the summary, $OUT/summary.json and a check's time limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
