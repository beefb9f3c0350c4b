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

How many workers: as many as the calls need, up to a bound. The pool starts its first with
the first call that needs one (a run whose rewards the explorer computes itself,
`IN_PROCESS_REWARDS`, never starts a worker, nor the fork server that would import the
rewards) and adds more while calls are queued and every worker is busy, judging the calls
that are running: one that computes (its worker runs, its CPU time grows with the call's
time, as the kernel counts them in /proc) needs a core, so such calls run at most `cores`
at once; one that waits (a sleep, a socket: its worker is asleep, its CPU time stands
still) needs no core, so more run at once, doubling each time, up to `workers`. Workers
idle for `IDLE_SECONDS` are stopped, the first one excepted. The explorer derives both
bounds from its allocation unless
`explorer.reward_workers` sets them (`runtime.placement.reward_worker_bounds`).

Each outcome says whether the call raised (`error`) or overran (`timed_out`); counting them
and deciding when too many failed is the caller's business (the explorer,
`explorer.reward_failure_limit`). The pool is the explorer's reward `Scorer`
(`explorer.protocols`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from rft_hpc.config.rewards import IN_PROCESS_REWARDS
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

GROW_AFTER_SECONDS = 0.05
"""A call running this long is judged computing or waiting (the pool grows only then)."""

WAITING_CPU_SHARE = 0.5
"""A running call waits when its worker is asleep and used less CPU than this share of the
call's time (the kernel counts CPU time in ticks of ~10 ms)."""

IDLE_SECONDS = 30.0
"""A worker idle this long is stopped (the pool keeps one)."""

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
    unparseable: bool = False
    """An LLM judge answered, but its parser found no score in the answer
    (`tasks.judge_reward`): a failure counted apart as well (`judge_unparseable`)."""
    request: str | None = None
    """Where a reward job scored it (`<request id>/<index>`, docs/reward-job.md); None when
    scored in this process or its workers."""

    @property
    def failed(self) -> bool:
        """Whether the call raised, died or timed out."""
        return self.error is not None


RewardCall = tuple[Task, str]
"""(task, response text): one rollout to score with the task's reward."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int | None) -> tuple[float, bool]:
    """CPU seconds process `pid` has used (user + system) and whether it is asleep (state S
    or D: waiting on a timer, a socket, a disk), from /proc; (+inf, False) where that cannot
    be read (another OS, a process gone): its calls then count as computing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS, fields[0] in (b"S", b"D")
    except (OSError, ValueError, IndexError):
        return float("inf"), False


def scores_in_process(task: Task) -> bool:
    """Whether `task`'s reward is one function of `IN_PROCESS_REWARDS` (computed by the
    caller: a worker's round trip would cost more than the call)."""
    return not task.reward_terms and task.reward in IN_PROCESS_REWARDS


def _call(task: Task, response: str) -> tuple[str, float | str]:
    """One reward call as a worker reports it: ("ok", score) or ("error", why); a reward
    that raises is scored 0 and the caller goes on."""
    from rft_hpc.tasks.rewards import call_reward

    try:
        return "ok", call_reward(task, response)
    except (Exception, SystemExit) as exc:
        return "error", _describe(exc)


def _score_here(task: Task, response: str) -> RewardOutcome:
    kind, value = _call(task, response)
    return RewardOutcome(float(value)) if kind == "ok" else RewardOutcome(error=str(value))


def _serve(conn: Connection) -> None:
    """A worker: score each call of a `[(task, response), ...]` message, replying once per
    call in order, until None or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the explorer stops its workers itself
    conn.send((-1, "ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        for task, response in message:
            conn.send((0, *_call(task, response)))


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
        self.since = time.monotonic()
        """When its oldest unanswered call started (sent, or the reply before it came);
        while idle, since when it is."""
        self.cpu_since = 0.0
        """The worker's CPU seconds at `since` (`_cpu_seconds`)."""

    def send(self, chunk: list[tuple[Scoring, int]], timeout: float) -> bool:
        """Start scoring the calls `chunk` names (each: its batch and index there); False
        when the worker is gone."""
        try:
            self.conn.send([scoring.calls[index] for scoring, index in chunk])
        except (OSError, ValueError):
            return False
        self.busy.extend(chunk)
        self.mark(timeout)
        return True

    def mark(self, timeout: float) -> None:
        """A call starts now: its clock, its CPU clock and its deadline."""
        self.since = time.monotonic()
        self.cpu_since = _cpu_seconds(self.proc.pid)[0]
        self.deadline = self.since + timeout

    def waiting(self, now: float) -> bool | None:
        """Whether its running call waits rather than computes; None while too young to
        judge (or idle)."""
        took = now - self.since
        if not self.busy or took < GROW_AFTER_SECONDS:
            return None
        # asleep too: a call starved of a core by others is as slow but runnable (state R)
        cpu, asleep = _cpu_seconds(self.proc.pid)
        return asleep and cpu - self.cpu_since < WAITING_CPU_SHARE * took

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
    """Up to `workers` reward worker processes, at most `cores` of them computing at once
    (default: `workers`); every call is bounded by `timeout` seconds.

    `score(calls)` waits for a batch's outcomes; `submit(calls)` hands a batch over and
    returns at once, and `pump()` moves the submitted batches on (the streaming explorer
    calls it between engine steps). Calls are scored in submission order.
    """

    def __init__(self, workers: int = 1, timeout: float = 10.0, *,
                 cores: int | None = None) -> None:
        if workers < 1 or timeout <= 0 or (cores is not None and cores < 1):
            raise ValueError("a reward pool needs workers >= 1, cores >= 1 and a timeout > 0")
        self.timeout = timeout
        self.max_workers = workers
        """The most worker processes (calls that wait run this many at once)."""
        self.cores = min(workers, cores or workers)
        """The most calls that compute at once."""
        self.restarts = 0
        """Workers replaced so far (killed after a timeout, or died)."""
        self.peak = 0
        """The most workers the pool has had at once."""
        self._workers: list[_Worker] = []  # the first starts with the first call it needs
        self._todo: deque[tuple[Scoring, int]] = deque()
        self._slowest: float | None = None  # the slowest recent call's seconds (decaying)

    @property
    def size(self) -> int:
        """Worker processes now (started or starting)."""
        return len(self._workers)

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Each call's outcome, in the order of `calls` (the same whatever the number of
        workers). Raises `RuntimeError` only when a worker cannot even start."""
        scoring = self.submit(calls)
        while not scoring.done:
            self.pump(timeout=None)
        return scoring.result()

    def submit(self, calls: Sequence[RewardCall]) -> Scoring:
        """Queue `calls` for scoring and return their `Scoring` at once. Calls of a
        built-in that cannot hang (`IN_PROCESS_REWARDS`) are scored here and now."""
        scoring = Scoring(calls)
        for i, (task, response) in enumerate(scoring.calls):
            if scores_in_process(task):
                scoring.put(i, _score_here(task, response))
            else:
                self._todo.append((scoring, i))
        if self._todo:
            self.pump(timeout=0.0)
        return scoring

    @property
    def busy(self) -> bool:
        """Whether calls are queued or being scored."""
        return bool(self._todo) or any(w.busy for w in self._workers)

    def pump(self, timeout: float | None = 0.0) -> None:
        """Start queued calls on idle workers (adding workers the calls need, stopping
        those idle too long), then wait up to `timeout` seconds (None: until something
        happens) for results, timeouts and started workers, and take them in."""
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
        growing = self._grow()
        waiting = [w for w in self._workers if w.busy or not w.ready]
        if not waiting:
            return
        left = min(w.deadline for w in waiting) - time.monotonic()
        if timeout is not None:
            left = min(left, timeout)
        if growing:  # calls queued behind busy workers: judge them again soon
            left = min(left, GROW_AFTER_SECONDS)
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
            took = time.monotonic() - w.since
            w.mark(self.timeout)
            self._slowest = took if self._slowest is None else max(
                took, _SLOWEST_DECAY * self._slowest)
        return True

    def _grow(self) -> bool:
        """Add the workers the queued calls need (see the module docstring) and stop the
        idle ones past `IDLE_SECONDS`; True while calls wait behind busy workers and the
        pool may still grow."""
        now = time.monotonic()
        if not self._todo:
            stale = [w for w in self._workers[1:] if w.ready and not w.busy
                     and now - w.since > IDLE_SECONDS]
            for w in stale:
                self._workers.remove(w)
                w.close()
            return False
        if not self._workers:
            self._workers.append(_Worker())
            self.peak = max(self.peak, 1)
            return False
        if any(not w.ready or not w.busy for w in self._workers):
            return False  # a worker is starting or idle: the queue goes there first
        judged = [w.waiting(now) for w in self._workers]
        room = self.max_workers - len(self._workers)
        if True in judged:  # waiting calls need no core: double
            add = min(len(self._workers), room)
        elif None in judged:  # too early to tell
            return room > 0
        else:  # every worker computes: one more per free core
            add = min(self.cores - len(self._workers), room)
        add = min(add, len(self._todo))
        if add > 0:
            self._workers.extend(_Worker() for _ in range(add))
            self.peak = max(self.peak, len(self._workers))
        return False

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
