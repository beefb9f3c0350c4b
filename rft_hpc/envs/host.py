"""Environments in worker processes ("hosts"), called from the explorer's rollout loop.

A hung Python thread cannot be stopped, and an environment may block in C code or in a
subprocess of its own; a process can always be killed. So environments live in host
processes, started from a fork server (cheap forks of a clean interpreter that has imported
rft_hpc.envs, never of the explorer with its torch threads), and each call waits at most the
time its caller allows.

A host runs an asyncio loop and serves every call it is sent at once, each call tagged with
its id: an environment written with `async def reset / step` runs as a coroutine, a plain
one in a thread of its own. Two kinds of hosts, by the environment's kind:

- plain environments: one host per task attempt (its group's environments), killed when the
  attempt ends badly, so a hang or a crash costs that task only; the group's trajectories
  call their environments concurrently;
- `async def` environments (I/O: HTTP sandboxes, remote judges): one host per explorer for
  every task, so a thousand trajectories in flight cost one process. A call that overruns
  has its task's environments dropped; a host that stops answering (an `async def` that
  blocks its loop) is killed and started again, failing the calls it held.

Like every fork-server or spawn child, a host imports the parent's main module unless it
was run with `python -m package` (as the roles are: `python -m rft_hpc.cli`); a script that
drives an explorer in-process should keep heavy imports under its `__main__` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from rft_hpc.core.forkserver import forkserver_context

EnvValue = str | tuple[str | list[dict[str, str]], float, bool, dict[str, int]] | None
"""What a host answers: `reset`'s first observation, `step`'s (observation, reward, done,
counts), None for a `build`."""

_STOP = object()  # ends the sender thread

HOST_THREADS = 512
"""Threads a host may run plain environment calls and tools in (started on demand)."""


class EnvError(Exception):
    """The environment raised, or its process died; the message says which."""


class EnvTimeout(Exception):
    """The environment did not answer within the task's time budget."""


def env_context() -> BaseContext:
    """The fork-server context of the host processes (started once per process, shared
    with the reward workers: `rft_hpc.core.forkserver`)."""
    return forkserver_context(["rft_hpc.envs.base", "rft_hpc.envs.guess"])


def _normalized(method: str, value: Any) -> EnvValue:
    """A `step`'s `StepResult` or plain (observation, reward, done) as the tuple sent back;
    `reset`'s observation as text."""
    from rft_hpc.envs.base import StepResult

    if isinstance(value, StepResult):
        observation = value.observation if isinstance(value.observation, list) \
            else str(value.observation)
        return observation, float(value.reward), bool(value.done), dict(value.counts)
    if method == "step":
        observation, reward, done = value
        return str(observation), float(reward), bool(done), {}
    return None if value is None else str(value)


def _serve(conn: Connection) -> None:
    """A host: serve `build`, `call`, `drop` and `ping` messages until None or EOF."""
    asyncio.run(_HostLoop(conn).run())


class _HostLoop:
    """The host's side: environments by key, one asyncio task per call."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.envs: dict[Hashable, list[Any]] = {}
        self.calls: dict[Hashable, set[asyncio.Task[None]]] = {}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(HOST_THREADS, "env"))
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        def readable() -> None:
            try:
                while self.conn.poll():
                    inbox.put_nowait(self.conn.recv())
            except (EOFError, OSError):
                inbox.put_nowait(None)
                loop.remove_reader(self.conn.fileno())

        loop.add_reader(self.conn.fileno(), readable)
        while (message := await inbox.get()) is not None:
            kind, call_id, key, *rest = message
            if kind == "ping":
                self.conn.send((call_id, "ok", None))
            elif kind == "drop":
                for task in self.calls.pop(key, set()):
                    task.cancel()
                self.envs.pop(key, None)
            else:
                task = asyncio.create_task(self._answer(kind, call_id, key, rest))
                self.calls.setdefault(key, set()).add(task)
                task.add_done_callback(lambda t, k=key: self.calls.get(k, set()).discard(t))

    async def _answer(self, kind: str, call_id: int, key: Hashable, rest: list[Any]) -> None:
        try:
            if kind == "build":
                from rft_hpc.envs.base import build_env

                name, args, count = rest
                self.envs[key] = await asyncio.to_thread(
                    lambda: [build_env(name, args) for _ in range(count)])
                value: EnvValue = None
            else:
                index, method, args = rest
                fn = getattr(self.envs[key][index], method)
                result = fn(*args) if asyncio.iscoroutinefunction(fn) else \
                    asyncio.to_thread(fn, *args)
                value = _normalized(method, await result)
            reply = (call_id, "ok", value)
        except asyncio.CancelledError:
            return
        except BaseException as exc:  # an environment's error costs its task only
            reply = (call_id, "error", f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(reply)


class EnvHost:
    """A host process and the calls sent to it, from the rollout loop (asyncio) that
    created it. Messages go out through a thread of its own, so the loop never blocks on a
    host that stopped reading."""

    def __init__(self) -> None:
        ctx = env_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="env-host")
        self._proc.start()
        child.close()
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, asyncio.Future[EnvValue]] = {}
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, daemon=True, name="env-send")
        self._sender.start()
        self.closed = False
        self._loop.add_reader(self._conn.fileno(), self._receive)

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not _STOP:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the host is gone: its reader says so

    def _receive(self) -> None:
        try:
            while self._conn.poll():
                call_id, status, value = self._conn.recv()
                future = self._pending.pop(call_id, None)
                if future is None or future.done():
                    continue
                if status == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(EnvError(value))
        except (EOFError, OSError):
            self._proc.join(1.0)
            self._fail_all(EnvError(f"environment process died (exit code "
                                    f"{self._proc.exitcode})"))

    def _fail_all(self, error: Exception) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._conn.fileno())
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _request(self, kind: str, key: Hashable, *rest: Any, timeout: float) -> EnvValue:
        if self.closed:
            raise EnvError(f"environment process died (exit code {self._proc.exitcode})")
        call_id = next(self._ids)
        future: asyncio.Future[EnvValue] = self._loop.create_future()
        self._pending[call_id] = future
        self._outbox.put((kind, call_id, key, *rest))
        try:
            return await asyncio.wait_for(future, max(timeout, 1e-3))
        except TimeoutError:
            raise EnvTimeout(f"no answer within {timeout:.3g} s") from None
        finally:
            self._pending.pop(call_id, None)

    async def build(self, key: Hashable, name: str, args: dict[str, object], count: int, *,
                    timeout: float) -> None:
        """Build `count` environments `name(**args)` under `key`."""
        await self._request("build", key, name, args, count, timeout=timeout)

    async def call(self, key: Hashable, index: int, method: str, *args: object,
                   timeout: float) -> EnvValue:
        """`envs[key][index].method(*args)` in the host; raises `EnvTimeout` after `timeout`
        seconds, `EnvError` when it raised or the host died."""
        return await self._request("call", key, index, method, args, timeout=timeout)

    async def responsive(self, timeout: float) -> bool:
        """Whether the host's loop answers a ping within `timeout` seconds."""
        try:
            await self._request("ping", None, timeout=timeout)
        except (EnvTimeout, EnvError):
            return False
        return True

    def drop(self, key: Hashable) -> None:
        """Cancel the calls of `key`'s environments and forget them."""
        if not self.closed:
            self._outbox.put(("drop", None, key))

    def close(self, kill: bool = False) -> None:
        """Stop the host: killed at once with `kill`, else asked to exit and killed when it
        does not within 0.5 s. Calls still pending fail with `EnvError`."""
        self._fail_all(EnvError("environment process stopped"))
        if not kill:
            self._outbox.put(None)  # the host's cue to exit
        self._outbox.put(_STOP)
        if not kill:
            self._sender.join(0.5)
            self._proc.join(0.5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    @property
    def pid(self) -> int | None:
        """The host's process id."""
        return self._proc.pid
