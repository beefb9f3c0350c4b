"""How many CPU threads a role uses: the cores of its allocation, shared out when roles
share a machine.

`explorer.threads` / `trainer.threads` set it; null (the default) fits the regime:

- in a Slurm job, a role has its allocation to itself: every CPU the job may use
  (its CPU affinity, which Slurm sets to the job's CPUs);
- in `rft-hpc run`, the roles share this machine. When they take turns (`mode: both`
  with `sync.offset: 0`: the explorer waits for each version while the trainer trains it,
  the trainer waits for each step) each uses all the cores; when they overlap, the cores
  are split among them (at least one each).

`explorer.cpus` / `trainer.cpus` pin a role to given cores (one thread per core unless
`threads` says otherwise), e.g. to give the explorer and the trainer a core each, as two
GPUs would be separate (tools/bench/pipeline.py).

The local launcher works the numbers out once (`local_threads`) and hands each role its
share in `RFT_HPC_THREADS`; the role resolves its own (`role_threads`) and logs the reason.
"""

from __future__ import annotations

import os

from rft_hpc.config import ExperimentConfig

CORES_ENV = "RFT_HPC_CORES"
"""Cores rft-hpc may count on this machine (default: the process's CPU affinity)."""
THREADS_ENV = "RFT_HPC_THREADS"
"""A role's thread count as `rft-hpc run` worked it out for the roles on this machine."""


def available_cores() -> int:
    """CPUs this process may run on: `RFT_HPC_CORES` when set (a machine shared with other
    work, e.g. test workers); else its CPU affinity, capped in a Slurm job by the CPUs the
    job was given on this node (`SLURM_CPUS_PER_TASK`, else `SLURM_JOB_CPUS_PER_NODE`:
    a cluster that does not bind jobs to their CPUs still allots them)."""
    given = os.environ.get(CORES_ENV, "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_JOB_CPUS_PER_NODE"):
        allotted = os.environ.get(name, "").split("(")[0].split(",")[0]
        if allotted.isdigit() and int(allotted) > 0:
            return min(cores, int(allotted))
    return cores


def local_threads(config: ExperimentConfig, cores: int | None = None) -> dict[str, int]:
    """Threads of the `trainer` and of each `explorer` for roles sharing `cores` cores (this
    machine's by default) in `rft-hpc run`; explicit settings win."""
    cores = cores or available_cores()
    explorers = config.explorer.count if config.mode in ("both", "explore") else 0
    trainers = 1 if config.mode in ("both", "train", "bench") else 0
    take_turns = config.mode == "both" and config.sync.offset == 0
    share = cores if take_turns else max(1, cores // max(1, explorers + trainers))
    def threads(setting: int | None, cpus: list[int] | None) -> int:
        return setting or (len(cpus) if cpus else share)
    return {"trainer": threads(config.trainer.threads, config.trainer.cpus),
            "explorer": threads(config.explorer.threads, config.explorer.cpus)}


def role_threads(setting: int | None, cpus: list[int] | None = None) -> tuple[int, str]:
    """Pin this process to `cpus` when given; then its threads and why: its setting, else
    one per pinned core, else its launcher's share, else every core of its allocation."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if setting is not None:
        return setting, "set in the config" + (f", pinned to cores {cpus}" if cpus else "")
    if cpus:
        return len(cpus), f"one per core it is pinned to: {cpus}"
    shared = os.environ.get(THREADS_ENV)
    if shared and shared.isdigit() and int(shared) > 0:
        return int(shared), "this machine's cores shared among the roles of rft-hpc run"
    return available_cores(), "every core of the allocation"


WORKER_BYTES = 64 << 20
"""Memory set aside per reward worker process when the memory bounds their count (a worker
forked from the fork server holds a few tens of MB of its own)."""

MAX_REWARD_WORKERS = 256
"""The most reward workers an explorer derives from its allocation."""


def available_memory() -> int:
    """Bytes of memory this process's allocation holds: a Slurm job's (`SLURM_MEM_PER_NODE`,
    else `SLURM_MEM_PER_CPU` x its cores), else its cgroup's limit, else what the machine
    has available now."""
    per_node = os.environ.get("SLURM_MEM_PER_NODE", "")
    per_cpu = os.environ.get("SLURM_MEM_PER_CPU", "")
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node) << 20
    if per_cpu.isdigit() and int(per_cpu) > 0:
        return (int(per_cpu) << 20) * available_cores()
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            return int(limit)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30


def reward_worker_bounds(setting: int | None) -> tuple[int, int]:
    """(the most reward workers, the most computing at once) of an explorer:
    `explorer.reward_workers` for both when set; else its cores for rewards that compute,
    and for rewards that wait as many as a quarter of its memory holds at `WORKER_BYTES`
    each (at least its cores, at most `MAX_REWARD_WORKERS`)."""
    if setting is not None:
        return setting, setting
    cores = available_cores()
    by_memory = available_memory() // (4 * WORKER_BYTES)
    return max(cores, min(MAX_REWARD_WORKERS, by_memory)), cores
