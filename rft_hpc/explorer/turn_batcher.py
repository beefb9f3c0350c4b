"""The policy's turns of every trajectory in flight, batched for the engine.

Trajectories run as coroutines in the explorer's rollout loop (`explorer.rollout_loop`);
each of their turns is a request here, and a thread of its own hands the requests to the
engine's streaming interface (`submit` / `poll`; the explorer's `multiturn.SerialEngine`,
which it shares with the threads that load weights): a trajectory's next turn goes to the
engine as soon as its observation is in, never waiting for the rest of its group. The
batch forms while the engine works; when the engine is idle, a new batch waits a moment
(`linger`) for the trajectories whose environment calls are about to come back, so that
turns that could share a batch do: at most `LINGER_MAX` seconds, and about twice the
typical environment call, so a slow environment never holds the batch. Each request has
its own seed (`GroupRequest.seed`), so what a trajectory samples does not depend on what
it was batched with.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.engines.requests import Completion, GroupRequest

LINGER_MAX = 0.05
"""The longest an idle engine waits for more turns to batch (seconds)."""

LINGER_MIN = 0.002
"""The least it waits while trajectories are out at their environments."""


@dataclass
class _Request:
    request: GroupRequest
    future: asyncio.Future[Completion]


class TurnBatcher:
    """Serves `generate` requests of the rollout loop's coroutines on `engine` from a
    thread of its own; see the module docstring."""

    def __init__(self, engine: StreamingEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._first_pending = 0.0
        self._in_flight: dict[Hashable, _Request] = {}
        self._live = 0
        self._env_seconds: deque[float] = deque(maxlen=64)
        self._ids = 0
        self._closed = False
        self.batches = 0
        """Engine submissions so far."""
        self.turns = 0
        """Turns generated so far."""
        self._thread = threading.Thread(target=self._serve, daemon=True, name="turn-batcher")
        self._thread.start()

    @contextmanager
    def trajectory(self) -> Iterator[None]:
        """Count a trajectory as live while the block runs (the batcher waits briefly for
        live trajectories out at their environments)."""
        with self._cond:
            self._live += 1
        try:
            yield
        finally:
            with self._cond:
                self._live -= 1
                self._cond.notify()

    def env_call_took(self, seconds: float) -> None:
        """Note how long an environment call took (the linger follows the typical one)."""
        with self._cond:  # the batcher's thread reads them
            self._env_seconds.append(seconds)

    async def generate(self, prompt: list[int], *, max_new_tokens: int, temperature: float,
                       seed: int) -> Completion:
        """One completion of `prompt` drawn with `seed`, batched with the other turns."""
        future: asyncio.Future[Completion] = self._loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the turn batcher is closed")
            self._ids += 1
            request = GroupRequest(self._ids, prompt, 1, max_new_tokens, temperature, seed)
            if not self._pending:
                self._first_pending = time.monotonic()
            self._pending.append(_Request(request, future))
            self._cond.notify()
        try:
            return await future
        except asyncio.CancelledError:
            with self._cond:  # not yet submitted: never generate it
                self._pending = [r for r in self._pending if r.future is not future]
            raise

    def _linger(self) -> float:
        """Seconds to wait for more turns, from the typical environment call (under the
        lock)."""
        typical = statistics.median(self._env_seconds) if self._env_seconds else 0.0
        return min(LINGER_MAX, max(LINGER_MIN, 2 * typical))

    def _take(self) -> list[_Request] | None:
        """The next batch, once it is worth starting (None: closed)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                waiting = self._live - len(self._pending) - len(self._in_flight)
                if self._pending:
                    left = self._first_pending + self._linger() - time.monotonic()
                    if waiting <= 0 or left <= 0:
                        batch, self._pending = self._pending, []
                        return batch
                    self._cond.wait(left)
                else:
                    self._cond.wait()

    def _serve(self) -> None:
        while (batch := self._take()) is not None:
            self._submit(batch)
            while self._in_flight:
                try:
                    finished = self._engine.poll()
                except BaseException as exc:  # every waiting turn learns of it
                    self._fail(exc)
                    break
                for group in finished:
                    r = self._in_flight.pop(group.key, None)
                    if r is not None:
                        self._loop.call_soon_threadsafe(_resolve, r.future, group.completions[0])
                with self._cond:  # continuous batching: new turns join between engine steps
                    batch, self._pending = self._pending, []
                self._submit(batch)

    def _submit(self, batch: list[_Request]) -> None:
        if not batch:
            return
        with self._cond:
            self._in_flight.update((r.request.key, r) for r in batch)
        self._engine.submit([r.request for r in batch])
        self.batches += 1
        self.turns += len(batch)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            failed, self._in_flight = list(self._in_flight.values()), {}
        for r in failed:
            self._loop.call_soon_threadsafe(_reject, r.future, exc)

    def close(self) -> None:
        """Stop the thread; turns still waiting are never answered (their coroutines are
        cancelled by the rollout loop)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)


def _resolve(future: asyncio.Future[Completion], completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)


def _reject(future: asyncio.Future[Completion], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
