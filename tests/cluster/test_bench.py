"""Bench mode (`rft-hpc eval`): checkpoints of a run scored on task sets, as a Slurm array on
the local cluster and as local processes; pass@k against hand-computed values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import DEMO, ROOT
from helpers.slurm_cluster import wait_for_states

from rft_hpc.config import load_config
from rft_hpc.engines.hf import load_policy
from rft_hpc.eval.scoring import pass_at_k, summarize
from rft_hpc.run.stages import create_run
from rft_hpc.sync.weight_files import publish_weights
from rft_hpc.trainer.checkpoint import save_trainer_state

CHECKPOINTS = ["base", "sft-v000006", "grpo-v000002", "grpo-step-000004"]


def rft(*args: object, env: dict[str, str] | None = None,
        timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_pass_at_k_matches_hand_computed_values() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # any 2 of 4 include a correct one
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    scores = summarize([1.0, 0.0], [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.1]], k=2)
    assert scores["n"] == 4 and scores["tasks"] == 2
    assert scores["greedy_accuracy"] == 0.5
    assert scores["mean@2"] == pytest.approx((0.5 + 0.025) / 2)
    assert scores["pass@1"] == pytest.approx(0.25)
    assert scores["pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # 0.1 is not correct


@pytest.fixture
def run_dir(tmp_path: Path, tiny_model: Path) -> Path:
    """A run directory of the two-stage demo holding published weights and a trainer
    checkpoint, each a perturbed copy of the tiny model."""
    config = load_config(DEMO, [f"run.root={tmp_path}", f"model.path={tiny_model}",
                                "eval.max_new_tokens=3", "tasks.eval_size=4"])
    _, run = create_run(config)
    _, model = load_policy(tiny_model)
    base = model.state_dict()
    gen = torch.Generator().manual_seed(0)

    def perturbed(scale: float) -> dict[str, torch.Tensor]:
        return {k: t + scale * torch.randn(t.shape, generator=gen) for k, t in base.items()}

    publish_weights(run.root / "stages/0-sft/weights", perturbed(0.05), 6)
    publish_weights(run.root / "stages/1-grpo/weights", perturbed(0.02), 2)
    model.load_state_dict(perturbed(0.04))
    save_trainer_state(run.root / "stages/1-grpo/ckpt", 4, model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1), cursor={},
                       extra={}, config_hash="test")
    return run.root


def _tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                            for a in range(3)))
    return path


def _check_results(results: dict, tasksets: list[str], k: int) -> None:
    assert results["checkpoints"] == CHECKPOINTS
    assert results["tasksets"] == tasksets
    got = {(r["checkpoint"], r["taskset"]) for r in results["results"]}
    assert got == {(c, t) for c in CHECKPOINTS for t in tasksets}
    for r in results["results"]:
        assert 0.0 <= r["greedy_accuracy"] <= 1.0
        # exact-match rewards are 0 or 1: the mean reward is pass@1
        assert r[f"mean@{k}"] == pytest.approx(r["pass@1"])
        assert r["pass@1"] <= r[f"pass@{k}"] <= 1.0


def test_bench_scores_every_checkpoint_as_a_slurm_array(slurm_env: dict[str, str],
                                                        run_dir: Path) -> None:
    result = rft("eval", run_dir, "--tasks", "arithmetic:digits=1,size=4", "--tasks",
                 _tasks_file(run_dir), "--k", "2", env=slurm_env)
    assert result.returncode == 0, result.stderr[-3000:]
    bench = run_dir / "bench"
    jobs = json.loads((bench / "state/jobs.json").read_text())["submissions"][-1]["jobs"]
    ids = {j["name"]: j["id"] for j in jobs}
    assert jobs[0]["array"] == 2 * len(CHECKPOINTS) and jobs[1]["after"] == ["bench"]
    states = wait_for_states(ids["bench-collect"], slurm_env, timeout=240)
    log = (bench / "jobs/bench-collect.log").read_text()
    assert set(states.values()) == {"COMPLETED"}, log[-3000:]
    results = json.loads((bench / "results.json").read_text())
    _check_results(results, ["arith1p", "sums"], 2)
    assert all(f"{c}__sums.json" in os.listdir(bench) for c in CHECKPOINTS)
    assert "grpo-step-000004" in log and "pass@2" in log  # the table


def test_bench_runs_locally_and_skips_results_that_exist(run_dir: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("eval", run_dir, "--k", "2", "--n", "3", "--local", "--out", out)
    result = rft(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pass@2" in result.stdout and "sft-v000006" in result.stdout
    bench = out / "bench"
    results = json.loads((bench / "results.json").read_text())
    assert results["n"] == 3
    _check_results(results, ["eval"], 2)
    assert {r["tasks"] for r in results["results"]} == {4}  # tasks.eval_size of the run
    # a rerun scores only what has no result file
    kept = bench / "base__eval.json"
    kept.write_text(kept.read_text().replace('"checkpoint"', '"kept": true, "checkpoint"'))
    (bench / "grpo-v000002__eval.json").unlink()
    again = rft(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    results = json.loads((bench / "results.json").read_text())
    assert [r.get("kept") for r in results["results"]].count(True) == 1
    assert (bench / "grpo-v000002__eval.json").exists()
    other = rft("eval", run_dir, "--k", "3", "--local", "--out", out)
    assert other.returncode == 2 and "other settings (k)" in other.stderr


def test_bad_task_specs_are_refused(run_dir: Path) -> None:
    result = rft("eval", run_dir, "--tasks", "arithmetic:digit=1", "--local")
    assert result.returncode == 2 and "unknown key(s) digit" in result.stderr
    result = rft("eval", run_dir, "--tasks", "nothing.txt", "--local")
    assert result.returncode == 2 and "not `eval`" in result.stderr


def _bench_stage_config(tmp_path: Path, model: Path) -> Path:
    """A two-stage run: a short SFT stage publishing weights, then a stage in mode bench."""
    path = tmp_path / "bench.yaml"
    path.write_text(f"""
run: {{name: benchrun, root: {tmp_path / "runs"}, seed: 0}}
model: {{path: {model}}}
tasks: {{type: arithmetic, digits: 1, eval_size: 4}}
explorer: {{repeat: 2}}
algorithm: {{algorithm_type: sft}}
trainer: {{lr: 3.0e-4, batch_size: 16, steps: 2, save_interval: 1}}
sync: {{interval: 1}}
eval: {{max_new_tokens: 3}}
stages:
  - {{name: sft, mode: train, data: {{source: tasks}}}}
  - {{name: bench, mode: bench}}
""")
    return path


def test_a_stage_in_mode_bench_scores_the_checkpoints_before_it(tmp_path: Path,
                                                                tiny_model: Path) -> None:
    result = rft("run", _bench_stage_config(tmp_path, tiny_model), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs/benchrun"
    results = json.loads((run / "stages/1-bench/bench/results.json").read_text())
    # v1 was pruned after v2 was published: its trainer checkpoint stands in
    assert results["checkpoints"] == ["base", "sft-step-000001", "sft-v000002"]
    assert results["tasksets"] == ["eval"] and results["k"] == results["n"] == 2
    assert [r["tasks"] for r in results["results"]] == [4, 4, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"][1]["mode"] == "bench"
    assert summary["stages"][1]["bench"] == str(run / "stages/1-bench/bench/results.json")


def test_a_bench_stage_is_one_job_after_the_stage_before(tmp_path: Path,
                                                         tiny_model: Path) -> None:
    result = rft("submit", _bench_stage_config(tmp_path, tiny_model), "--dry-run",
                 "--auto-resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# ---- bench.bench.watch.sbatch (after bench.bench)" in result.stdout
    assert "# ---- bench.bench.sbatch (after bench.prepare)" in result.stdout
    assert "role bench-stage" in result.stdout
    assert "# ---- finalize.sbatch (after bench.bench)" in result.stdout


def test_a_bench_stage_runs_under_slurm(slurm_env: dict[str, str], tmp_path: Path,
                                        tiny_model: Path) -> None:
    result = rft("submit", _bench_stage_config(tmp_path, tiny_model), env=slurm_env)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs/benchrun"
    jobs = json.loads((run / "state/jobs.json").read_text())["submissions"][-1]["jobs"]
    ids = {j["name"]: j["id"] for j in jobs}
    assert wait_for_states(ids["finalize"], slurm_env, timeout=240) == {
        ids["finalize"]: "COMPLETED"}, (run / "stages/1-bench/jobs/bench.log").read_text()
    results = json.loads((run / "stages/1-bench/bench/results.json").read_text())
    assert results["checkpoints"] == ["base", "sft-step-000001", "sft-v000002"]
    assert "sft-v000002" in (run / "stages/1-bench/jobs/bench.log").read_text()  # the table
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"][1]["bench"] == str(run / "stages/1-bench/bench/results.json")
