"""Multi-turn rollouts: the policy and an environment take turns, one trajectory per record.

The sequence of a trajectory is the first observation (the prompt), then each policy turn
(mask 1, with its rollout log-probs) followed by the environment's feedback (mask 0, log-prob
0: the action mask), up to `max_turns` turns or until the environment says done. Its reward
is the sum of the turns' rewards. A task plays `repeat` trajectories (its GRPO group) against
`repeat` environments in a host process (`rft_hpc.envs.host`), each trajectory a coroutine of
the explorer's rollout loop (`explorer.rollout_loop`) at its own pace: its turns go to the
engine through the `TurnBatcher` as soon as its observation is in. A failed attempt (an
environment raised, died, or the attempt overran `max_timeout`) is retried up to
`max_retry_times` times from scratch, then the task is given up: no trajectories, counted in
the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.config.workflow import MultiTurnWorkflow
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.requests import Completion, FinishedGroup, GroupRequest
from rft_hpc.envs.base import Message, is_async_env
from rft_hpc.envs.host import EnvError, EnvHost, EnvTimeout, EnvValue
from rft_hpc.envs.tools import tool_env_args
from rft_hpc.tasks.chat_turns import ChatTurns
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.tool_calls import tool_syntax

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rft_hpc.config.prompt import PromptConfig
    from rft_hpc.explorer.rollout_loop import HostSource
    from rft_hpc.explorer.turn_batcher import TurnBatcher


class SerialEngine:
    """An engine shared by the explorer's threads (a `StreamingEngine` itself): one
    generation, engine step or weight load at a time, and one tokenization at a time (a
    fast tokenizer is not safe to use from several threads at once) under a lock of its own,
    so that the rollout loop tokenizes while the engine generates. It also builds the turns
    of a trajectory: raw text, or with prompt format chat the chat template's turns, token
    in and token out (`tasks.chat_turns`)."""

    def __init__(self, engine: StreamingEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._tokenizing = threading.Lock()
        self.tokenizer = engine.tokenizer
        self.prompt = engine.prompt
        self.chat = ChatTurns(engine.tokenizer) if engine.prompt.format == "chat" else None
        """The chat template's turns (None: raw text)."""

    def first_turn(self, task: Task, observation: str) -> list[int]:
        """Token ids of a trajectory's first observation: raw text (with the tokenizer's
        special tokens), or the chat that opens with it as the user's message (after
        `prompt.system_prompt`) and the assistant's generation prompt."""
        with self._tokenizing:
            return self._engine.prompt_ids(replace(task, prompt=observation, messages=None))

    def next_turn(self, sampled: Sequence[int], observation: str | list[Message]) -> list[int]:
        """Token ids that follow the policy's turn `sampled` with the environment's
        `observation`: its raw text, or the turn's closing tokens and the observation (a user
        message, or the messages given: tool results) with the next generation prompt;
        never the policy's tokens."""
        with self._tokenizing:
            if self.chat is None:
                if isinstance(observation, list):
                    raise EnvError("the environment answered with chat messages: they need "
                                   "prompt.format chat")
                return self._engine.plain_tokens(observation) if observation else []
            messages = observation if isinstance(observation, list) else [
                {"role": "user", "content": observation}]
            return self.chat.close_turn(sampled) + self.chat.messages(messages)

    def action_text(self, completion: Completion) -> str:
        """What the environment is given of a policy turn: its text, or with `prompt.tools`
        its text with special tokens kept (a family's tool-call marker may be one, as
        Mistral's `[TOOL_CALLS]`), its end-of-turn token left out."""
        if not self.prompt.tools:
            return completion.text
        tokens = list(completion.tokens)
        if self.chat is not None and tokens and tokens[-1] == self.chat.end_of_turn:
            tokens = tokens[:-1]
        with self._tokenizing:
            return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @property
    def version(self) -> int:
        """The version of the weights the engine holds."""
        return self._engine.version

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[Completion]]:
        """The engine's `generate`, alone."""
        with self._lock:
            return self._engine.generate(prompts, n=n, max_new_tokens=max_new_tokens,
                                         temperature=temperature, seed=seed)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """The engine's `submit`."""
        with self._lock:
            self._engine.submit(requests)

    def poll(self) -> list[FinishedGroup]:
        """The engine's `poll` (one engine step), alone."""
        with self._lock:
            return self._engine.poll()

    @property
    def in_flight(self) -> int:
        """The engine's requests in flight."""
        return self._engine.in_flight

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """The engine's `load_weights`, never during a generation."""
        with self._lock:
            self._engine.load_weights(state_dict, version)

    def context_limit(self) -> int | None:
        """The longest sequence the model takes (its max positions), None when unknown."""
        return self._engine.context_limit()

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt, with its special tokens."""
        with self._tokenizing:
            return self._engine.encode(prompt)

    def plain_tokens(self, text: str) -> list[int]:
        """Token ids of an observation, without the BOS/EOS a prompt gets."""
        with self._tokenizing:
            return self._engine.plain_tokens(text)

    def prompt_ids(self, task: Task) -> list[int]:
        """Token ids of a task's prompt in the engine's prompt format."""
        with self._tokenizing:
            return self._engine.prompt_ids(task)

    def close(self) -> None:
        """Close the engine."""
        with self._lock:
            self._engine.close()


def with_tools(workflow: MultiTurnWorkflow, prompt: PromptConfig,
               tokenizer: PreTrainedTokenizerBase) -> MultiTurnWorkflow:
    """`workflow` with its environment wrapped in `envs.tools.ToolEnv` (`AsyncToolEnv`
    around an `async def` environment) when `prompt.tools` names tools (their calls read
    in the syntax of the tokenizer's family); else itself."""
    if not prompt.tools:
        return workflow
    wrapper = "AsyncToolEnv" if is_async_env(workflow.env) else "ToolEnv"
    return workflow.model_copy(update={
        "env": f"rft_hpc.envs.tools:{wrapper}",
        "env_args": tool_env_args(list(prompt.tools), workflow, tool_syntax(tokenizer))})


@dataclass(frozen=True)
class TurnSettings:
    """Sampling of each policy turn."""

    repeat: int
    max_new_tokens: int
    temperature: float


@dataclass
class TaskOutcome:
    """What became of one task: its records (none when it failed) and what went wrong."""

    experiences: list[Experience] = field(default_factory=list)
    status: str = "ok"
    """`ok`, `error` (every attempt raised/died), `timeout` (the last attempt overran) or
    `cancelled` (dropped straggler)."""
    errors: int = 0
    timeouts: int = 0
    retries: int = 0
    message: str = ""


@dataclass
class _Trajectory:
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_length: int
    version: int
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    actions: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, tokens: Sequence[int], mask: int, logprobs: Sequence[float] | None) -> None:
        self.tokens.extend(tokens)
        self.mask.extend([mask] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))


START_SECONDS = 10.0
"""The least time a host gets to start and build its environments."""


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


@dataclass
class _Attempt:
    """What the trajectories of one task attempt share."""

    engine: SerialEngine
    batcher: TurnBatcher
    host: EnvHost
    key: int
    task: Task
    workflow: MultiTurnWorkflow
    turn: TurnSettings
    seed: int
    version: int
    left: float
    """The environment time the attempt has left (its calls' seconds, summed)."""

    async def env(self, method: str, index: int, *args: object) -> EnvValue:
        """`method` of the trajectory's environment, within the attempt's budget."""
        t0 = time.monotonic()
        try:
            return await self.host.call(self.key, index, method, *args, timeout=self.left)
        finally:
            took = time.monotonic() - t0
            self.left -= took
            self.batcher.env_call_took(took)


_attempts = itertools.count()


async def run_task(engine: SerialEngine, batcher: TurnBatcher, hosts: HostSource, task: Task,
                   workflow: MultiTurnWorkflow, turn: TurnSettings, *, group_id: int,
                   step: int, seed: int, version: int | None = None) -> TaskOutcome:
    """Play `turn.repeat` trajectories of `task` in the rollout loop, retrying failed
    attempts; never raises for an environment's fault (see `TaskOutcome.status`). The
    records' `policy_version` is `version` (the weights when the task was started;
    default: the engine's now). Cancelling it stops the task and frees its environments."""
    version = engine.version if version is None else version
    outcome = TaskOutcome()
    for attempt in range(workflow.max_retry_times + 1):
        outcome.retries = attempt
        host, own = await hosts.host()
        ok = timed_out = False
        key = next(_attempts)
        try:
            # Starting the host is not the environment's time (a fork takes seconds on a
            # loaded node), but a constructor that hangs must not block either: it gets a
            # budget of its own.
            await host.build(key, workflow.env, workflow.env_args, turn.repeat,
                             timeout=max(workflow.max_timeout, START_SECONDS))
            state = _Attempt(engine, batcher, host, key, task, workflow, turn,
                             _seed(seed, attempt), version, workflow.max_timeout)
            trajectories = await _play(state)
            ok = True
        except EnvTimeout as exc:
            timed_out = True
            outcome.timeouts += 1
            outcome.status, outcome.message = "timeout", str(exc)
            continue
        except EnvError as exc:
            outcome.errors += 1
            outcome.status, outcome.message = "error", str(exc)
            continue
        finally:
            await hosts.release(host, key, own=own, ok=ok, timed_out=timed_out)
        outcome.status = "ok"
        outcome.experiences = [_experience(t, task, group_id, step, attempt)
                               for t in trajectories]
        return outcome
    return outcome


async def _play(state: _Attempt) -> list[_Trajectory]:
    """The attempt's trajectories, each at its own pace; the first that fails cancels
    the others and raises."""
    tasks = [asyncio.ensure_future(_trajectory(state, i)) for i in range(state.turn.repeat)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


async def _trajectory(state: _Attempt, i: int) -> _Trajectory:
    engine, turn, limit = state.engine, state.turn, state.engine.context_limit()
    with state.batcher.trajectory():
        seed = _seed(state.seed, i)
        first = await state.env("reset", i, state.task, seed)
        prompt = engine.first_turn(state.task, str(first))
        traj = _Trajectory(list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt),
                           state.version)
        for t in range(state.workflow.max_turns):
            # a turn that cannot fit in the model's context ends the trajectory
            if limit is not None and len(traj.tokens) + turn.max_new_tokens > limit:
                traj.truncated = True
                break
            completion = await state.batcher.generate(
                traj.tokens, max_new_tokens=turn.max_new_tokens,
                temperature=turn.temperature, seed=_seed(seed, 1 << 20, t))
            traj.add(completion.tokens, 1, completion.logprobs)
            traj.actions.append(completion.text)
            observation, reward, done, counts = await state.env(  # type: ignore[misc]
                "step", i, engine.action_text(completion))
            traj.reward += reward
            traj.turns += 1
            traj.counts.update(counts)
            traj.done = done
            if done or t + 1 == state.workflow.max_turns:
                break
            feedback = engine.next_turn(completion.tokens, observation or "")
            if limit is not None and (len(traj.tokens) + len(feedback)
                                      + turn.max_new_tokens > limit):
                traj.truncated = True  # the next turn would not fit
                break
            traj.add(feedback, 0, None)
    return traj


def _experience(traj: _Trajectory, task: Task, group_id: int, step: int,
                attempt: int) -> Experience:
    return Experience(
        tokens=np.asarray(traj.tokens, np.int32), prompt_length=traj.prompt_length,
        response_mask=np.asarray(traj.mask, np.uint8),
        logprobs=np.asarray(traj.logprobs, np.float32), reward=float(traj.reward),
        task_id=task.task_id, group_id=group_id, taskset=task.taskset,
        policy_version=traj.version, step=step,
        info={"turns": traj.turns, "done": traj.done, "truncated": traj.truncated,
              "actions": traj.actions, **traj.counts,
              "attempt": attempt, "finished": traj.done})
