"""LoRA (`model.lora`) on two trainer ranks, ddp and FSDP2 over gloo: the step, and a
second step after a checkpoint round trip, are the single process's, with the KL term's
reference being the policy with its adapter off (under FSDP a collective of its own, which
a rank with no micro-batch left joins in its idle pass)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.paths import ROOT
from helpers.ranks import (
    finish,
    rank_env,
    sft_stage,
    start_ranks,
    trainer_command,
    write_config,
)

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


@pytest.mark.timeout(600)
def test_fsdp_role_evaluates_publishes_and_checkpoints_the_adapter(tmp_path, tiny_model):
    """The trainer role on two FSDP ranks with `model.lora`: rank 0 evaluates the gathered
    adapter on a whole replica of its own, publishes it and checkpoints it."""
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.sync.storage import load_safetensors
    from rft_hpc.sync.weight_files import load_weights, read_manifest

    stage = sft_stage(tmp_path, tiny_model, "fsdp-lora", lora=LORA, steps=2, parallel="fsdp",
                      lr=3e-2, micro_batch_tokens=48)
    results = finish(start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1"))
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    evals = {r["step"]: r for r in rows if r.get("eval_accuracy") is not None}
    assert sorted(evals) == [0, 2]
    assert read_manifest(stage / "weights", 2)["kind"] == "lora-adapter"
    published = load_weights(stage / "weights", 2)
    assert published and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in published)
    assert any(float(t.abs().max()) > 1e-3 for k, t in published.items() if ".lora_B." in k)
    saved, _ = load_safetensors(stage / "ckpt" / "trainer" / "step-000002" / "model.safetensors")
    assert sorted(saved) == sorted(k.replace(".weight", ".default.weight") for k in published)
    for k, t in published.items():
        assert torch.equal(saved[k.replace(".weight", ".default.weight")], t), k
    # the held-out answers at step 2 are those of the adapter, scored on rank 0's replica
    answers = (stage / "eval" / "answers" / "v000002.jsonl").read_text()
    assert answers != (stage / "eval" / "answers" / "v000000.jsonl").read_text()
