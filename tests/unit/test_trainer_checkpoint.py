"""Trainer checkpoints: a resumed trainer continues exactly as if it had never stopped."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rft_hpc.algorithms.aggregation import masked_mean
from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import SFTSample
from rft_hpc.models.tiny import init_tiny_model
from rft_hpc.sync.storage import wait_for_deletions
from rft_hpc.trainer.checkpoint import CheckpointError, load_trainer_state, save_trainer_state


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny"))


def fresh_trainer(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> float:
    """One SFT step on a batch drawn from the global python, numpy and torch RNGs."""
    length = int(np.random.randint(6, 12))
    records = [SFTSample(tokens=torch.randint(3, 20, (length + random.randint(0, 3),)).numpy(),
                         prompt_length=2) for _ in range(4)]
    batch = collate(records)
    loss = masked_mean(-token_logprobs(model, batch), batch.loss_mask)  # SFT's loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_resumed_training_is_identical(tmp_path, tiny_model_dir):
    seed_everything(0)
    model, optimizer, scheduler = fresh_trainer(tiny_model_dir)
    k = 2
    for _ in range(k):
        train_step(model, optimizer, scheduler)
    save_trainer_state(tmp_path, k, model=model, optimizer=optimizer, scheduler=scheduler,
                       cursor={"explorer-0": {"next_step": 5}}, extra={"tokens": 123},
                       config_hash="cafe")
    losses = [train_step(model, optimizer, scheduler) for _ in range(3)]
    final = {name: p.detach().clone() for name, p in model.named_parameters()}

    seed_everything(1234)  # a new process: other RNG states, initial weights, empty optimizer
    model2, optimizer2, scheduler2 = fresh_trainer(tiny_model_dir)
    state = load_trainer_state(tmp_path, model2, optimizer2, scheduler2, config_hash="cafe")
    assert state is not None and state.step == k
    assert state.cursor == {"explorer-0": {"next_step": 5}} and state.extra == {"tokens": 123}
    assert state.path == tmp_path / "trainer" / "step-000002"
    resumed = [train_step(model2, optimizer2, scheduler2) for _ in range(3)]
    assert resumed == losses
    for name, p in model2.named_parameters():
        assert torch.equal(p, final[name]), name
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_no_checkpoint_gives_none(tmp_path, tiny_model_dir):
    model, optimizer, _ = fresh_trainer(tiny_model_dir)
    assert load_trainer_state(tmp_path / "ckpt", model, optimizer) is None


def test_layout_latest_and_pruning(tmp_path, tiny_model_dir):
    model, optimizer, _ = fresh_trainer(tiny_model_dir)
    stale = tmp_path / "trainer" / ".tmp-step-000009.abc"  # left by a trainer killed mid-save
    stale.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        folder = save_trainer_state(tmp_path, step, model=model, optimizer=optimizer,
                                    cursor={}, extra={}, config_hash="h")
    assert sorted(os.listdir(folder)) == ["cursor.json", "model.safetensors", "optimizer.pt",
                                          "rng.json", "state.json"]
    assert (tmp_path / "LATEST").read_text() == "trainer/step-000004\n"
    wait_for_deletions()  # pruned steps' files are deleted on a helper thread
    assert sorted(os.listdir(tmp_path / "trainer")) == ["step-000003", "step-000004"]


def test_other_config_hash_is_refused_before_anything_changes(tmp_path, tiny_model_dir):
    model, optimizer, _ = fresh_trainer(tiny_model_dir)
    save_trainer_state(tmp_path, 1, model=model, optimizer=optimizer, cursor={}, extra={},
                       config_hash="aaa111")
    model2, optimizer2, _ = fresh_trainer(tiny_model_dir)
    with torch.no_grad():
        model2.lm_head.weight.fill_(0.5)
    with pytest.raises(CheckpointError, match=r"aaa111.*bbb222"):
        load_trainer_state(tmp_path, model2, optimizer2, config_hash="bbb222")
    assert bool((model2.lm_head.weight == 0.5).all())


def test_corrupt_model_file_and_missing_scheduler_are_refused(tmp_path, tiny_model_dir):
    model, optimizer, scheduler = fresh_trainer(tiny_model_dir)
    folder = save_trainer_state(tmp_path, 1, model=model, optimizer=optimizer, cursor={},
                                extra={}, config_hash="h")
    with pytest.raises(CheckpointError, match="no scheduler state"):
        load_trainer_state(tmp_path, model, optimizer, scheduler)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_trainer_state(tmp_path, model, optimizer)


def test_config_hash_ignores_defaults_and_how_work_is_split():
    from rft_hpc.config import ExperimentConfig
    from rft_hpc.trainer.trainer import config_hash

    base = {"model": {"path": "/models/m"}, "trainer": {"lr": 3e-5}}
    plain = config_hash(ExperimentConfig.model_validate(base))
    # a setting spelled out at its default (as an older rft-hpc, lacking it, implied)
    spelled = {**base, "trainer": {"lr": 3e-5, "grad_clip": 1.0, "threads": 4, "steps": 7}}
    assert config_hash(ExperimentConfig.model_validate(spelled)) == plain
    changed = {**base, "trainer": {"lr": 1e-5}}
    assert config_hash(ExperimentConfig.model_validate(changed)) != plain


def stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model whose first layer's weight is frozen, after one AdamW step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_is_saved_by_name_and_old_positional_states_still_load(tmp_path):
    from rft_hpc.trainer.optim_state import NamedOptimizer, is_named

    model, optimizer = stepped(0)
    named = NamedOptimizer(model, optimizer).state_dict()
    assert is_named(named) and sorted(named["state"]) == ["0.bias", "1.bias", "1.weight"]
    for state in (named, optimizer.state_dict()):  # this layout, and the one before it
        again, opt2 = stepped(1)
        NamedOptimizer(again, opt2).load_state_dict(state)
        loaded = opt2.state_dict()
        for i, saved in optimizer.state_dict()["state"].items():
            assert all(torch.equal(loaded["state"][i][key], value) for key, value in
                       saved.items()), i
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"lacks \['0.weight'\]"):
        NamedOptimizer(other, torch.optim.AdamW(other.parameters())).load_state_dict(named)


def test_a_tensor_parallel_change_is_refused_before_anything_changes(tmp_path):
    model, optimizer = stepped(0)
    save_trainer_state(tmp_path, 1, model=model, optimizer=optimizer, cursor={}, extra={},
                       config_hash="h", ranks={"world_size": 4, "backend": "megatron",
                                               "model_parallel": 2})
    again, opt2 = stepped(1)
    with pytest.raises(CheckpointError, match="tensor-parallel groups of 2 ranks, this "
                                              "trainer's are 1"):
        load_trainer_state(tmp_path, again, opt2, config_hash="h", model_parallel=1)
    assert not torch.equal(again[1].weight, model[1].weight)
    state = load_trainer_state(tmp_path, again, opt2, config_hash="h", model_parallel=2)
    assert state is not None and state.ranks["world_size"] == 4  # any rank count resumes
    assert torch.equal(again[1].weight, model[1].weight)
