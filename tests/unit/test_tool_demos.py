"""Demonstrations of tool use for an SFT warm-up (rft_hpc/envs/tool_demos.py), per family: a
task's calls in the family's syntax, the tools' real results, the answer; token in and token
out as the explorer builds a trajectory, trained on the assistant's two turns only. And the
`products` and `lookup` task sources (rft_hpc/tasks/products.py, lookup.py) they are built
from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers.chat_models import chat_model
from transformers import AutoTokenizer

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.config.workflow import MultiTurnWorkflow
from rft_hpc.core.errors import UserError
from rft_hpc.envs.calculator import multiply
from rft_hpc.envs.codebook import lookup
from rft_hpc.envs.tool_demos import tool_demonstrations
from rft_hpc.tasks.lookup import LETTERS, lookup_tasks
from rft_hpc.tasks.products import product_tasks
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import tool_schema

PROMPT = PromptConfig(format="chat", tools=["rft_hpc.envs.calculator:multiply"])
WORKFLOW = MultiTurnWorkflow(env="answer", max_turns=2)
CALL = {"qwen2": '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                 "</tool_call>",
        "qwen3": '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                 "</tool_call>",
        "llama3": '{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}',
        "mistral": '[TOOL_CALLS] [{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}]'}


def never(task: Task, response: str) -> float:
    """A reward no answer earns."""
    return 0.0


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, stop) runs of 1 in a mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "mistral"])
def test_a_demonstration_trains_the_assistants_turns_only(tmp_path, family):
    tok = AutoTokenizer.from_pretrained(str(chat_model(tmp_path / family, family)))
    tasks, _ = product_tasks(3, train_size=5, eval_size=1, seed=0)
    records = tool_demonstrations(tasks, tok, PROMPT, WORKFLOW)
    eot = tok.decode(records[0].tokens[-1:])
    for task, record in zip(tasks, records, strict=True):
        args = task.info["tool_calls"][0]["arguments"]
        turns = [tok.decode(record.tokens[a:b]) for a, b in spans(record.response_mask)]
        assert turns == [CALL[family].format(**args) + eot, task.answer + eot]
        assert record.prompt_length == spans(record.response_mask)[0][0]
        # what comes between: the tool's real result, in the family's tool message
        between = tok.decode(record.tokens[spans(record.response_mask)[0][1]:
                                           spans(record.response_mask)[1][0]])
        assert str(multiply(**args)) in between
        assert len(record.tokens) <= 1024  # the tiny chat models' context
    if family in ("qwen2", "mistral", "llama3"):
        # token by token, the same text as the template renders for the whole conversation
        task, record = tasks[0], records[0]
        call = {"type": "function", "function": task.info["tool_calls"][0]}
        whole = tok.apply_chat_template(
            [{"role": "user", "content": task.prompt},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": task.answer},
             {"role": "assistant", "content": task.answer}],
            tools=[tool_schema(multiply)], tokenize=False)
        decoded = tok.decode(record.tokens)  # up to the policy's last end-of-turn token
        assert whole.startswith(decoded) and whole[len(decoded):] in ("", "\n")


def test_demonstrations_need_right_calls_and_answers(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(chat_model(tmp_path / "mistral", "mistral")))
    task = product_tasks(3, train_size=1, eval_size=1, seed=0)[0][0]
    with pytest.raises(UserError, match=r"info\.tool_calls"):
        tool_demonstrations([replace(task, info={})], tok, PROMPT, WORKFLOW)
    unknown = {"tool_calls": [{"name": "divide", "arguments": {"a": 1, "b": 2}}]}
    with pytest.raises(UserError, match="failed"):
        tool_demonstrations([replace(task, info=unknown)], tok, PROMPT, WORKFLOW)
    with pytest.raises(UserError, match="full reward"):
        tool_demonstrations([replace(task, reward="test_tool_demos:never")], tok, PROMPT,
                            WORKFLOW)


def test_a_task_without_calls_is_demonstrated_answering_at_once(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(chat_model(tmp_path / "mistral", "mistral")))
    prompt = PromptConfig(format="chat", tools=["rft_hpc.envs.codebook:lookup"])
    train, _ = lookup_tasks(4, train_size=40, eval_size=10, seed=3)
    train = [replace(t, info={"tool_calls": []}) if i % 4 else t for i, t in enumerate(train)]
    records = tool_demonstrations(train, tok, prompt, WORKFLOW)
    direct = [(t, r) for t, r in zip(train, records, strict=True) if not t.info["tool_calls"]]
    assert len(direct) == 30
    for task, record in direct:
        assert spans(record.response_mask) == [(record.prompt_length, len(record.tokens))]
        assert tok.decode(record.tokens[record.prompt_length:-1]) == task.answer
    called = next(r for t, r in zip(train, records, strict=True) if t.info["tool_calls"])
    assert len(spans(called.response_mask)) == 2


def test_lookup_tasks_hold_their_answers_in_the_tool():
    train, held_out = lookup_tasks(4, train_size=300, eval_size=100, seed=1)
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    assert lookup_tasks(4, train_size=300, eval_size=100, seed=1) == (train, held_out)
    for task in train + held_out:
        account = task.info["tool_calls"][0]["arguments"]["account"]
        assert 1000 <= account <= 9999
        assert task.prompt == f"What is the code of account {account}?"
        assert task.answer == lookup(account) and task.answer in LETTERS
        assert not set(task.prompt) & set(LETTERS)
    # every letter is a code; the default D about a third of the time, each other letter
    # about one time in 15
    train, _ = lookup_tasks(4, train_size=3000, eval_size=100, seed=1)
    share = {c: sum(t.answer == c for t in train) / len(train) for c in LETTERS}
    assert abs(share["D"] - 1 / 3) < 0.03
    assert all(abs(share[c] - 1 / 15) < 0.02 for c in LETTERS[1:])


def test_product_tasks_are_split_apart_and_repeatable():
    train, held_out = product_tasks(3, train_size=300, eval_size=100, seed=1)
    assert (len(train), len(held_out)) == (300, 100)
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    assert product_tasks(3, train_size=300, eval_size=100, seed=1) == (train, held_out)
    for task in train + held_out:
        args = task.info["tool_calls"][0]["arguments"]
        assert 100 <= args["a"] <= 999 and 100 <= args["b"] <= 999
        assert task.prompt == f"What is {args['a']}*{args['b']}?"
        assert task.answer == str(args["a"] * args["b"])


@pytest.mark.parametrize(("source", "space"), [({"type": "products", "digits": 1}, 100),
                                               ({"type": "lookup", "digits": 2}, 90)])
def test_the_generated_sources_are_configured_by_their_keys(source, space):
    config = ExperimentConfig.model_validate(
        {"tasks": {**source, "train_size": space - 10, "eval_size": 10}})
    train, held_out = build_tasks(config.tasks, seed=0)
    assert len(train) == space - 10 and len(held_out) == 10
    assert train[0].reward == "exact_match"
    too_many = config.tasks.model_copy(update={"train_size": space})
    with pytest.raises(UserError, match=r"tasks\.train_size"):
        build_tasks(too_many, seed=0)


def test_demonstrations_of_an_async_environment_are_refused_with_the_key():
    from rft_hpc.envs.tools import tool_env

    workflow = MultiTurnWorkflow(env="helpers.agent_envs:RemoteWait", max_turns=2)
    with pytest.raises(UserError, match=r"explorer\.workflow\.env .*async def"):
        tool_env(["rft_hpc.envs.calculator:multiply"], workflow, "hermes")
