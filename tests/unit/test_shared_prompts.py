"""Rows that share a prompt, packed into one sequence (rft_hpc.batch.shared_prompts): the
model's logits at every trained position are those of the padded rows, and a trainer step
with `trainer.share_prompts` on gives the loss, metrics and weights it gives with it off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rft_hpc.batch.shared_prompts import pack_shared_prompts
from rft_hpc.batch.tokens import TokenBatch, collate, collate_dpo
from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import DPOPair, Experience, SFTSample
from rft_hpc.config import load_config
from rft_hpc.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer tiny Qwen2 chat model (the CPU recipe's), built locally."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2",
                                                                           num_layers=2))


def groups(rng: np.random.Generator, sizes: list[int], prompt: int, reply: int,
           ) -> list[Experience]:
    """Rollouts: `sizes[g]` of them for prompt g (`prompt` + g tokens), replies of
    1..`reply` tokens, so rows of a group differ in length."""
    records = []
    for g, size in enumerate(sizes):
        head = rng.integers(5, 250, prompt + g)
        for _ in range(size):
            tail = rng.integers(5, 250, int(rng.integers(1, reply + 1)))
            records.append(Experience(np.concatenate([head, tail]), len(head),
                                      reward=float(rng.random()), group_id=g))
    return records


def padded_logits(model: torch.nn.Module, tb: TokenBatch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tb.input_ids, attention_mask=tb.attention_mask,
                     use_cache=False).logits


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_get_their_padded_logits(qwen2: Path, attention: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2, attn_implementation=attention).eval()
    rng = np.random.default_rng(0)
    records = [*groups(rng, [4, 3, 1], prompt=40, reply=12),
               SFTSample(rng.integers(5, 250, 30), prompt_length=20)]
    tb = collate(records, pad_id=0)
    packed = pack_shared_prompts(tb, hidden_size=model.config.hidden_size)
    assert packed is not None
    # three prompts and an SFT row: four sequences, each prompt's tokens once
    assert packed.input_ids.shape[0] == 4
    with torch.no_grad():
        out = packed.unpack(model(**packed.model_inputs(attention), use_cache=False).logits)
    expected = padded_logits(model, tb)
    trained = tb.loss_mask.bool()  # position j scores token j + 1: compare the scored ones
    assert out.shape == expected.shape
    gap = (out[:, :-1][trained] - expected[:, :-1][trained]).abs().max()
    assert gap < 1e-4, float(gap)
    assert expected[:, :-1][trained].abs().max() > 0.1  # the logits compared are not all 0


def test_rows_that_share_nothing_stay_padded(qwen2: Path) -> None:
    rng = np.random.default_rng(1)
    alone = collate(groups(rng, [1, 1, 1], prompt=30, reply=5), pad_id=0)
    assert pack_shared_prompts(alone, hidden_size=64) is None
    # a group of two whose replies dwarf the prompt: packing saves too little to take
    long_replies = collate(groups(rng, [2], prompt=2, reply=60), pad_id=0)
    assert pack_shared_prompts(long_replies, hidden_size=64) is None


def dpo_pairs(rng: np.random.Generator) -> list[DPOPair]:
    pairs = []
    for _ in range(3):
        prompt = rng.integers(5, 250, 40)
        pairs.append(DPOPair(np.concatenate([prompt, rng.integers(5, 250, 6)]),
                             np.concatenate([prompt, rng.integers(5, 250, 9)]), len(prompt)))
    return pairs


@pytest.mark.parametrize("algorithm", [
    {"algorithm_type": "grpo", "kl_loss_fn": "k3"},  # the reference's pass is packed too
    {"algorithm_type": "dpo"},
])
def test_a_step_with_shared_prompts_is_the_step_without(tmp_path: Path, qwen2: Path,
                                                        algorithm: dict) -> None:
    rng = np.random.default_rng(2)
    records = (dpo_pairs(rng) if algorithm["algorithm_type"] == "dpo"
               else groups(rng, [4, 4, 3], prompt=60, reply=10))
    assert pack_shared_prompts((collate_dpo if algorithm["algorithm_type"] == "dpo"
                                else collate)(records, pad_id=0), hidden_size=64)
    results = []
    for share in (True, False):
        path = tmp_path / f"share-{share}.yaml"
        path.write_text(yaml.safe_dump({
            "run": {"root": str(tmp_path), "seed": 0}, "model": {"path": str(qwen2)},
            "tasks": {"type": "arithmetic", "digits": 1, "eval_size": 8},
            "algorithm": algorithm,
            "trainer": {"lr": 1e-3, "threads": 1, "share_prompts": share}}))
        trainer = Trainer(load_config(path))
        assert (trainer.attention is not None) == share
        start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        metrics = trainer.step(Batch(records=list(records), weights=[1.0] * len(records),
                                     uses=[0] * len(records)), version=0)
        update = torch.cat([(v.detach() - start[k]).flatten()
                            for k, v in trainer.model.state_dict().items()])
        results.append((metrics, update))
    (shared, step_shared), (padded, step_padded) = results
    for key in ("loss", "tokens", "grad_norm", "kl_ref", "dpo_loss"):
        if key in padded:
            assert shared[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert shared["grad_norm"] > 0
    # Adam divides each gradient by its own size: the updates of near-zero gradients carry
    # their float noise, so the whole update is compared, not each weight
    assert step_padded.norm() > 0
    assert (step_shared - step_padded).norm() < 1e-3 * step_padded.norm()
