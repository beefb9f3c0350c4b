"""Weight sync over the fabric in whole runs: `nccl` (gloo on CPUs) and `mpi`, locally and
between separately submitted Slurm jobs, with 2 explorers; a killed explorer comes back."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers.paths import DEMO
from helpers.runs import rft, short
from helpers.slurm_runs import finished, heartbeat, running_at, submit, wait_until
from helpers.slurm_runs import rft as rft_slurm

from rft_hpc.monitor.metrics import read_metrics


def fabric_carried_the_weights(stage: Path, steps: int, deltas: bool = False) -> None:
    """Every version reached the explorers without files: no fallback, and weights were
    written as files only at the very end (the final version, and those published once an
    explorer had finished its last step and stopped listening); with `deltas`, some of them
    went as deltas."""
    trained = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert trained[-1]["sync_fallbacks"] == 0
    assert (trained[-1]["sync_fabric_deltas"] > 0) == deltas
    files = sorted(int(p.name[1:]) for p in (stage / "weights").glob("v*"))
    assert files[-1] == steps and files[0] >= steps - 2, files
    for i in range(2):
        versions = [r["version"] for r in read_metrics(stage / "metrics" / f"explorer-{i}.jsonl")]
        assert max(versions) >= steps - 2, versions  # the explorers kept up, one step ahead


@pytest.mark.parametrize("method", ["nccl", "mpi"])
def test_the_demo_runs_with_each_fabric_method(tmp_path: Path, tiny_model: Path,
                                              method: str) -> None:
    """With delta versions (`sync.full_every` 3): every third goes whole."""
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "trainer.steps=10", "--set", f"sync.method={method}",
                                     "--set", "sync.timeout=60", "--set", "sync.checksum=true",
                                     "--set", "sync.full_every=3"),
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    fabric_carried_the_weights(tmp_path / "demo" / "stages" / "0-main", 10, deltas=True)


@pytest.mark.parametrize("method", ["nccl", "mpi"])
def test_lora_adapters_travel_over_each_fabric_method(tmp_path: Path, tiny_model: Path,
                                                      method: str) -> None:
    """With `model.lora` each version on the fabric is the adapter's tensors alone; the
    explorers apply them through peft, and the final files are an adapter version."""
    from rft_hpc.sync.weight_files import read_manifest

    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "stages=[]",
                                     "--set", "trainer.steps=10", "--set", f"sync.method={method}",
                                     "--set", "sync.timeout=60", "--set", "sync.checksum=true",
                                     "--set", "model.lora={rank: 8}",
                                     "--set", "trainer.lr=1e-3"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "demo" / "stages" / "0-main"
    fabric_carried_the_weights(stage, 10)
    manifest = read_manifest(stage / "weights", 10)
    assert manifest["kind"] == "lora-adapter"
    assert all(".lora_" in name for name in manifest["tensors"])


@pytest.mark.parametrize("method", ["nccl", "mpi"])
def test_fabric_sync_between_separately_submitted_jobs(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path, method: str) -> None:
    run = submit(slurm_env, tmp_path, tiny_model, f"fabric-{method}-{os.getpid()}",
                 "--set", f"sync.method={method}", "--set", "sync.timeout=60")
    finished(slurm_env, run)
    fabric_carried_the_weights(run / "stages" / "0-main", 40)
    assert rft_slurm(slurm_env, "audit", run).returncode == 0


def test_an_explorer_killed_in_a_nccl_run_comes_back_and_the_trainer_goes_on(
        slurm_env: dict[str, str], tmp_path: Path, tiny_model: Path) -> None:
    run = submit(slurm_env, tmp_path, tiny_model, f"fabric-kill-{os.getpid()}",
                 "--set", "sync.method=nccl", "--set", "sync.timeout=15",
                 "--set", "sync.idle_publish=2")
    wait_until(running_at(run, "explorer-1", 5), what="explorer 1 at step 5")
    os.kill(heartbeat(run, "explorer-1")["pid"], signal.SIGKILL)
    finished(slurm_env, run)
    stage = run / "stages" / "0-main"
    assert heartbeat(run, "explorer-1")["restarts"] == 1
    trained = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r]
    print(f"sync fallbacks after the kill: {trained[-1]['sync_fallbacks']:g}")
    survivor = [r["version"] for r in read_metrics(stage / "metrics" / "explorer-0.jsonl")]
    assert survivor == sorted(survivor) and max(survivor) >= 38
    report = rft_slurm(slurm_env, "audit", run, "--json")
    assert report.returncode == 0, report.stdout[-3000:]
    assert json.loads(report.stdout)["stages"][0]["explorers"]["explorer-1"]["restarts"] == 1
