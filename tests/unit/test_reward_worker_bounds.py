"""The reward workers an explorer may have, from its allocation (runtime/placement.py)."""

from __future__ import annotations

from rft_hpc.runtime.placement import MAX_REWARD_WORKERS, WORKER_BYTES, reward_worker_bounds


def test_a_setting_bounds_both(monkeypatch):
    monkeypatch.setenv("RFT_HPC_CORES", "4")
    assert reward_worker_bounds(3) == (3, 3)


def test_cores_bound_computing_calls_and_memory_bounds_waiting_ones(monkeypatch):
    monkeypatch.setenv("RFT_HPC_CORES", "4")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(40 * WORKER_BYTES >> 20))  # MB
    assert reward_worker_bounds(None) == (10, 4)  # a quarter of the memory, 64 MiB each
    monkeypatch.setenv("SLURM_MEM_PER_NODE", str(1 << 20))  # a TB: capped
    assert reward_worker_bounds(None) == (MAX_REWARD_WORKERS, 4)
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "100")  # less than a worker: still the cores
    assert reward_worker_bounds(None) == (4, 4)


def test_memory_per_cpu_counts_the_cores(monkeypatch):
    monkeypatch.delenv("SLURM_MEM_PER_NODE", raising=False)
    monkeypatch.setenv("RFT_HPC_CORES", "2")
    monkeypatch.setenv("SLURM_MEM_PER_CPU", str(64 * WORKER_BYTES >> 20))
    assert reward_worker_bounds(None) == (32, 2)
