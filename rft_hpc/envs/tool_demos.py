"""Demonstrations of tool use for an SFT warm-up: each task's solving calls played through
the tools, as the trajectory a multi-turn explorer would record had the policy made them.

A task names its calls in `info.tool_calls` (a list of `{"name", "arguments"}`, made in one
turn; the `lookup` and `products` task sources write them). Its demonstration is built token
in, token out, exactly as `rft_hpc.explorer.multiturn` builds a trajectory: the prompt (with the
tools' schemas), the assistant's turn (the calls in the family's syntax,
`tasks.tool_calls.format_tool_calls`, and its end-of-turn token), the template's closing of
that turn and the tool results rendered as the template's `tool` messages (what `ToolEnv`
answers, running the real tools), then the final answer turn (the task's answer and its
end-of-turn token). Mask 1 on the assistant's two turns only: the trainer learns to make the
calls and to answer from their results, never to write the prompt or the tools' results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rft_hpc.buffer.records import SFTSample
from rft_hpc.core.errors import UserError
from rft_hpc.envs.tools import ToolEnv, tool_env
from rft_hpc.tasks.chat_turns import ChatTurns
from rft_hpc.tasks.prompts import prompt_ids
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import ToolCall, format_tool_calls, tool_syntax

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rft_hpc.config.prompt import PromptConfig
    from rft_hpc.config.workflow import MultiTurnWorkflow


def demo_calls(task: Task) -> list[ToolCall]:
    """The calls of `task`'s demonstration (`info.tool_calls`; an empty list: none, the
    demonstration answers at once); UserError naming the task when they are missing or not
    `{"name": str, "arguments": {...}}` objects."""
    raw: Any = task.info.get("tool_calls")
    if not isinstance(raw, list):
        raise UserError(f"task {task.task_id}: data source tasks with prompt.tools build "
                        "demonstrations of tool use from each task's info.tool_calls (a "
                        "list of {name, arguments}), which this task lacks")
    calls = []
    for call in raw:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), dict)):
            raise UserError(f"task {task.task_id}: info.tool_calls holds {call!r}, not "
                            "{name: str, arguments: {...}}")
        calls.append(ToolCall(call["name"], dict(call["arguments"])))
    return calls


def tool_demonstrations(tasks: Sequence[Task], tokenizer: PreTrainedTokenizerBase,
                        prompt: PromptConfig, workflow: MultiTurnWorkflow) -> list[SFTSample]:
    """One SFT sample per task: its demonstration (module docstring), with mask 1 on
    exactly the assistant's tokens (its call turn and its answer turn, each end-of-turn
    token included; a task whose `info.tool_calls` is empty: the answer turn alone, right
    after the prompt). UserError when a task's calls fail (an unknown tool, one that raises)
    or its answer does not earn the task's full reward: a demonstration must be right."""
    chat = ChatTurns(tokenizer)
    env = tool_env(prompt.tools, workflow, tool_syntax(tokenizer))
    return [_demonstration(task, tokenizer, prompt, chat, env) for task in tasks]


def _demonstration(task: Task, tokenizer: PreTrainedTokenizerBase, prompt: PromptConfig,
                   chat: ChatTurns, env: ToolEnv) -> SFTSample:
    first = env.reset(task, 0)
    tokens = prompt_ids(tokenizer, replace(task, prompt=first, messages=None), prompt)
    mask, prompt_length = [0] * len(tokens), len(tokens)

    def add(ids: list[int], trained: int) -> None:
        tokens.extend(ids)
        mask.extend([trained] * len(ids))

    calls = demo_calls(task)
    if calls:
        text = format_tool_calls(calls, env.syntax)
        turn = [*_ids(tokenizer, text), chat.end_of_turn]
        add(turn, 1)
        results = env.step(text)
        failed = {k: n for k, n in results.counts.items() if k != "tool_calls" and n}
        if failed or not isinstance(results.observation, list):
            raise UserError(f"task {task.task_id}: its info.tool_calls failed ({failed}): "
                            f"{results.observation!r}")
        add(chat.close_turn(turn) + chat.messages(results.observation), 0)
    add([*_ids(tokenizer, task.answer), chat.end_of_turn], 1)
    if env.step(task.answer).reward < 1.0:
        raise UserError(f"task {task.task_id}: its answer {task.answer!r} does not earn the "
                        "task's full reward: no demonstration can be built")
    return SFTSample(tokens, prompt_length, response_mask=mask, task_id=task.task_id,
                     taskset=task.taskset, info={"tool_calls": len(calls)})


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
