"""The Megatron-core trainer backend on CPUs: real megatron-core, real processes, gloo.

Every trainer with `trainer.backend: megatron` runs in a child process (this file run as a
script, `megatron_worker`), so the test process never initialises torch.distributed or
megatron-core's `parallel_state`. The CPU shims are `rft_hpc.megatron.cpu`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.paths import DEMO
from helpers.ranks import (
    finish,
    fixed_batch,
    sft_stage,
    start_ranks,
    trainer_command,
    write_config,
)
from helpers.runs import rft, rollouts

pytestmark = pytest.mark.needs_module("megatron.core")

TRAINER = {"lr": 1e-3, "batch_size": 8, "grad_clip": 1.0, "weight_decay": 0.01}
ALGORITHM = {"algorithm_type": "grpo", "kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": 0.05}}


def hf_grads(trainer) -> dict[str, torch.Tensor]:
    """The policy's gradients with HF names: gathered from the megatron shards (a
    collective), or the torch model's own."""
    if trainer.backend.name == "megatron":
        return trainer.model.hf_gather({n: p.grad for n, p in
                                        trainer.model.gpt.named_parameters()})
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def megatron_worker(config_path: str, out: str, with_torch: str) -> None:
    """One rank: a megatron step on `fixed_batch("grpo")` (weights, gradients, metrics), a
    checkpoint of it, an uninterrupted second step, and a fresh trainer that restores the
    checkpoint and takes the second step again. With `with_torch` == "1" (one process) also
    the torch backend's first step on the same batch, and the megatron step with activation
    checkpointing. Rank 0 saves everything to `out`."""
    from rft_hpc.config import load_config
    from rft_hpc.trainer.checkpoint import load_trainer_state, save_trainer_state
    from rft_hpc.trainer.distributed import broadcast_object, init_distributed, shutdown
    from rft_hpc.trainer.trainer import Trainer

    torch.set_num_threads(1)
    ctx = init_distributed()
    config = load_config(Path(config_path))
    result: dict = {}
    if with_torch == "1":
        plain = Trainer(config.model_copy(update={"trainer": config.trainer.model_copy(
            update={"backend": "torch"})}))
        result["torch_values"] = plain.step(fixed_batch("grpo"))
        result["torch_weights"] = plain.full_state_dict()
        result["torch_grads"] = hf_grads(plain)
        del plain
    batch = fixed_batch("grpo") if ctx.is_main else None
    trainer = Trainer(config, ctx)
    result["values"] = trainer.step(batch)
    result["weights"] = trainer.full_state_dict()
    result["grads"] = hf_grads(trainer)
    model, optimizer = trainer.checkpoint_parts()
    ckpt = Path(out) / f"ckpt-{ctx.world_size}"
    if ctx.is_main:
        save_trainer_state(ckpt, 1, model=model, optimizer=optimizer,
                           scheduler=trainer.scheduler, cursor={}, extra={}, config_hash="h")
    broadcast_object("saved", ctx)  # the others read it once rank 0 has written it
    result["second_values"] = trainer.step(fixed_batch("grpo") if ctx.is_main else None)
    result["second"] = trainer.full_state_dict()
    again = Trainer(config, ctx)
    model, optimizer = again.restore_parts()
    assert load_trainer_state(ckpt, model, optimizer, again.scheduler, config_hash="h")
    result["restored_values"] = again.step(fixed_batch("grpo") if ctx.is_main else None)
    result["restored"] = again.full_state_dict()
    result["shard_numel"] = sum(p.numel() for p in trainer.model.parameters())
    if with_torch == "1":
        recomputing = Trainer(config.model_copy(update={"trainer": config.trainer.model_copy(
            update={"activation_checkpointing": True})}))
        result["ac_values"] = recomputing.step(fixed_batch("grpo"))
        result["ac_grads"] = hf_grads(recomputing)
        result["ac_mode"] = recomputing.model.gpt.config.recompute_granularity
    if ctx.is_main:
        torch.save(result, Path(out) / f"megatron-{ctx.world_size}.pt")
    shutdown()


def run_worker(tmp_path: Path, model: Path, tp: int, world: int | None = None) -> dict:
    """`megatron_worker` on `world` ranks (default `tp`: no data parallelism) at TP = `tp`
    over gloo; rank 0's results."""
    world = world or tp
    config = write_config(tmp_path / f"tp{tp}.yaml", model, algorithm=ALGORITHM, trainer={
        **TRAINER, "backend": "megatron", "megatron": {"tensor_parallel": tp,
                                                       "make_vocab_size_divisible_by": 8}})
    script = [sys.executable, __file__, str(config), str(tmp_path), "1" if world == 1 else "0"]
    results = finish(start_ranks(script, world, tmp_path / f"rdzv-{world}"), timeout=240)
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    return torch.load(tmp_path / f"megatron-{world}.pt")


FAMILIES = ("llama", "qwen2")
"""llama: the demo's tiny model; qwen2: q/k/v biases and tied embeddings (at TP = 2 the
vocab-parallel embedding is also the output layer)."""

TIED = {"lm_head.weight": "model.embed_tokens.weight"}
"""Tied weights: state dicts name both, parameters (and so gradients) only the second."""


@pytest.fixture(scope="module")
def model_of(tmp_path_factory, tiny_model) -> Callable[[str], Path]:
    """The tiny model folder of a family, built once per module."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    built = {"llama": tiny_model}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = init_tiny_model(tmp_path_factory.mktemp(family),
                                            TinyModelSpec(arch=family))  # type: ignore[arg-type]
        return built[family]
    return get


@pytest.fixture(scope="module")
def tp1_of(tmp_path_factory, model_of) -> Callable[[str], dict]:
    """`run_worker` at TP = 1 on one process for a family, run once per module."""
    done: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in done:
            done[family] = run_worker(tmp_path_factory.mktemp(f"tp1-{family}"),
                                      model_of(family), 1)
        return done[family]
    return get


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tp1(tp1_of, family) -> dict:
    return tp1_of(family)


def assert_same_step(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                     grads: dict[str, torch.Tensor], lr: float) -> None:
    """The same AdamW step: equal where |g| is clear of Adam's eps (there float noise in g
    cannot flip the first step's ~lr * sign(g)), within 2 lr everywhere."""
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        clear = grads[TIED.get(k, k) if k not in grads else k].abs() >= 1e-6
        torch.testing.assert_close(got[k][clear], w[clear], rtol=1e-5, atol=1e-5, msg=k)
        assert float((got[k] - w).abs().max()) <= 2 * lr, k


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_tp1_step_equals_the_torch_backend(tp1, family):
    """One GRPO step (KL term, weight decay, grad clip) of the megatron backend, TP = 1,
    gives the torch backend's gradients, metrics and updated HF weights (with tied
    embeddings `lm_head.weight` too, as transformers' state dict has it)."""
    assert sorted(tp1["weights"]) == sorted(tp1["torch_weights"])
    assert "lm_head.weight" in tp1["weights"]
    if family == "qwen2":
        assert tp1["weights"]["lm_head.weight"] is tp1["weights"]["model.embed_tokens.weight"]
    for k, g in tp1["torch_grads"].items():
        torch.testing.assert_close(tp1["grads"][k], g, rtol=1e-4,
                                   atol=1e-5 * float(g.abs().max()), msg=k)
    for key in ("loss", "tokens", "grad_norm", "kl_ref"):
        assert tp1["values"][key] == pytest.approx(tp1["torch_values"][key], rel=1e-5), key
    assert_same_step(tp1["torch_weights"], tp1["weights"], tp1["torch_grads"], TRAINER["lr"])
    print(f"{family}: megatron TP=1 vs torch, one GRPO step: max |weight diff| "
          f"{max_diff(tp1['torch_weights'], tp1['weights']):.3g}")


def test_activation_checkpointing_gives_the_same_gradients(tp1):
    """megatron-core's full recomputation (trainer.activation_checkpointing) on CPUs."""
    assert tp1["ac_mode"] == "full"
    assert tp1["ac_values"]["loss"] == pytest.approx(tp1["values"]["loss"], rel=1e-6)
    for k, g in tp1["grads"].items():
        torch.testing.assert_close(tp1["ac_grads"][k], g, rtol=1e-6,
                                   atol=1e-6 * float(g.abs().max()), msg=k)


def test_restored_checkpoint_continues_bit_for_bit(tp1):
    """Save after step 1, restore into a fresh trainer: its step 2 is exactly the
    uninterrupted step 2 (model, AdamW moments and step count, schedule)."""
    assert tp1["restored_values"] == tp1["second_values"]
    for k, w in tp1["second"].items():
        assert torch.equal(tp1["restored"][k], w), k
        assert not torch.equal(w, tp1["weights"][k]), k


@pytest.mark.parametrize(("name", "tp"), [("llama", 2), ("llama", 1), ("qwen2", 2)],
                         ids=["tp2", "dp2", "qwen2-tp2"])
def test_two_processes_over_gloo_equal_one(tmp_path, model_of, tp1_of, name, tp):
    """Two processes over gloo, at TP = 2 (each holds half of every cut weight: Qwen2's q/k/v
    biases by query group, its tied embedding by vocabulary rows) or at TP = 1 (two
    data-parallel replicas, each training on half of the rows, gradients summed): the same
    step as one process, and a restored checkpoint continues it exactly."""
    family, tp1 = name, tp1_of(name)
    two = run_worker(tmp_path, model_of(family), tp, world=2)
    assert sorted(two["weights"]) == sorted(tp1["weights"])
    if tp == 2:
        total = sum(t.numel() for k, t in tp1["weights"].items() if k not in TIED)
        assert two["shard_numel"] < 0.6 * total  # rank 0 held about half of the model
    for key in ("loss", "tokens", "grad_norm", "kl_ref"):
        assert two["values"][key] == pytest.approx(tp1["values"][key], rel=1e-5), key
    for k, g in tp1["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4,
                                   atol=1e-5 * float(g.abs().max()), msg=k)
    assert_same_step(tp1["weights"], two["weights"], tp1["grads"], TRAINER["lr"])
    print(f"{family}: megatron TP={tp} x DP={2 // tp} vs one process, one GRPO step: "
          f"max |weight diff| {max_diff(tp1['weights'], two['weights']):.3g}")
    for k, w in two["second"].items():
        assert torch.equal(two["restored"][k], w), k


def test_role_on_two_tp_ranks_publishes_and_checkpoints_full_weights(tmp_path, tiny_model):
    """`rft-hpc role trainer` on two ranks at TP = 2: both take part in every gather, rank 0
    evaluates, publishes and checkpoints the full HF weights (and AdamW moments by HF name)."""
    from rft_hpc.engines.hf import load_policy
    from rft_hpc.monitor.metrics import read_metrics
    from rft_hpc.sync.storage import load_safetensors
    from rft_hpc.sync.weight_files import load_weights

    stage = sft_stage(tmp_path, tiny_model, "tp2", steps=2, backend="megatron",
                      megatron={"tensor_parallel": 2})
    results = finish(start_ranks(trainer_command(stage), 2, stage / "state" / "dist-1"))
    assert all(rc == 0 for rc, _ in results), [err[-3000:] for _, err in results]
    rows = read_metrics(stage / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if r.get("eval_accuracy") is not None] == [0, 2]
    published = load_weights(stage / "weights", 2)
    folder = stage / "ckpt" / "trainer" / "step-000002"
    saved, _ = load_safetensors(folder / "model.safetensors")
    start = load_policy(tiny_model)[1].state_dict()
    assert sorted(published) == sorted(saved) == sorted(start)
    for k, w in start.items():
        assert published[k].shape == w.shape and torch.equal(published[k], saved[k]), k
    assert all(not torch.equal(published[k], w) for k, w in start.items())
    optimizer = torch.load(folder / "optimizer.pt")
    assert optimizer["step"] == 2
    assert {k: tuple(v["exp_avg"].shape) for k, v in optimizer["state"].items()} == \
        {k: tuple(w.shape) for k, w in start.items()}


def test_pipeline_parallel_is_refused_before_the_run(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"run: {{root: {tmp_path / 'runs'}}}\n"
        f"model: {{path: {tmp_path / 'model'}, init: tiny}}\n"
        "trainer: {backend: megatron, megatron: {pipeline_parallel: 2}}\n")
    result = rft("run", config, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert "trainer.megatron.pipeline_parallel > 1 is not in the training loop yet" in \
        result.stderr
    assert not (tmp_path / "runs").exists()


def test_settings_the_loop_cannot_train_are_named(tmp_path, tiny_model):
    from rft_hpc.config import load_config
    from rft_hpc.trainer.megatron_backend import megatron_unsupported

    def problem(world=None, algorithm="grpo", **trainer):
        return megatron_unsupported(load_config(write_config(
            tmp_path / "c.yaml", tiny_model, algorithm={"algorithm_type": algorithm},
            trainer={"backend": "megatron", **trainer})), world)

    assert problem() is None and problem(4, megatron={"tensor_parallel": 2}) is None
    assert "do not split into tensor-parallel groups" in problem(3, megatron={
        "tensor_parallel": 2})
    assert "trains a critic" in problem(algorithm="ppo")
    assert "trainer.dtype bfloat16 with model.dtype float32" in problem(dtype="bfloat16")
    assert "kl_penalty_fn" in megatron_unsupported(load_config(write_config(
        tmp_path / "k.yaml", tiny_model, algorithm={"kl_penalty_fn": "k1"},
        trainer={"backend": "megatron", "megatron": {"tensor_parallel": 2}})))


def test_demo_run_with_the_megatron_backend_publishes_weights(tmp_path, tiny_model):
    """`rft-hpc run` of the demo's GRPO stage with trainer.backend megatron: the trainer
    publishes every step and the explorers sample with the published weights."""
    from rft_hpc.monitor.metrics import read_metrics

    result = rft("run", DEMO, "--set", f"run.root={tmp_path}", "--set",
                 f"model.path={tiny_model}", "--set", "stages=[]", "--set",
                 "trainer.backend=megatron", "--set", "trainer.steps=3", "--set",
                 "explorer.tasks_per_step=2", "--set", "trainer.batch_size=32", "--set",
                 "tasks.eval_size=16", "--set", "eval.interval=0", "--set", "sync.offset=0",
                 timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: megatron" in (tmp_path / "demo" / "config.yaml").read_text()
    stage = tmp_path / "demo" / "stages" / "0-main"
    trained = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl") if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    versions = {r.policy_version for r in rollouts(stage)}
    assert max(versions) > 0, versions  # explorers received published weights
    manifest = json.loads((stage / "weights" / "v000003" / "manifest.json").read_text())
    assert manifest["version"] == 3


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    megatron_worker(*sys.argv[1:])
    from rft_hpc.runtime.exit import leave_process

    leave_process(0)  # as `rft-hpc role trainer` ends: not through gloo's teardown
