"""Held-out evaluation of tool tasks (rft_hpc/eval/tool_trajectories.py): each task's
workflow played greedily with the tools, success by the trajectory's reward, the tool calls
counted. The policy here is the tiny Mistral chat model's engine answering from a script
(its tokens are the engine's own tokenizer's), so that right and wrong trajectories are
known: the evaluation must score them so, and its turns must be token for token those of
the SFT demonstrations (rft_hpc/envs/tool_demos.py) of the same tasks."""

from __future__ import annotations

import math

from helpers.chat_models import chat_model

from rft_hpc.config import ExperimentConfig
from rft_hpc.engines.hf import HFEngine
from rft_hpc.engines.requests import Completion
from rft_hpc.envs.tool_demos import tool_demonstrations
from rft_hpc.eval.tool_trajectories import plays_tools, tool_task_scores
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import ToolCall, format_tool_calls

CONFIG = {"tasks": {"type": "products", "train_size": 5, "eval_size": 7},
          "prompt": {"format": "chat", "tools": ["rft_hpc.envs.calculator:multiply"]},
          "explorer": {"workflow": {"type": "multi_turn", "env": "answer", "max_turns": 2}},
          "eval": {"batch_size": 3, "max_new_tokens": 80}}


class Scripted:
    """The engine, except that `generate` answers each task's opening with its call (task 5
    with a malformed one) and what follows with the answer (tasks 1 and 3: a wrong one),
    each ending with the end-of-turn token; it records every prompt it was given."""

    def __init__(self, engine: HFEngine, tasks: list[Task]) -> None:
        self.engine, self.tasks, self.seen = engine, tasks, []
        self.openings = [engine.prompt_ids(t) for t in tasks]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, *, n, max_new_tokens, temperature, seed):
        assert n == 1 and temperature == 0.0
        out = []
        for prompt in prompts:
            self.seen.append(list(prompt))
            i = next(i for i, o in enumerate(self.openings) if list(prompt[:len(o)]) == o)
            task = self.tasks[i]
            if len(prompt) == len(self.openings[i]):
                call = ToolCall("multiply", task.info["tool_calls"][0]["arguments"])
                text = format_tool_calls([call], "mistral")
                text = text[:-3] if i == 5 else text
            else:
                text = "0" if i in (1, 3) else task.answer
            tokens = self.engine.plain_tokens(text) + self.engine.stop_ids[:1]
            out.append([Completion(tokens, [0.0] * len(tokens), text, True)])
        return out


def test_tool_tasks_are_scored_by_their_greedy_trajectories(tmp_path):
    config = ExperimentConfig.model_validate(CONFIG)
    assert plays_tools(config)
    assert not plays_tools(config.model_copy(update={"prompt": config.prompt.model_copy(
        update={"tools": []})}))
    _, tasks = build_tasks(config.tasks, seed=0)
    engine = HFEngine(chat_model(tmp_path / "mistral", "mistral"), prompt=config.prompt)
    scripted = Scripted(engine, tasks)
    answers: list[dict] = []
    scores = tool_task_scores(scripted, tasks, config, answers)
    # 7 tasks: 1 and 3 answered wrong; 5 made a call that cannot be read, was answered
    # with the error, and then answered right
    assert scores["eval_accuracy"] == 5 / 7 and scores["eval_reward"] == 5 / 7
    assert scores["eval_tool_calls"] == 1.0 and scores["eval_reward_errors"] == 0.0
    assert math.isclose(scores["eval_tool_success_rate"], 6 / 7)
    assert math.isclose(scores["eval_malformed_rate"], 1 / 7)
    assert [a["task_id"] for a in answers] == [t.task_id for t in tasks]
    assert [a["reward"] for a in answers] == [0.0 if i in (1, 3) else 1.0
                                              for i in range(7)]
    assert answers[0]["answer"] == tasks[0].answer and len(answers[0]["actions"]) == 2
    assert answers[5]["malformed_calls"] == 1 and answers[5]["answer"] == tasks[5].answer
    # each right trajectory's answer turn was asked in exactly the demonstration's context
    demos = tool_demonstrations(tasks, engine.tokenizer, config.prompt,
                                config.explorer.workflow)
    for i, demo in enumerate(demos):
        answer_turn = len(demo.tokens) - len(engine.plain_tokens(tasks[i].answer)) - 1
        if i != 5:
            assert demo.tokens[:answer_turn].tolist() in scripted.seen


def test_no_tasks_score_nan(tmp_path):
    config = ExperimentConfig.model_validate({**CONFIG, "eval": {"k": 2}})
    scores = tool_task_scores(HFEngine(chat_model(tmp_path / "m", "mistral"),
                                       prompt=config.prompt), [], config)
    assert all(math.isnan(v) for v in scores.values()) and "eval_pass@2" in scores
