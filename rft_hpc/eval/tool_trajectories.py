"""Held-out evaluation of tool tasks: each task's multi-turn workflow played greedily with
the tools, its success the trajectory's reward (a multi-turn workflow with `prompt.tools`;
docs/agents.md).

A trajectory is built as the explorer builds one (`rft_hpc.explorer.multiturn`, token in and
token out through `tasks.chat_turns`, the tools run by the same `ToolEnv`, a turn that would
not fit in the model's context ends it), with the differences evaluation asks for: decoding
is greedy, one trajectory per task, and the trajectories of `eval.batch_size` tasks advance
in lockstep, one engine call per turn for all of them. The environments run in this process
(a tool call still has its `tool_timeout`): evaluation's tools are the run's own, and a
worker process per task would cost more than the tasks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rft_hpc.config.schema import ExperimentConfig
from rft_hpc.config.workflow import MultiTurnWorkflow
from rft_hpc.engines.protocol import InferenceEngine
from rft_hpc.envs.tools import ToolEnv, tool_env
from rft_hpc.eval.scoring import CORRECT
from rft_hpc.tasks.chat_turns import ChatTurns
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import tool_syntax


def plays_tools(config: ExperimentConfig) -> bool:
    """Whether held-out tasks are scored by playing the workflow with tools (chat prompts,
    `prompt.tools` and a multi-turn workflow) rather than by one answer each."""
    return (config.prompt.format == "chat" and bool(config.prompt.tools)
            and isinstance(config.explorer.workflow, MultiTurnWorkflow))


@dataclass
class _Play:
    env: ToolEnv
    tokens: list[int]
    reward: float = 0.0
    done: bool = False
    errors: int = 0
    actions: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


def tool_task_scores(engine: InferenceEngine, tasks: Sequence[Task], config: ExperimentConfig,
                     answers: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """The trainer's held-out metrics of `tasks` played greedily with the tools:
    `eval_accuracy` (trajectories whose reward is at least 1), `eval_reward` (their mean
    reward), `eval_reward_errors` (environment steps that raised: the trajectory ends, its
    reward as it stood), and the tool counts per task: `eval_tool_calls`,
    `eval_tool_success_rate` (calls answered with a result) and `eval_malformed_rate`.
    `eval.k` samples are not drawn (NaN). Each task's trajectory is appended to `answers`
    when given, in task order: `{"task_id", "answer"` (its last turn), `"reward", "actions",
    "tool_calls", "malformed_calls"}`. The same weights score the same."""
    settings = config.eval
    keys = ["accuracy", "reward", "reward_errors", "tool_calls", "tool_success_rate",
            "malformed_rate"]
    nan = {f"eval_mean@{settings.k}": float("nan"),
           f"eval_pass@{settings.k}": float("nan")} if settings.k else {}
    if not tasks:
        return {**{f"eval_{key}": float("nan") for key in keys}, **nan}
    workflow = config.explorer.workflow
    assert isinstance(workflow, MultiTurnWorkflow), "plays_tools(config) was not checked"
    chat = ChatTurns(engine.tokenizer)
    plays: list[_Play] = []
    for i in range(0, len(tasks), settings.batch_size):
        plays += _play(engine, chat, tasks[i:i + settings.batch_size], config, workflow)
    totals: Counter[str] = sum((p.counts for p in plays), Counter())
    calls = totals["tool_calls"]
    failed = totals["tool_errors"] + totals["tool_timeouts"] + totals["malformed_calls"]
    scores = {"accuracy": sum(p.reward >= CORRECT for p in plays) / len(plays),
              "reward": sum(p.reward for p in plays) / len(plays),
              "reward_errors": float(sum(p.errors for p in plays)),
              "tool_calls": calls / len(plays),
              "tool_success_rate": (calls - failed) / calls if calls else float("nan"),
              "malformed_rate": totals["malformed_calls"] / calls if calls else float("nan")}
    if answers is not None:
        answers += [{"task_id": t.task_id, "answer": p.actions[-1] if p.actions else "",
                     "reward": p.reward, "actions": p.actions,
                     "tool_calls": p.counts["tool_calls"],
                     "malformed_calls": p.counts["malformed_calls"]}
                    for t, p in zip(tasks, plays, strict=True)]
    return {**{f"eval_{key}": float(value) for key, value in scores.items()}, **nan}


def _play(engine: InferenceEngine, chat: ChatTurns, tasks: Sequence[Task],
          config: ExperimentConfig, workflow: MultiTurnWorkflow) -> list[_Play]:
    """Greedy trajectories of `tasks`, advanced together turn by turn."""
    plays = []
    syntax = tool_syntax(engine.tokenizer)
    for task in tasks:
        env = tool_env(config.prompt.tools, workflow, syntax)
        first = env.reset(task, config.run.seed)
        plays.append(_Play(env, engine.prompt_ids(replace(task, prompt=first, messages=None))))
    budget = config.eval.max_new_tokens
    limit = engine.context_limit()
    active = list(range(len(plays)))
    for turn in range(workflow.max_turns):
        if limit is not None:  # a turn that cannot fit in the model's context ends it
            active = [i for i in active if len(plays[i].tokens) + budget <= limit]
        if not active:
            break
        groups = engine.generate([plays[i].tokens for i in active], n=1,
                                 max_new_tokens=budget, temperature=0.0, seed=config.run.seed)
        for i, (completion,) in zip(active, groups, strict=True):
            play = plays[i]
            play.tokens += completion.tokens
            action = _action_text(engine, chat, completion.tokens)
            play.actions.append(action)
            try:
                result = play.env.step(action)
            except Exception:  # a reward or environment that fails on this answer: it ends
                play.errors += 1
                play.done = True
                continue
            play.reward += result.reward
            play.counts.update(result.counts)
            play.done = result.done
            if not result.done and turn + 1 < workflow.max_turns:
                observation = result.observation
                messages = observation if isinstance(observation, list) else [
                    {"role": "user", "content": observation}]
                play.tokens += chat.close_turn(completion.tokens) + chat.messages(messages)
        active = [i for i in active if not plays[i].done]
    return plays


def _action_text(engine: InferenceEngine, chat: ChatTurns, tokens: Sequence[int]) -> str:
    """What the tools are given of a turn, as the explorer gives it: the text with special
    tokens kept (a family's call marker may be one), the end-of-turn token left out."""
    kept = list(tokens[:-1] if tokens and tokens[-1] == chat.end_of_turn else tokens)
    return engine.tokenizer.decode(kept, skip_special_tokens=False)
