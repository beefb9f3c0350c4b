"""Tool use as an environment. The policy's turn is read for tool calls in its family's
syntax (`rft_hpc.tasks.tool_calls`); each call runs as the Python function `prompt.tools`
names, within `call_timeout` seconds, and its result, or why it failed, comes back as a
`tool` message. A turn without a call goes to the environment the tools wrap (by default
`answer`: the turn is the policy's answer, scored by the task's reward).

The calls run in the environment's host process (`rft_hpc.envs.host`), each in a thread
of its own: a call past its time is answered with an error and left behind (the worker is
killed when the task's attempt ends or overruns `max_timeout`, which a hung call cannot
outlive). Each turn counts `tool_calls`, `tool_errors` (unknown tool, raised), `tool_timeouts`
and `malformed_calls` (unreadable, answered with the reason; counted in `tool_calls` too).
Around an `async def` environment the wrapper is `AsyncToolEnv`, whose tools may be
`async def` too (an HTTP call).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rft_hpc.envs.base import Environment, Message, StepResult, build_env
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import ParsedTurn, Syntax, ToolCall, load_tool, parse_tool_calls

if TYPE_CHECKING:
    from rft_hpc.config.workflow import MultiTurnWorkflow


class ToolEnv(Environment):
    """Runs the policy's tool calls; hands its other turns to the wrapped environment."""

    def __init__(self, tools: list[str], syntax: Syntax, env: str = "answer",
                 env_args: dict[str, object] | None = None, call_timeout: float = 10.0) -> None:
        self.tools: dict[str, Callable[..., Any]] = {
            spec.rpartition(":")[2]: load_tool(spec) for spec in tools}
        self.syntax = syntax
        self.env = build_env(env, env_args or {})
        self.call_timeout = call_timeout

    def reset(self, task: Task, seed: int) -> str:
        """The wrapped environment's first observation."""
        return self.env.reset(task, seed)

    def step(self, action: str) -> StepResult:
        """The calls' results as tool messages (reward 0, not done), or, for a turn
        without a call, the wrapped environment's step."""
        turn = parse_tool_calls(action, self.syntax)
        if not turn.calls and not turn.malformed:
            return self.env.step(action)
        return _results(turn, [self._run(call) for call in turn.calls])

    def _run(self, call: ToolCall) -> tuple[str, str | None]:
        """A call's result as text, and what went wrong (a count's name) or None."""
        fn = self.tools.get(call.name)
        if fn is None:
            return (f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}",
                    "tool_errors")
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn(**call.arguments)
            except Exception as exc:  # the tool's fault is the policy's answer, not ours
                result["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=run, daemon=True, name=f"tool-{call.name}")
        thread.start()
        thread.join(self.call_timeout)
        if thread.is_alive():
            return f"error: {call.name} timed out after {self.call_timeout:g} s", "tool_timeouts"
        if "error" in result:
            return f"error: {result['error']}", "tool_errors"
        value = result.get("value")
        return (value if isinstance(value, str) else json.dumps(value, default=str)), None


class AsyncToolEnv(ToolEnv):
    """`ToolEnv` around an `async def` environment (it shares the explorer's one host
    process): the calls of a turn run at once, an `async def` tool as a coroutine, a plain
    one in a thread, each within `call_timeout` seconds."""

    async def reset(self, task: Task, seed: int) -> str:  # type: ignore[override]
        """The wrapped environment's first observation."""
        return await self.env.reset(task, seed)  # type: ignore[misc]

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        """As `ToolEnv.step`."""
        turn = parse_tool_calls(action, self.syntax)
        if not turn.calls and not turn.malformed:
            return await self.env.step(action)  # type: ignore[misc]
        return _results(turn, await asyncio.gather(*(self._run_async(c) for c in turn.calls)))

    async def _run_async(self, call: ToolCall) -> tuple[str, str | None]:
        fn = self.tools.get(call.name)
        if fn is None or not inspect.iscoroutinefunction(fn):
            return await asyncio.to_thread(self._run, call)  # the thread keeps the time limit
        try:
            value = await asyncio.wait_for(fn(**call.arguments), self.call_timeout)
        except TimeoutError:
            return f"error: {call.name} timed out after {self.call_timeout:g} s", "tool_timeouts"
        except Exception as exc:  # the tool's fault is the policy's answer, not ours
            return f"error: {type(exc).__name__}: {exc}", "tool_errors"
        return (value if isinstance(value, str) else json.dumps(value, default=str)), None


def _results(turn: ParsedTurn, outcomes: list[tuple[str, str | None]]) -> StepResult:
    """A turn's tool messages (malformed calls first, then each call's result in order) and
    its counts."""
    counts = {"tool_calls": len(turn.calls) + len(turn.malformed),
              "malformed_calls": len(turn.malformed), "tool_errors": 0, "tool_timeouts": 0}
    messages: list[Message] = [
        {"role": "tool", "content": f"error: malformed tool call ({reason})"}
        for reason in turn.malformed]
    for content, outcome in outcomes:
        if outcome:
            counts[outcome] += 1
        messages.append({"role": "tool", "content": content})
    return StepResult(messages, 0.0, False, counts)


def tool_env(tools: list[str], workflow: MultiTurnWorkflow, syntax: Syntax) -> ToolEnv:
    """The `ToolEnv` a multi-turn explorer's workers build for `workflow` with `tools`
    (`prompt.tools`): the workflow's environment wrapped, calls read in `syntax` (the
    family's: `tool_syntax(tokenizer)`), each within `workflow.tool_timeout` seconds; for
    the processes that play the workflow in their own (demonstrations, evaluation), which
    take plain environments only: UserError for an `async def` one."""
    from rft_hpc.core.errors import UserError
    from rft_hpc.envs.base import is_async_env

    if is_async_env(workflow.env):
        raise UserError(f"explorer.workflow.env {workflow.env!r} is async def: demonstrations "
                        "(data: {source: tasks}) and held-out evaluation of tool tasks play "
                        "plain environments only; give them a plain one (docs/agents.md)")
    return ToolEnv(**tool_env_args(tools, workflow, syntax))


def tool_env_args(tools: list[str], workflow: MultiTurnWorkflow,
                  syntax: Syntax) -> dict[str, Any]:
    """The constructor arguments of the `ToolEnv` (or `AsyncToolEnv`) that wraps
    `workflow`'s environment with `tools`, calls read in `syntax`, each within
    `workflow.tool_timeout` seconds."""
    return {"tools": list(tools), "syntax": syntax, "env": workflow.env,
            "env_args": dict(workflow.env_args), "call_timeout": workflow.tool_timeout}
