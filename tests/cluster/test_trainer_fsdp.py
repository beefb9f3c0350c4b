"""The torch trainer backend: micro-batches packed to a token budget, activation
checkpointing, FSDP2 over two Slurm tasks. Real torch, real processes, real Slurm."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.paths import ROOT
from helpers.ranks import (
    finish,
    fixed_batch,
    rank_env,
    sft_stage,
    start_ranks,
    trainer_command,
    write_config,
)
from helpers.slurm_cluster import sbatch, wait_for_states

from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import Experience
from rft_hpc.trainer.micro import drop_oversized, pack, record_cost

TRAINER = {"lr": 1e-3, "batch_size": 8, "grad_clip": 1.0, "weight_decay": 0.01}
KL = {"kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": 0.05}}
"""A KL term in the loss of the RL steps (sft steps have none)."""


def one_step(tmp_path: Path, model: Path, batch: Batch, name: str, algorithm: str = "grpo",
             **settings
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """Weights and gradients after one step of a single-process trainer, and its metrics."""
    from rft_hpc.config import load_config
    from rft_hpc.trainer.trainer import Trainer

    kl = {} if algorithm == "sft" else KL
    config = write_config(tmp_path / f"{name}.yaml", model, trainer={**TRAINER, **settings},
                          algorithm={"algorithm_type": algorithm, **kl})
    trainer = Trainer(load_config(config))
    values = trainer.step(batch)
    params = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    return params, grads, values


def assert_same_step(a, b, rtol: float = 1e-5) -> None:
    params_a, grads_a, _ = a
    params_b, grads_b, _ = b
    for k, g in grads_a.items():
        torch.testing.assert_close(grads_b[k], g, rtol=rtol, atol=2e-6 * float(g.abs().max()),
                                   msg=k)
        clear = g.abs() >= 1e-6  # where float noise in g cannot flip Adam's first step
        torch.testing.assert_close(params_b[k][clear], params_a[k][clear], rtol=1e-6,
                                   atol=1e-7, msg=k)


def test_packing_keeps_each_micro_batch_within_the_budget():
    records = fixed_batch("grpo").records
    lengths = [len(r.tokens) for r in records]
    groups = pack(records, 40)
    assert sorted(i for g in groups for i in g) == list(range(len(records)))
    assert all(len(g) * max(lengths[i] for i in g) <= 40 for g in groups)
    assert len(groups) > 1 and pack(records, 0) == [list(range(len(records)))]
    kept, dropped = drop_oversized(fixed_batch("grpo"), 12)
    assert dropped == sum(n > 12 for n in lengths) > 0
    assert all(record_cost(r) <= 12 for r in kept.records)
    assert len(kept.weights) == len(kept.records)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: critic rows per micro-batch
def test_micro_batches_give_the_whole_batch_step(tmp_path, tiny_model, algorithm):
    whole = one_step(tmp_path, tiny_model, fixed_batch("grpo"), "whole", algorithm=algorithm)
    micro = one_step(tmp_path, tiny_model, fixed_batch("grpo"), "micro", algorithm=algorithm,
                     micro_batch_tokens=40)
    assert micro[2]["micro_batches"] >= 3 and micro[2]["skipped_sequences"] == 0
    assert micro[2]["loss"] == pytest.approx(whole[2]["loss"], rel=1e-5, abs=1e-7)
    assert micro[2]["tokens"] == whole[2]["tokens"]
    assert_same_step(whole, micro)


def test_a_sequence_over_the_budget_is_skipped_with_a_metric(tmp_path, tiny_model, caplog):
    batch = fixed_batch("grpo")
    rng = np.random.default_rng(1)
    long = Experience(rng.integers(4, 20, 60), prompt_length=3, reward=1.0, group_id=9,
                      logprobs=np.full(60, -3.0, dtype=np.float32))
    with_long = Batch(records=[*batch.records, long], weights=[*batch.weights, 1.0],
                      uses=[*batch.uses, 0])
    with caplog.at_level(logging.WARNING, logger="rft_hpc.trainer.trainer"):
        skipped = one_step(tmp_path, tiny_model, with_long, "skip", micro_batch_tokens=40)
    assert skipped[2]["skipped_sequences"] == 1
    assert [r.message for r in caplog.records].count(
        "skipped 1 sequence(s) longer than trainer.micro_batch_tokens = 40 padded tokens") == 1
    # the step is exactly the step on the batch without the long record
    assert_same_step(one_step(tmp_path, tiny_model, batch, "without"), skipped)


def test_activation_checkpointing_gives_the_same_gradients(tmp_path, tiny_model):
    plain = one_step(tmp_path, tiny_model, fixed_batch("sft"), "plain", algorithm="sft")
    recomputed = one_step(tmp_path, tiny_model, fixed_batch("sft"), "ckpt", algorithm="sft",
                          activation_checkpointing=True)
    assert_same_step(plain, recomputed, rtol=1e-6)


def test_bfloat16_compute_keeps_float32_weights(tmp_path, tiny_model):
    fp32 = one_step(tmp_path, tiny_model, fixed_batch("sft"), "fp32", algorithm="sft")
    bf16 = one_step(tmp_path, tiny_model, fixed_batch("sft"), "bf16", algorithm="sft",
                    dtype="bfloat16")
    assert all(w.dtype == torch.float32 for w in bf16[0].values())
    assert bf16[2]["loss"] != fp32[2]["loss"]  # the forward really ran in bfloat16
    assert bf16[2]["loss"] == pytest.approx(fp32[2]["loss"], rel=2e-2)


# -- FSDP2 over two Slurm tasks ----------------------------------------------------------------

def fsdp_worker(config_path: str, out: str) -> None:
    """One rank (one Slurm task, or alone): a step on `fixed_batch("grpo")`, a checkpoint
    (rank 0 writes what every rank gathered), a fresh trainer that restores it, a second
    step; rank 0 saves the gathered weights of both steps."""
    from rft_hpc.config import load_config
    from rft_hpc.trainer.checkpoint import load_trainer_state, save_trainer_state
    from rft_hpc.trainer.distributed import broadcast_object, init_distributed, shutdown
    from rft_hpc.trainer.fsdp import is_sharded
    from rft_hpc.trainer.trainer import Trainer

    torch.set_num_threads(1)
    ctx = init_distributed()
    config = load_config(Path(config_path))
    ckpt = Path(out) / f"ckpt-{ctx.world_size}"
    trainer = Trainer(config, ctx)
    values = trainer.step(fixed_batch("grpo") if ctx.is_main else None)
    first = trainer.full_state_dict()
    grads = {} if ctx.distributed else {k: p.grad for k, p in trainer.model.named_parameters()}
    model, optimizer = trainer.checkpoint_parts()
    if ctx.is_main:
        save_trainer_state(ckpt, 1, model=model, optimizer=optimizer,
                           scheduler=trainer.scheduler, cursor={}, extra={}, config_hash="h")
    broadcast_object("saved", ctx)  # the others read it once rank 0 has written it
    again = Trainer(config, ctx)
    model, optimizer = again.restore_parts()
    assert load_trainer_state(ckpt, model, optimizer, again.scheduler, config_hash="h")
    again.step(fixed_batch("grpo") if ctx.is_main else None)
    second = again.full_state_dict()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in again.model.parameters())
    if ctx.is_main:
        torch.save({"weights": first, "second": second, "values": values, "grads": grads,
                    "sharded": is_sharded(again.model), "local_numel": local},
                   Path(out) / f"fsdp-{ctx.world_size}.pt")
    shutdown()


def test_fsdp_step_on_two_slurm_tasks_matches_one_process(tmp_path, tiny_model, slurm_env):
    config = write_config(tmp_path / "config.yaml", tiny_model,
                          trainer={**TRAINER, "parallel": "fsdp", "micro_batch_tokens": 24},
                          algorithm={"algorithm_type": "grpo", **KL})
    script = [sys.executable, __file__, "fsdp", str(config), str(tmp_path)]
    env = {**rank_env(0, 2, tmp_path / "rdzv"), **slurm_env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the ranks come from Slurm
        env.pop(name)
    wrap = "srun " + " ".join(script)
    job = sbatch(["-N2", "-n2", "--mem=0", "--output=fsdp.log", "--wrap", wrap], env,
                 cwd=tmp_path)
    alone = subprocess.run(script, cwd=ROOT, env=rank_env(0, 1, None), capture_output=True,
                           text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    states = wait_for_states(job, slurm_env, timeout=300)
    log = (tmp_path / "fsdp.log").read_text()
    assert states == {job: "COMPLETED"}, log[-3000:]
    assert f"2 ranks over gloo, met through file://{tmp_path}/rdzv" in log

    one, two = torch.load(tmp_path / "fsdp-1.pt"), torch.load(tmp_path / "fsdp-2.pt")
    assert two["sharded"] and not one["sharded"]
    total = sum(t.numel() for t in one["weights"].values())
    assert two["local_numel"] < 0.6 * total  # rank 0 held about half of the model
    assert list(two["weights"]) == list(one["weights"])  # the full state dict, same names
    diff = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
    print(f"FSDP 2 Slurm tasks vs 1 process, one GRPO step: max |weight diff| {diff:.3g}")
    lr = TRAINER["lr"]
    clear_both = {}
    for k, w in one["weights"].items():
        w2, clear = two["weights"][k], one["grads"][k].abs() >= 1e-6
        # Adam's first step moves a weight by ~lr * sign(g): where |g| is near Adam's eps,
        # float noise in g (other summation order) may change that by up to ~lr
        assert float((w2 - w).abs().max()) <= 2 * lr, k
        torch.testing.assert_close(w2[clear], w[clear], rtol=1e-5, atol=2e-6, msg=k)
        clear_both[k] = clear & ((w2 - w).abs() <= 2e-6 + 1e-5 * w.abs())
    # 24 tokens: rank 0's shard packs into 4 micro-batches, rank 1's into 3 (it runs one idle
    # pass to take part in rank 0's fourth), one process packs the batch into 6
    assert (one["values"]["micro_batches"], two["values"]["micro_batches"]) == (6, 7)
    for key in ("loss", "tokens", "grad_norm"):
        assert two["values"][key] == pytest.approx(one["values"][key], rel=1e-5), key
    # a second step after a save and restore (sharded optimizer state gathered, then loaded
    # into the shards of a fresh trainer) is still the single process's second step
    assert list(two["second"]) == list(one["weights"])
    diff2 = max(float((one["second"][k] - two["second"][k]).abs().max()) for k in one["second"])
    print(f"... after a save, a restore and a second step: max |weight diff| {diff2:.3g}")
    for k, w in one["second"].items():
        assert not torch.equal(w, one["weights"][k]), k
        assert float((two["second"][k] - w).abs().max()) <= 4 * lr, k
        torch.testing.assert_close(two["second"][k][clear_both[k]], w[clear_both[k]],
                                   rtol=1e-4, atol=1e-5, msg=k)


def test_fsdp_role_publishes_and_checkpoints_full_weights(tmp_path, tiny_model):
    """The trainer role on two FSDP ranks (local processes): every rank takes part in the
    gathers, rank 0 evaluates, publishes and checkpoints the full weights."""
    from rft_hpc.engines.hf import load_policy
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.sync.storage import load_safetensors
    from rft_hpc.sync.weight_files import load_weights

    stage = sft_stage(tmp_path, tiny_model, "fsdp", steps=2, parallel="fsdp",
                      micro_batch_tokens=48)
    results = finish(start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1"))
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]

    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if r.get("eval_accuracy") is not None] == [0, 2]
    assert all(r["skipped_sequences"] == 0 and r["micro_batches"] >= 2
               for r in rows if "loss" in r)
    published = load_weights(stage / "weights", 2)
    saved, _ = load_safetensors(stage / "ckpt" / "trainer" / "step-000002" / "model.safetensors")
    start = load_policy(tiny_model)[1].state_dict()
    assert sorted(published) == sorted(saved) == sorted(start)
    for k, w in start.items():
        assert published[k].shape == w.shape and torch.equal(published[k], saved[k]), k
    assert any(not torch.equal(published[k], w) for k, w in start.items())
    optimizer = torch.load(stage / "ckpt" / "trainer" / "step-000002" / "optimizer.pt")
    assert {k: tuple(v["exp_avg"].shape) for k, v in optimizer["state"].items()} == \
        {k: tuple(w.shape) for k, w in start.items()}  # full moments, by parameter name


if __name__ == "__main__" and sys.argv[1] == "fsdp":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fsdp_worker(*sys.argv[2:])
    from rft_hpc.runtime.exit import leave_process

    leave_process(0)  # as `rft-hpc role trainer` ends: not through gloo's teardown
