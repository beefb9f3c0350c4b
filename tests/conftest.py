"""Fixtures shared by the tests: buffer folders, seeded randomness, worker processes."""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path

import pytest
from helpers.tools import check_needs

from rft_hpc.buffer.layout import ensure_buffer_dir

# Test workers share the machine: each one's role processes count on its share of the cores
# (rft_hpc.runtime.placement), as a laptop's would count on all of them; so does the worker's
# own torch (in-process trainers, model builds): four workers of two OpenMP threads each on 2
# cores spin and wait on each other (four processes of two threads doing small torch steps did
# 7x less work than four of one, measured 2026-12-06). Not OMP_NUM_THREADS: the processes a
# test starts keep their own settings. (Set in each xdist worker, which knows the worker
# count: the controller's value would be inherited by the workers.)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    _SHARE = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["RFT_HPC_CORES"] = str(_SHARE)
    torch.set_num_threads(_SHARE)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test whose tools are missing is skipped (failed under CI=true) before its fixtures
    start anything: see tests/helpers/tools.py."""
    check_needs(item)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): two workers per core this process may use, at most
    4. Many tests wait on processes, Slurm and files: on 2 cores, two workers kept the cores
    58 % busy (588 tests in 1138 s), three 66 % (1004 s); with 676 tests (2026-12-06), three
    took 1955 s and four 1651 s, with the cores 99 % busy throughout."""
    return max(1, min(4, 2 * len(os.sched_getaffinity(0))))


# The files that take minutes, longest first (measured 2026-12-05 on 2 cores: 750, 520, 420,
# 330, 255, 215, 215, 175 s of a 4-worker suite; test_plain_install.py's pip install and
# demo: 280 s, 2026-12-06; the real workload's two families, a file each since 2026-12-06;
# the tool recipe's two stages: 281 s, 2026-12-07).
# They start first: under `--dist loadfile` a worker runs a whole file, and one of these
# begun late keeps one worker busy long after the others ran out of work. A stale entry
# costs only time, never a test.
LONG_FILES = ("test_real_workload.py", "test_real_workload_qwen3.py", "test_chaos.py",
              "test_tool_recipe.py", "test_rlhf_recipe.py", "test_rl_algorithms_learn.py",
              "test_experiment_run.py", "test_plain_install.py", "test_megatron_train.py",
              "test_trainer_distributed.py", "test_sync_roles.py", "test_bench.py")


def _schedule_order(items: list[pytest.Item]) -> None:
    """Order the files as xdist hands them out (pyproject's addopts turn its own reordering
    off): LONG_FILES first, then files with more tests before files with fewer (xdist's own
    order); a file's tests keep their order."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        return ((LONG_FILES.index(name), 0) if name in LONG_FILES
                else (len(LONG_FILES), -counts[name]))

    items.sort(key=rank)  # stable: files stay whole and in order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses the local Slurm cluster first in its file may be the one that starts
    it (a session fixture; under xdist each worker takes whole files and joins or starts the
    shared cluster in the first it runs): its timeout grows by the longest that a start may
    take."""
    from helpers.slurm_cluster import JOIN_BOUND_S

    _schedule_order(items)

    if not config.pluginmanager.hasplugin("timeout"):
        return  # without pytest-timeout (or with -p no:timeout) no test has a timeout
    firsts: dict[str, pytest.Item] = {}
    for item in items:
        if "slurm_env" in item.fixturenames:
            firsts.setdefault(str(item.path), item)
    for first in firsts.values():
        marker = first.get_closest_marker("timeout")
        own = (marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
               if marker else None)
        if own is None:
            own = (config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT")
                   or config.getini("timeout"))
        if own and float(own) > 0:  # 0: timeouts are off
            first.add_marker(pytest.mark.timeout(float(own) + JOIN_BOUND_S))


@pytest.fixture(autouse=True)
def _cancel_submitted_runs() -> Iterator[None]:
    """A failed cluster test must not leave its jobs waiting in the shared cluster's queue:
    the runs that helpers.slurm_runs.submit made are cancelled after each test."""
    yield
    if "helpers.slurm_runs" in sys.modules:
        sys.modules["helpers.slurm_runs"].cancel_submitted()


@pytest.fixture
def buffer_dir(tmp_path: Path) -> Path:
    """An empty buffer folder (with its FORMAT marker)."""
    return ensure_buffer_dir(tmp_path / "buffer")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A seeded random generator; set RFT_TEST_SEED to replay a failing run.

    The seed is printed (shown by pytest for a failing test).
    """
    seed = int(os.environ.get("RFT_TEST_SEED", random.randrange(1 << 30)))
    print(f"{request.node.nodeid}: RFT_TEST_SEED={seed}")
    return random.Random(seed)


@pytest.fixture(scope="session")
def mp() -> Iterator[BaseContext]:
    """A multiprocessing context whose children are fresh processes, cheap to start.

    The forkserver imports h5py, numpy and the buffer package once; each child is forked
    from that clean server (never from pytest), so starting dozens of writers costs
    milliseconds rather than an interpreter start each.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["helpers.buffer_workers", "h5py", "numpy", "rft_hpc.buffer"])
    yield ctx


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model folder with its tokenizer, built locally once per session."""
    from rft_hpc.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """The clients' environment of the running local Slurm cluster (started if needed;
    stopped when the last test session that started it ends, see tests/helpers/slurm_cluster.py)."""
    from helpers.slurm_cluster import ClusterError, ensure_cluster

    try:
        return ensure_cluster()
    except ClusterError as exc:
        error = str(exc)
    pytest.fail(error, pytrace=False)  # outside "except": no chained traceback
