"""Environments in worker processes, so that one that crashes or hangs costs its task only.

A hung Python thread cannot be stopped, and an environment may block in C code or in a
subprocess of its own; a process can always be killed. So each task's environments (one
per trajectory of its group) live in one worker process, started from a fork server (cheap
forks of a clean interpreter that has imported rft_hpc.envs, never of the explorer with its
torch threads). Every call waits at most the time the caller allows, in short slices so
that a cancelled task lets go at once; a worker that overran is killed.

Like every fork-server or spawn child, a worker imports the parent's main module unless it
was run with `python -m package` (as the roles are: `python -m rft_hpc.cli`); a script that
drives an explorer in-process should keep heavy imports under its `__main__` guard.
"""

from __future__ import annotations

import contextlib
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

from rft_hpc.core.forkserver import forkserver_context

EnvValue = str | tuple[str | list[dict[str, str]], float, bool, dict[str, int]] | None
"""What a worker answers: `reset`'s first observation, `step`'s (observation, reward,
done, counts), None once it has built its environments."""


class EnvError(Exception):
    """The environment raised, or its process died; the message says which."""


class EnvTimeout(Exception):
    """The environment did not answer within the task's time budget."""


class Cancelled(Exception):
    """The task was cancelled (an over-rollout straggler that is dropped)."""


def env_context() -> BaseContext:
    """The fork-server context of the worker processes (started once per process, shared
    with the reward workers: `rft_hpc.core.forkserver`)."""
    return forkserver_context(["rft_hpc.envs.base", "rft_hpc.envs.guess"])


def _serve(conn: Connection, name: str, args: dict[str, object], count: int) -> None:
    from rft_hpc.envs.base import StepResult, build_env

    try:
        envs = [build_env(name, args) for _ in range(count)]
    except BaseException as exc:  # reported to the explorer, which decides
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        method, index, call_args = message
        try:
            value = getattr(envs[index], method)(*call_args)
            if isinstance(value, StepResult):
                observation = value.observation if isinstance(value.observation, list) \
                    else str(value.observation)
                value = (observation, float(value.reward), bool(value.done),
                         dict(value.counts))
            elif method == "step":
                observation, reward, done = value  # a plain (obs, reward, done) tuple
                value = (str(observation), float(reward), bool(done), {})
            conn.send(("ok", value))
        except Exception as exc:  # an environment's error costs its task only
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class EnvWorker:
    """`count` environments of one kind in a worker process; calls with a time limit."""

    def __init__(self, name: str, args: dict[str, object], count: int) -> None:
        ctx = env_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, name, args, count), daemon=True)
        self._proc.start()
        child.close()
        self._started = False

    def call(self, method: str, index: int, *args: object, timeout: float,
             cancel: threading.Event | None = None) -> EnvValue:
        """`env[index].method(*args)` in the worker; raises `EnvTimeout` after `timeout`
        seconds, `EnvError` when it raised or died, `Cancelled` when `cancel` is set."""
        if not self._started:
            self.wait_started(timeout, cancel)
        try:
            self._conn.send((method, index, args))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise EnvError(f"environment process died: {exc}") from exc
        return self._receive(timeout, cancel)

    def wait_started(self, timeout: float, cancel: threading.Event | None = None) -> None:
        """Wait until the worker has built its environments (raises like `call`)."""
        self._receive(timeout, cancel)
        self._started = True

    def _receive(self, timeout: float, cancel: threading.Event | None) -> EnvValue:
        end = time.monotonic() + timeout
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            left = end - time.monotonic()
            if left <= 0:
                raise EnvTimeout(f"no answer within {timeout:.3g} s")
            if self._conn.poll(min(left, 0.05)):
                break
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EnvError(f"environment process died (exit code "
                           f"{self._proc.exitcode})") from exc
        if status == "error":
            raise EnvError(value)
        return value

    def close(self, kill: bool = False) -> None:
        """Stop the worker: killed at once with `kill` (it overran or was cancelled), else
        asked to exit and killed when it does not within 0.5 s."""
        if not kill:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
                self._conn.send(None)
            self._proc.join(0.5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
