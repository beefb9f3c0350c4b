"""LoRA (`model.lora`) on two trainer ranks, ddp and FSDP2 over gloo: the step, and a
second step after a checkpoint round trip, are the single process's, with the KL term's
reference being the policy with its adapter off (under FSDP a collective of its own, which
a rank with no micro-batch left joins in its idle pass)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.paths import ROOT
from helpers.ranks import finish, rank_env, start_ranks, write_config

WORKER = ROOT / "tests" / "cluster" / "test_trainer_fsdp.py"  # its `fsdp` worker: step, save,
# restore into a fresh trainer, second step; rank 0 keeps what the ranks gathered
TRAINER = {"lr": 1e-2, "batch_size": 8, "grad_clip": 1.0, "weight_decay": 0.01,
           "micro_batch_tokens": 24}
ALGORITHM = {"algorithm_type": "grpo", "kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": 0.5}}
LORA = {"rank": 8, "alpha": 16, "dropout": 0.0}


def run_worker(tmp_path, model, parallel: str, world: int) -> dict:
    out = tmp_path / f"{parallel}-{world}"
    out.mkdir()
    config = write_config(out / "config.yaml", model, lora=LORA,
                          trainer={**TRAINER, "parallel": parallel}, algorithm=ALGORITHM)
    args = [sys.executable, str(WORKER), "fsdp", str(config), str(out)]
    results = finish(start_ranks(args, world, out / "rdzv"))
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    return torch.load(out / f"fsdp-{world}.pt")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_the_adapter_as_one_process(tmp_path, tiny_model, parallel):
    import subprocess

    one_out = tmp_path / "one"
    one_out.mkdir()
    config = write_config(one_out / "config.yaml", tiny_model, lora=LORA,
                          trainer={**TRAINER, "parallel": parallel}, algorithm=ALGORITHM)
    alone = subprocess.run([sys.executable, str(WORKER), "fsdp", str(config), str(one_out)],
                           cwd=ROOT, env=rank_env(0, 1, None), capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    one = torch.load(one_out / "fsdp-1.pt")
    two = run_worker(tmp_path, tiny_model, parallel, 2)
    assert two["sharded"] == (parallel == "fsdp")
    # what is gathered, published and checkpointed is the adapter alone, under peft's names
    names = list(one["weights"])
    assert names and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in names)
    assert list(two["weights"]) == names and list(two["second"]) == names
    # (the first step's KL is 0: a fresh adapter adds nothing; the second step's gradients
    # hold the KL term's, against the reference with the adapter off)
    # 24 tokens: rank 0's shard packs into 4 micro-batches, rank 1's into 3 (under FSDP it
    # runs one idle pass, with the reference's forward, to join rank 0's fourth)
    assert (one["values"]["micro_batches"], two["values"]["micro_batches"]) == (6, 7)
    for key in ("loss", "tokens", "grad_norm", "kl_ref"):
        assert two["values"][key] == pytest.approx(one["values"][key], rel=1e-4), key
    lr = TRAINER["lr"]
    for k, w in one["second"].items():
        assert not torch.equal(w, one["weights"][k]), k  # the second step moved it again
        # Adam's steps move a weight by ~lr * sign(g): float noise in a g near Adam's eps
        # (another summation order) may flip it, so the bound is a few lr, not float noise
        assert float((two["weights"][k] - one["weights"][k]).abs().max()) <= 2 * lr, k
        assert float((two["second"][k] - w).abs().max()) <= 4 * lr, k
    close = sum(int(torch.isclose(two["second"][k], w, rtol=1e-4, atol=1e-5).sum())
                for k, w in one["second"].items())
    assert close >= 0.99 * sum(w.numel() for w in one["second"].values())
