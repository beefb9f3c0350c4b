"""The explorer's rollout loop: an asyncio event loop in a thread of its own, where every
multi-turn trajectory in flight is a coroutine (`explorer.multiturn`), its turns batched for
the engine (`explorer.turn_batcher`) and its environment calls sent to host processes
(`envs.host`), from `HostSource`: a host per task attempt for plain environments, one for
the whole explorer for `async def` ones. A thousand trajectories in flight cost a thousand
coroutines, not a thousand threads or processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.envs.host import EnvHost
from rft_hpc.explorer.turn_batcher import TurnBatcher

T = TypeVar("T")

PING_SECONDS = 5.0
"""How long the shared host may take to answer a ping after a call overran; past it the
host is taken for hung (an `async def` blocking its loop) and killed."""


class HostSource:
    """The host process each task attempt plays in (in the rollout loop)."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        """One host for every attempt (`async def` environments), else one per attempt."""
        self._host: EnvHost | None = None
        self.started = 0
        """Host processes started so far."""

    async def host(self) -> tuple[EnvHost, bool]:
        """A host for an attempt, and whether the attempt owns it (closes it at the end)."""
        if not self.shared:
            self.started += 1
            return EnvHost(), True
        if self._host is None or self._host.closed:
            self.started += 1
            self._host = EnvHost()
        return self._host, False

    async def release(self, host: EnvHost, key: int, *, own: bool, ok: bool,
                      timed_out: bool = False) -> None:
        """The attempt is over (`ok`: it finished; `timed_out`: a call overran): close the
        host it owns (killed unless ok), else drop the attempt's environments from the
        shared host, killing the host when it no longer answers after a call overran."""
        if own:
            host.close(kill=not ok)
            return
        host.drop(key)
        if timed_out and not host.closed and not await host.responsive(PING_SECONDS):
            host.close(kill=True)

    def close(self) -> None:
        """Kill the shared host."""
        if self._host is not None:
            self._host.close(kill=True)
            self._host = None


class RolloutLoop:
    """An event loop in a daemon thread with the engine's `TurnBatcher` and the hosts."""

    def __init__(self, engine: StreamingEngine, shared_host: bool) -> None:
        """`engine`: the explorer's engine, shared with its other threads (a
        `multiturn.SerialEngine`)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="rollout-loop")
        self._thread.start()
        self.batcher = TurnBatcher(engine, self.loop)
        self.hosts = HostSource(shared_host)

    def start(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` in the loop; its future (cancelling it cancels the coroutine)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel every coroutine, kill the hosts, stop the batcher and the loop."""
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.hosts.close()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        self.batcher.close()
