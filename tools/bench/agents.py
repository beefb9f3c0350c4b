#!/usr/bin/env python
"""Benchmark: 1,000 I/O-bound agent trajectories in flight in one explorer.

    python tools/bench/agents.py [--tasks 125] [--repeat 8] [--turns 2] [--seconds 2]

One explorer step of `tasks x repeat` trajectories (the tiny model, the rollout loop of
rft_hpc.explorer) against an `async def` environment that waits `seconds` in each step, as
an HTTP sandbox or a remote judge would (`WaitingSandbox` below); every trajectory plays
`turns` turns. While it runs, a sampler reads /proc every 50 ms and the bench prints the
peaks of this explorer and everything it started: processes, threads, resident memory (RSS,
summed), and how many trajectories were waiting in their environments at once. The peer it
is held to: one process per trajectory (what a worker per trajectory would take), and the
wall time against the environment's own time (`turns x seconds`: the least any runner could
take with every trajectory in flight at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rft_hpc.envs.base import Environment, StepResult  # noqa: E402  (light: the hosts import this module)

_WAITING = 0


class WaitingSandbox(Environment):
    """`async def`: every step waits `seconds` (no CPU); the first reports how many steps of
    this host were waiting when it began; the episode ends after `turns` steps."""

    def __init__(self, seconds: float = 2.0, turns: int = 2) -> None:
        self.seconds, self.turns, self.turn = seconds, turns, 0

    async def reset(self, task: object, seed: int) -> str:  # type: ignore[override]
        self.turn = 0
        return "0-9="

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        global _WAITING
        _WAITING += 1
        seen = _WAITING
        try:
            await asyncio.sleep(self.seconds)
        finally:
            _WAITING -= 1
        self.turn += 1
        # counts add up over a trajectory's turns: its first turn's alone
        return StepResult("+", 1.0, self.turn == self.turns,
                          {"waiting_at_once": seen} if self.turn == 1 else {})


def _tree(root: int) -> list[int]:
    """`root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status(pid: int) -> tuple[int, int]:
    """(threads, RSS bytes) of a process; (0, 0) once gone."""
    threads = rss = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    threads = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return threads, rss


class Sampler:
    """Peaks of the process tree under this process, sampled every `every` seconds."""

    def __init__(self, every: float = 0.05) -> None:
        self.every, self.peak = every, {"processes": 0, "threads": 0, "rss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        # the fork server is this process's child: it and what it forks count too
        while not self._stop.wait(self.every):
            pids = _tree(me)
            stats = [_status(p) for p in pids]
            now = {"processes": len(pids), "threads": sum(t for t, _ in stats),
                   "rss": sum(r for _, r in stats)}
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict[str, int]:
        """Stop sampling; the peaks."""
        self._stop.set()
        self._thread.join()
        return self.peak


def main() -> int:
    """Run the bench and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=125)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="each step's wait [2]")
    args = ap.parse_args()
    import tempfile

    import torch

    from rft_hpc.config.workflow import MultiTurnWorkflow, OverRolloutConfig
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.explorer.multiturn import TurnSettings
    from rft_hpc.explorer.overrollout import MultiTurnExplorer
    from rft_hpc.models.tiny import init_tiny_model
    from rft_hpc.tasks.task import Task

    torch.set_num_threads(1)
    n = args.tasks * args.repeat
    with tempfile.TemporaryDirectory(prefix="rft-bench-agents-") as tmp:
        engine = HFEngine(init_tiny_model(Path(tmp) / "model"))
        workflow = MultiTurnWorkflow(
            env="tools.bench.agents:WaitingSandbox", max_turns=args.turns,
            max_timeout=600.0, env_args={"seconds": args.seconds, "turns": args.turns})
        explorer = MultiTurnExplorer(engine, workflow, TurnSettings(args.repeat, 4, 1.0),
                                     OverRolloutConfig())
        tasks = [Task(task_id=f"t{i}", prompt="", answer=str(i % 10))
                 for i in range(args.tasks)]
        base = Sampler()  # before: the explorer alone
        time.sleep(0.3)
        before = base.stop()
        sampler = Sampler()
        t0 = time.perf_counter()
        records, metrics = explorer.run_step(tasks, first_group_id=0, step=0, seed=0)
        wall = time.perf_counter() - t0
        peak = sampler.stop()
        batcher = explorer.rollouts.batcher
        hosts = explorer.rollouts.hosts.started
        explorer.close()
    ok = sum(r.info.get("turns", 0) == args.turns for r in records)
    waiting = max(r.info.get("waiting_at_once", 0) for r in records)
    print(f"{n} trajectories ({args.tasks} tasks x {args.repeat}), {args.turns} turns, each "
          f"environment step waits {args.seconds:g} s (async def): {ok} of {n} played every "
          f"turn; {metrics.get('tasks_finished', 0):.0f} tasks finished")
    print(f"  wall {wall:.2f} s against the environment's own {args.turns * args.seconds:.2f} "
          f"s: ratio {args.turns * args.seconds / wall:.3f} (1.0: every trajectory in flight "
          f"at once, generation free)")
    print(f"  at most {waiting} trajectories waiting in their environments at once; "
          f"{batcher.turns} turns generated in {batcher.batches} engine submissions")
    print(f"  peak processes {peak['processes']} (before: {before['processes']}; host "
          f"processes started: {hosts}) against {n} for one process per trajectory: "
          f"{n / max(1, peak['processes'] - before['processes'] + 1):.0f}x fewer")
    print(f"  peak threads {peak['threads']} (before: {before['threads']}), peak RSS "
          f"{peak['rss'] / 2**20:.0f} MiB (before: {before['rss'] / 2**20:.0f} MiB, "
          f"{(peak['rss'] - before['rss']) / n / 1024:.1f} KiB more per trajectory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
