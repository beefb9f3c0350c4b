"""Tool use in multi-turn chat (envs/tools.py, `prompt.tools`): the policy's calls run as
Python functions and come back as tool messages in its family's format; unknown tools,
raising and hanging tools and malformed calls are answered with an error and counted; a turn
without a call is the answer, scored by the task's reward. Per family, a run whose policy
calls a tool keeps its turns as sampled (mask 1) and everything else at mask 0."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers.chat_models import chat_model

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import Experience
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.engines.requests import Completion, FinishedGroup
from rft_hpc.envs.tools import ToolEnv
from rft_hpc.explorer.multiturn import TurnSettings
from rft_hpc.explorer.overrollout import MultiTurnExplorer
from rft_hpc.tasks.task import Task

TOOLS = ["test_tool_use:add", "test_tool_use:broken", "test_tool_use:slow"]
CALLS = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>',
         "llama3": '{"name": "add", "parameters": {"a": 40, "b": 2}}',
         "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 40, "b": 2}}]'}


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: A.
        b: B.
    """
    return a + b


def broken(a: int) -> int:
    """Always fails.

    Args:
        a: A number.
    """
    raise ValueError(f"no {a}")


def slow(a: int) -> int:
    """Takes too long.

    Args:
        a: A number.
    """
    time.sleep(5)
    return a


def test_calls_run_and_every_failure_is_answered_and_counted():
    env = ToolEnv(TOOLS, "hermes", call_timeout=0.5)
    task = Task("t", prompt="What is 40+2?", answer="42", reward="math_verify")
    assert env.reset(task, seed=0) == "What is 40+2?"
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format
    result = env.step(call("add", '{"a": 40, "b": 2}') + call("nope", "{}")
                      + call("broken", '{"a": 1}') + call("slow", '{"a": 1}')
                      + "<tool_call>{bad json</tool_call>")
    assert not result.done and result.reward == 0.0
    contents = [m["content"] for m in result.observation]
    assert all(m["role"] == "tool" for m in result.observation)
    assert contents[0].startswith("error: malformed tool call (not JSON")
    assert contents[1] == "42"
    assert contents[2].startswith("error: unknown tool 'nope'; tools: add, broken, slow")
    assert contents[3] == "error: ValueError: no 1"
    assert contents[4] == "error: slow timed out after 0.5 s"
    assert result.counts == {"tool_calls": 5, "malformed_calls": 1, "tool_errors": 2,
                             "tool_timeouts": 1}
    answer = env.step("The answer is 42.")  # no call: the answer, scored by the task
    assert answer.done and answer.reward == 1.0 and answer.counts == {}


class ScriptedFirstTurn:
    """The engine, except that the turn after the prompt `opening` is `first` (tokenized, as
    if sampled, with the engine's own log-probs of those tokens); later turns are sampled."""

    def __init__(self, engine: HFEngine, first: str, opening: list[int]) -> None:
        self.engine, self.first, self.opening = engine, first, opening
        self.scripted: list = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests):
        self.scripted += [r for r in requests if list(r.prompt) == self.opening]
        self.engine.submit([r for r in requests if list(r.prompt) != self.opening])

    @property
    def in_flight(self):
        return len(self.scripted) + self.engine.in_flight

    def poll(self):
        scripted, self.scripted = self.scripted, []
        return [FinishedGroup(r.key, [self.script(r.temperature)]) for r in scripted] \
            + self.engine.poll()

    def script(self, temperature):
        p = self.opening
        tokens = self.engine.plain_tokens(self.first) + self.engine.stop_ids[:1]
        record = Experience(tokens=np.asarray(list(p) + tokens, np.int32), prompt_length=len(p),
                            response_mask=np.asarray([0] * len(p) + [1] * len(tokens), np.uint8),
                            logprobs=np.zeros(len(p) + len(tokens), np.float32), reward=0.0,
                            task_id="x", group_id=0)
        batch = collate([record], pad_id=self.engine.pad_id)
        with torch.no_grad():
            lp = token_logprobs(self.engine.model, batch, temperature=temperature)
        row = lp[0][batch.loss_mask[0].bool()].tolist()
        return Completion(list(tokens), row, self.first, True)


@pytest.mark.parametrize(("family", "syntax"), [("qwen2", "hermes"), ("llama3", "llama3"),
                                                ("mistral", "mistral")])
def test_a_policy_that_calls_a_tool_gets_the_result_in_its_familys_format(
        tmp_path, family, syntax):
    prompt = PromptConfig(format="chat", tools=TOOLS[:1])
    engine = HFEngine(chat_model(tmp_path / family, family), prompt=prompt)
    tok = engine.tokenizer
    opening = engine.prompt_ids(Task("x", prompt="What is 40+2?"))
    # the tool's schema, from its docstring (short: Llama 3's prompt of it fills most of the
    # tiny model's 1024 positions, byte by byte)
    assert '"description": "A."' in tok.decode(opening)
    workflow = MultiTurnWorkflow(env="answer", max_turns=2, max_timeout=30.0)
    mt = MultiTurnExplorer(ScriptedFirstTurn(engine, CALLS[syntax], opening), workflow,
                           TurnSettings(repeat=2, max_new_tokens=4, temperature=1.0),
                           OverRolloutConfig())
    tasks = [Task("t0", prompt="What is 40+2?", answer="42")]
    records, metrics = mt.run_step(tasks, first_group_id=0, step=0, seed=5)
    assert len(records) == 2
    assert metrics["tools/tool_calls"] == 2 and metrics["tools/success_rate"] == 1.0
    for r in records:
        assert r.info["tool_calls"] == 1 and r.info["turns"] == 2
        tokens, mask = r.tokens.tolist(), r.response_mask
        call = engine.plain_tokens(CALLS[syntax]) + engine.stop_ids[:1]
        start = r.prompt_length
        assert tokens[start:start + len(call)] == call and mask[start:start + len(call)].all()
        result = tok.decode(tokens[start + len(call):])
        assert {"hermes": "<tool_response>\n42\n</tool_response>", "llama3": "ipython",
                "mistral": '[TOOL_RESULTS] {"content": "42"}'}[syntax] in result
        # the policy's second turn is sampled after the result, at mask 1; the rest is 0
        second = np.flatnonzero(mask[start + len(call):])
        assert len(second) > 0 and mask[start + len(call):].sum() == len(second)
    # the trainer's recomputed log-probs equal the engine's on every policy token
    batch = collate(records, pad_id=engine.pad_id)
    with torch.no_grad():
        recomputed = token_logprobs(engine.model, batch, temperature=1.0)
    policy = batch.loss_mask.bool()
    assert int(policy.sum()) == sum(int(r.response_mask.sum()) for r in records)
    np.testing.assert_allclose(recomputed[policy].numpy(), batch.old_logprobs[policy].numpy(),
                               atol=2e-5)


def test_the_report_plots_the_tool_call_rates(tmp_path):
    import json
    import struct

    from rft_hpc.core.rundir import RunDir
    from rft_hpc.run.summary import write_report

    metrics = tmp_path / "stages" / "0-main" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "trainer.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    rows = [{"step": s, "tools/success_rate": 0.5, "tools/malformed_rate": 0.25}
            for s in range(3)]
    (metrics / "explorer-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = write_report(RunDir(tmp_path), [{"name": "main", "trainer_steps": 1}]).read_bytes()
    assert struct.unpack(">I", png[16:20])[0] == 1600  # three panels: the third, tool calls
    (metrics / "explorer-0.jsonl").write_text("")
    png = write_report(RunDir(tmp_path), [{"name": "main", "trainer_steps": 1}]).read_bytes()
    assert struct.unpack(">I", png[16:20])[0] == 1100
