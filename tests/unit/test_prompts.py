"""Prompt formats: raw text and chat templates build the same token ids for explorer,
trainer and evaluation; generation stops at the template's end-of-turn token; the trainer's
recomputed log-probs of chat rollouts equal the engine's, per model family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.chat_models import chat_model, end_of_turn_id
from helpers.explore import explore_step
from pydantic import ValidationError

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.offline import task_records
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.tasks.prompts import chat_messages, model_stop_ids, prompt_ids
from rft_hpc.tasks.task import Task

CHAT = PromptConfig(format="chat", system_prompt="Answer with a number.")
TASKS = [Task("m0", messages=[{"role": "user", "content": "What is 12+30?"}], answer="42"),
         Task("p1", prompt="What is 2+2?", answer="4"),
         Task("m2", messages=[{"role": "system", "content": "Be terse."},
                              {"role": "user", "content": "7*6?"}], answer="42")]


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen3", "mistral"])
def family(request, tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp(f"chat-{request.param}"), request.param)


@pytest.fixture(scope="module")
def llama_chat(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("chat-llama"), "llama")


def test_chat_prompt_is_the_templates_own_tokens(llama_chat):
    engine = HFEngine(llama_chat, prompt=CHAT)
    tok = engine.tokenizer
    ids = engine.prompt_ids(TASKS[0])
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Answer with a number."},
         {"role": "user", "content": "What is 12+30?"}], tokenize=False,
        add_generation_prompt=True)
    assert tok.decode(ids) == expected
    assert ids == list(tok(expected, add_special_tokens=False)["input_ids"])
    assert tok.decode(engine.prompt_ids(TASKS[1])).count("<|im_start|>user\nWhat is 2+2?") == 1
    # a task's own system message is kept, the configured one not added
    assert tok.decode(engine.prompt_ids(TASKS[2])).count("system") == 1
    no_gen = PromptConfig(format="chat", add_generation_prompt=False)
    assert not tok.decode(prompt_ids(tok, TASKS[1], no_gen)).endswith("assistant\n")


def test_raw_prompt_and_bad_settings(llama_chat, tiny_model):
    engine = HFEngine(llama_chat)
    assert engine.prompt_ids(TASKS[1]) == engine.encode("What is 2+2?")
    with pytest.raises(UserError, match=r"prompt\.format: chat"):
        engine.prompt_ids(TASKS[0])
    with pytest.raises(ValidationError, match="system_prompt needs format: chat"):
        PromptConfig(system_prompt="hi")
    plain = HFEngine(tiny_model, prompt=CHAT)  # the arithmetic tokenizer has no template
    with pytest.raises(UserError, match="no chat template"):
        plain.prompt_ids(TASKS[1])


def test_stop_tokens_of_a_chat_model(llama_chat):
    end = end_of_turn_id(llama_chat)
    engine = HFEngine(llama_chat, prompt=CHAT)
    eos = engine.tokenizer.eos_token_id
    assert engine.stop_ids == [end, eos] == model_stop_ids(llama_chat, engine.tokenizer, CHAT)
    assert HFEngine(llama_chat).stop_ids == [eos, end]


def _swap_rows(engine: HFEngine, a: int, b: int) -> None:
    """Exchange two tokens' output rows: the model now says `b` wherever it said `a`."""
    with torch.no_grad():
        w = engine.model.lm_head.weight
        w[[a, b]] = w[[b, a]]


def test_generation_stops_at_end_of_turn(tmp_path):
    folder = chat_model(tmp_path / "chat", "llama")
    engine = HFEngine(folder, prompt=CHAT)
    end = end_of_turn_id(folder)
    prompt = engine.prompt_ids(TASKS[1])
    free = engine.generate([prompt], n=1, max_new_tokens=12, temperature=0.0, seed=0)[0][0]
    assert end not in free.tokens and not free.finished
    # the first token the greedy answer had not said before, from the second on
    i = next(i for i in range(1, 12) if free.tokens[i] not in free.tokens[:i])
    _swap_rows(engine, free.tokens[i], end)
    stopped = engine.generate([prompt], n=1, max_new_tokens=12, temperature=0.0, seed=0)[0][0]
    assert stopped.tokens == [*free.tokens[:i], end] and stopped.finished
    assert stopped.text == engine.tokenizer.decode(free.tokens[:i])


def test_trainer_logprobs_equal_the_engines_on_chat_rollouts(family):
    engine = HFEngine(family, prompt=CHAT)
    tasks = list(TASKS)
    settings = SamplingSettings(repeat=4, max_new_tokens=24, temperature=0.8)
    experiences, _ = explore_step(engine, tasks, settings, first_group_id=0, step=1, seed=3)
    tok = engine.tokenizer
    for task, exp in zip([t for t in tasks for _ in range(4)], experiences, strict=True):
        templated = tok.apply_chat_template(chat_messages(task, CHAT), tokenize=True,
                                            add_generation_prompt=True, return_dict=True)
        assert list(exp.tokens[:exp.prompt_length]) == list(templated["input_ids"])
    generation_eos = engine.model.generation_config.eos_token_id
    assert set(engine.stop_ids) >= set([generation_eos] if isinstance(generation_eos, int)
                                       else generation_eos)
    batch = collate(experiences, pad_id=engine.pad_id)
    with torch.no_grad():
        recomputed = token_logprobs(engine.model, batch, temperature=0.8)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 0
    np.testing.assert_allclose(recomputed[mask].numpy(), batch.old_logprobs[mask].numpy(),
                               atol=2e-5)


def test_sft_records_use_the_same_prompt_and_end_of_turn(llama_chat):
    engine = HFEngine(llama_chat, prompt=CHAT)
    records = task_records(TASKS, engine.tokenizer, "sft", prompt_format=CHAT,
                           stop_ids=engine.stop_ids)
    for task, record in zip(TASKS, records, strict=True):
        prompt = engine.prompt_ids(task)
        assert list(record.tokens[:record.prompt_length]) == prompt
        assert list(record.tokens[record.prompt_length:]) == [
            *engine.tokenizer(task.answer, add_special_tokens=False)["input_ids"],
            end_of_turn_id(llama_chat)]
