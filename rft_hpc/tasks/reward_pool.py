"""Reward calls in worker processes, each with a time limit, so that a bad reward costs
only the rollouts it was scoring.

Why processes and not threads: a Python thread cannot be stopped. A reward that hangs (a
SymPy simplification that never ends, a network call, a `while True`) would keep its
thread, and the CPU it spins on, for the rest of the run, and a pool of such threads runs
dry; a process can always be killed. The workers are forked from the role's fork server
(`rft_hpc.core.forkserver`, never from the role with its torch threads), import the
rewards once, and score one call at a time; a call that overruns its limit gets its worker
killed and replaced, and its rollout scores 0. Once the calls have shown themselves fast
(none of the last few hundred over `FAST_CALL_SECONDS`, far below a message's round trip),
the queued calls are dealt out in even chunks over the idle workers, a chunk never mixing
two batches (one message a chunk, one reply a call): a step's rewards then cost a few
messages, not one round trip each. Slow calls (a sandbox, a remote judge) go one to a
worker, so that none waits behind another. Each call has its own time limit, counted from
the reply before it. A call runs in its worker's main thread, so rewards that rely on
SIGALRM work there too.

Each outcome says whether the call raised (`error`) or overran (`timed_out`); counting them
and deciding when too many failed is the caller's business (the explorer,
`explorer.reward_failure_limit`). The pool is the explorer's reward `Scorer`
(`explorer.protocols`).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from rft_hpc.core.forkserver import forkserver_context
from rft_hpc.tasks.task import Task

START_SECONDS = 60.0
"""The longest a worker may take to start (the first one also starts the fork server and
imports the rewards: seconds on a loaded node); past it the pool gives up with an error."""

MESSAGE_CHARS = 500
"""Error messages are cut to this length (a reward may raise with a whole response in it)."""

FAST_CALL_SECONDS = 0.002
"""Calls are sent in chunks while the slowest recent one took less than this."""

_SLOWEST_DECAY = 0.99
"""Per call, the slowest recent call's time decays by this factor: one slow call keeps
chunks off for a few hundred calls (a slow call behind another in a chunk waits for it)."""

_PRELOAD = ("rft_hpc.tasks.rewards", "rft_hpc.tasks.math_reward", "rft_hpc.tasks.format_reward")


@dataclass(frozen=True)
class RewardOutcome:
    """What one reward call gave: a score, or why it gave none (then `score` is 0)."""

    score: float = 0.0
    error: str | None = None
    """The exception the reward raised (`TypeName: message`), why its worker died, or that
    it timed out."""
    timed_out: bool = False
    """The call overran its time limit (its worker was killed)."""

    @property
    def failed(self) -> bool:
        """Whether the call raised, died or timed out."""
        return self.error is not None


RewardCall = tuple[Task, str]
"""(task, response text): one rollout to score with the task's reward."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]


def _serve(conn: Connection) -> None:
    """A worker: score each call of a `[(task, response), ...]` message, replying once per
    call in order, until None or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the explorer stops its workers itself
    from rft_hpc.tasks.rewards import call_reward

    conn.send((-1, "ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        for task, response in message:
            try:
                conn.send((0, "ok", call_reward(task, response)))
            except (Exception, SystemExit) as exc:  # reported, scored 0; the worker goes on
                conn.send((0, "error", _describe(exc)))


class _Worker:
    """One worker process and the calls it is busy with."""

    def __init__(self) -> None:
        ctx = forkserver_context(_PRELOAD)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True,
                                name="reward-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.busy: deque[tuple[Scoring, int]] = deque()
        """The calls it was sent and has not answered, in order: (their batch, index)."""
        self.deadline = time.monotonic() + START_SECONDS
        self.since = 0.0
        """When its oldest unanswered call started (sent, or the reply before it came)."""

    def send(self, chunk: list[tuple[Scoring, int]], timeout: float) -> bool:
        """Start scoring the calls `chunk` names (each: its batch and index there); False
        when the worker is gone."""
        try:
            self.conn.send([scoring.calls[index] for scoring, index in chunk])
        except (OSError, ValueError):
            return False
        self.busy.extend(chunk)
        self.since = time.monotonic()
        self.deadline = self.since + timeout
        return True

    def close(self, kill: bool = False) -> None:
        """Stop the worker: at once with `kill`, else asked and killed after 0.5 s."""
        if not kill:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            self.proc.join(0.5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class Scoring:
    """The outcomes of one batch of reward calls handed to `RewardPool.submit`, filled in
    as the workers finish them."""

    def __init__(self, calls: Sequence[RewardCall]) -> None:
        self.calls = list(calls)
        self.outcomes: list[RewardOutcome | None] = [None] * len(self.calls)
        self.left = len(self.calls)

    @property
    def done(self) -> bool:
        """Whether every call has its outcome."""
        return self.left == 0

    def put(self, index: int, outcome: RewardOutcome) -> None:
        """Record call `index`'s outcome."""
        if self.outcomes[index] is None:
            self.left -= 1
        self.outcomes[index] = outcome

    def result(self) -> list[RewardOutcome]:
        """Each call's outcome, in the order of the calls (only once `done`)."""
        if not self.done:
            raise RuntimeError("the reward calls are still being scored")
        return [o for o in self.outcomes if o is not None]


class RewardPool:
    """`workers` reward worker processes; every call is bounded by `timeout` seconds.

    `score(calls)` waits for a batch's outcomes; `submit(calls)` hands a batch over and
    returns at once, and `pump()` moves the submitted batches on (the streaming explorer
    calls it between engine steps). Calls are scored in submission order.
    """

    def __init__(self, workers: int = 1, timeout: float = 10.0) -> None:
        if workers < 1 or timeout <= 0:
            raise ValueError("a reward pool needs workers >= 1 and a timeout > 0")
        self.timeout = timeout
        self.restarts = 0
        """Workers replaced so far (killed after a timeout, or died)."""
        self._workers = [_Worker() for _ in range(workers)]  # they start while we go on
        self._todo: deque[tuple[Scoring, int]] = deque()
        self._slowest: float | None = None  # the slowest recent call's seconds (decaying)

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Each call's outcome, in the order of `calls` (the same whatever the number of
        workers). Raises `RuntimeError` only when a worker cannot even start."""
        scoring = self.submit(calls)
        while not scoring.done:
            self.pump(timeout=None)
        return scoring.result()

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` for scoring and return their `Scoring` at once."""
        scoring = Scoring(calls)
        self._todo.extend((scoring, i) for i in range(len(scoring.calls)))
        self.pump(timeout=0.0)
        return scoring

    @property
    def busy(self) -> bool:
        """Whether calls are queued or being scored."""
        return bool(self._todo) or any(w.busy for w in self._workers)

    def pump(self, timeout: float | None = 0.0) -> None:
        """Start queued calls on idle workers, then wait up to `timeout` seconds (None: until
        something happens) for results, timeouts and started workers, and take them in."""
        idle = [w for w in self._workers if w.ready and not w.busy]
        for n, w in enumerate(idle):
            if not self._todo:
                break
            size = (-(-len(self._todo) // (len(idle) - n))  # even chunks over the idle ones
                    if self._fast else 1)
            chunk = [self._todo.popleft()]
            while len(chunk) < size and self._todo and self._todo[0][0] is chunk[0][0]:
                chunk.append(self._todo.popleft())  # a chunk holds calls of one batch only
            if not w.send(chunk, self.timeout):
                self._todo.extendleft(reversed(chunk))  # died idle: not the calls' fault
                self._replace(w)
        waiting = [w for w in self._workers if w.busy or not w.ready]
        if not waiting:
            return
        left = min(w.deadline for w in waiting) - time.monotonic()
        if timeout is not None:
            left = min(left, timeout)
        readable = set(wait([w.conn for w in waiting], timeout=max(left, 0.0)))
        for w in waiting:
            if w.conn in readable:
                while self._receive(w) and (w.busy or not w.ready) and w.conn.poll():
                    pass  # every reply already there
            elif time.monotonic() >= w.deadline:
                self._overran(w)

    def _receive(self, w: _Worker) -> bool:
        """Take in one message of `w`; False when `w` died (and was replaced)."""
        try:
            _, status, value = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(1.0)
            code = w.proc.exitcode
            if not w.busy:
                self._check_started(w, f"it died (exit code {code})")
            else:
                self._finish(w, RewardOutcome(
                    error=f"the reward's process died (exit code {code})"))
            self._replace(w)
            return False
        if status == "ready":
            w.ready = True
        else:
            self._finish(w, RewardOutcome(float(value)) if status == "ok"
                         else RewardOutcome(error=str(value)))
            now = time.monotonic()
            took, w.since, w.deadline = now - w.since, now, now + self.timeout
            self._slowest = took if self._slowest is None else max(
                took, _SLOWEST_DECAY * self._slowest)
        return True

    @property
    def _fast(self) -> bool:
        """Whether recent calls all took far less than a message's round trip."""
        return self._slowest is not None and self._slowest < FAST_CALL_SECONDS

    def _finish(self, w: _Worker, outcome: RewardOutcome) -> None:
        """Give the worker's oldest call `outcome`."""
        scoring, index = w.busy.popleft()
        scoring.put(index, outcome)

    def _overran(self, w: _Worker) -> None:
        if not w.busy:
            self._check_started(w, f"it did not start within {START_SECONDS:.0f} s")
        self._finish(w, RewardOutcome(error=f"timed out (no result within {self.timeout:g} s)",
                                      timed_out=True))
        self._replace(w)

    def _check_started(self, w: _Worker, why: str) -> None:
        if not w.ready:
            raise RuntimeError(f"a reward worker process failed to start: {why}")

    def _replace(self, w: _Worker) -> None:
        """Kill `w` (it died, or overran) and start another; its calls that were not
        reached go back to the front of the queue."""
        self._todo.extendleft(reversed(w.busy))
        w.busy.clear()
        w.close(kill=True)
        self.restarts += 1
        i = self._workers.index(w)
        self._workers[i] = _Worker()

    def close(self) -> None:
        """Stop every worker."""
        for w in self._workers:
            w.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
