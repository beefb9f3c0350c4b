"""LoRA training (`model.lora`) on one process: only the adapter trains, the reference is
the model with its adapter off, and a published version is the adapter alone, which the HF
engine applies through peft to give the trainer's log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.ranks import fixed_batch, write_config

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.config import load_config
from rft_hpc.config.errors import ConfigError
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine, load_policy
from rft_hpc.sync.weight_files import load_weights, publish_weights, read_manifest
from rft_hpc.trainer.trainer import Trainer

LORA = {"rank": 8, "alpha": 16, "target_modules": "all-linear"}
KL = {"kl_loss_fn": "k3", "kl_loss_fn_args": {"kl_coef": 0.05}}


def lora_trainer(tmp_path, model, name="lora", lora=None, **sections):
    path = write_config(tmp_path / f"{name}.yaml", model, lora=lora or LORA,
                        trainer={"lr": 1e-2, "batch_size": 8, **sections.pop("trainer", {})},
                        algorithm={"algorithm_type": "grpo", **KL}, **sections)
    return Trainer(load_config(path))


def test_only_the_adapter_trains_and_the_reference_is_the_base(tmp_path, tiny_model):
    trainer = lora_trainer(tmp_path, tiny_model)
    _, base = load_policy(tiny_model)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    batch = collate(fixed_batch("grpo").records)
    with torch.no_grad():
        expected = token_logprobs(base.eval(), batch)
        torch.testing.assert_close(token_logprobs(trainer.reference, batch), expected)
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    trainer.step(fixed_batch("grpo"))
    trainer.step(fixed_batch("grpo"))
    # optimizer state for the adapter's parameters only
    stepped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(stepped) == len(names) == len(trainer.optimizer.state)
    assert all(p.requires_grad for p in stepped)
    # the frozen base did not move; the reference (adapter off) is still the base model
    own = trainer.model.state_dict()
    for k, w in base_state.items():
        stored = own.get(f"base_model.model.{k}") if f"base_model.model.{k}" in own else \
            own[f"base_model.model.{k}".replace(".weight", ".base_layer.weight")]
        assert torch.equal(stored, w), k
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(trainer.reference, batch), expected)
        trained = token_logprobs(trainer.model.eval(), batch)
    assert float((trained - expected).abs().max()) > 1e-3  # the adapter changed the policy


def test_published_adapter_is_applied_by_the_hf_engine(tmp_path, tiny_model):
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.sync.publisher import WeightPublisher

    trainer = lora_trainer(tmp_path, tiny_model)
    trainer.step(fixed_batch("grpo"))
    state = trainer.full_state_dict()
    assert state and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    run = RunDir(tmp_path / "run")
    publisher = WeightPublisher(trainer.config, run)
    publisher.write_files(state, 1)
    folder = run.weights / "v000001"
    manifest = read_manifest(run.weights, 1)
    assert manifest["manifest_version"] == 2 and manifest["kind"] == "lora-adapter"
    assert manifest["adapter"]["r"] == 8 and manifest["adapter"]["lora_alpha"] == 16
    assert sorted(manifest["adapter"]["target_modules"]) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert json.loads((folder / "adapter_config.json").read_text()) == manifest["adapter"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    full_bytes = sum(t.numel() * t.element_size() for t in load_policy(tiny_model)[1]
                     .state_dict().values())
    assert (folder / "adapter_model.safetensors").stat().st_size < full_bytes / 2

    engine = HFEngine(tiny_model, lora=trainer.config.model.lora)
    engine.load_weights(load_weights(run.weights, 1), 1)
    batch = collate(fixed_batch("grpo").records)
    with torch.no_grad():
        want = token_logprobs(trainer.model.eval(), batch)
        got = token_logprobs(engine.model.eval(), batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert engine.version == 1
    # whole-model weights are refused by an engine that holds an adapter
    with pytest.raises(ValueError, match="whole model"):
        engine.load_weights(load_policy(tiny_model)[1].state_dict(), 2)


def test_the_checkpointed_adapter_is_the_published_one_under_the_models_names(
        tmp_path, tiny_model):
    from rft_hpc.models.lora import peft_names

    trainer = lora_trainer(tmp_path, tiny_model)
    trainer.step(fixed_batch("grpo"))
    model, _ = trainer.checkpoint_parts()
    saved = model.state_dict()
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in saved)
    published = trainer.full_state_dict()
    back = peft_names(saved)
    assert sorted(back) == sorted(published)
    assert all(torch.equal(back[k], published[k]) for k in published)


def test_whole_model_versions_keep_manifest_version_1(tmp_path, tiny_model):
    state = load_policy(tiny_model)[1].state_dict()
    publish_weights(tmp_path, state, 3)
    manifest = json.loads((tmp_path / "v000003" / "manifest.json").read_text())
    assert manifest["manifest_version"] == 1 and "kind" not in manifest
    assert read_manifest(tmp_path, 3)["kind"] == "full"


def test_lora_settings_are_checked(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        load_config(write_config(tmp_path / "bad.yaml", tiny_model, lora={"rank": 0}))
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules"):
        load_config(write_config(tmp_path / "none.yaml", tiny_model,
                                 lora={"target_modules": []}))


def test_megatron_backend_refuses_lora_with_one_message(tmp_path, tiny_model):
    from rft_hpc.run.stages import check_runnable

    path = write_config(tmp_path / "m.yaml", tiny_model, lora=LORA,
                        trainer={"backend": "megatron"})
    with pytest.raises(UserError, match=r"^stage main: model.lora trains a LoRA adapter on "
                       r"trainer.backend torch only; the megatron backend has no adapters"):
        check_runnable(load_config(path))


def test_fsdp_refuses_a_kl_penalty_on_the_adapter_off_reference(tmp_path, tiny_model):
    from rft_hpc.run.stages import check_runnable

    path = write_config(tmp_path / "f.yaml", tiny_model, lora=LORA,
                        trainer={"parallel": "fsdp"},
                        algorithm={"algorithm_type": "grpo", "kl_penalty_fn": "k3"})
    with pytest.raises(UserError, match=r"^stage main: model.lora under trainer.parallel fsdp "
                       r"with algorithm.kl_penalty_fn: rank 0 would run"):
        check_runnable(load_config(path))


def test_an_algorithm_with_a_critic_is_refused_with_lora(tmp_path, tiny_model):
    from rft_hpc.run.stages import check_runnable

    path = write_config(tmp_path / "p.yaml", tiny_model, lora=LORA,
                        algorithm={"algorithm_type": "ppo"})
    with pytest.raises(UserError, match=r"^stage main: model.lora with algorithm ppo: its "
                       r"critic .* has no LoRA support yet"):
        check_runnable(load_config(path))
    with pytest.raises(UserError, match="has no LoRA support yet"):
        Trainer(load_config(path))


def test_activation_checkpointing_gives_the_adapter_the_same_step(tmp_path, tiny_model):
    plain = lora_trainer(tmp_path, tiny_model, "plain")
    recomputed = lora_trainer(tmp_path, tiny_model, "ckpt",
                              trainer={"activation_checkpointing": True})
    for trainer in (plain, recomputed):
        trainer.step(fixed_batch("grpo"))
        trainer.step(fixed_batch("grpo"))
    a, b = plain.full_state_dict(), recomputed.full_state_dict()
    assert any(float(t.abs().max()) > 1e-3 for k, t in a.items() if ".lora_B." in k)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
