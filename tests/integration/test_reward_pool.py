"""Reward worker processes (rft_hpc.tasks.reward_pool): a reward that raises, hangs, dies
or returns no number costs only its own call; the pool kills and replaces the worker of a
call that overran and goes on, and the outcomes keep the order of the calls."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers.paths import ROOT

from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

REWARDS = '''
import os
import time

def flaky(task, response):
    if task.task_id.endswith("3"):
        raise ValueError(f"no score for {task.task_id}")
    return 1.0

def hangs(task, response, *, seconds):
    if task.task_id.endswith("2"):
        time.sleep(seconds)
    return 0.5

def dies(task, response):
    if task.task_id == "t1":
        os._exit(3)
    return 2.0

def words(task, response):
    return "many"

def waits_for_company(task, response, *, folder, company, seconds):
    # a remote call: the worker waits, no core used, until `company` calls wait at once
    # (or `seconds` pass): only a pool that grew to `company` workers lets them all go soon;
    # its pid, negative when it gave up waiting
    open(os.path.join(folder, task.task_id), "w").close()
    end = time.monotonic() + seconds
    while len(os.listdir(folder)) < company and time.monotonic() < end:
        time.sleep(0.01)
    met = len(os.listdir(folder)) >= company
    return float(os.getpid() if met else -os.getpid())

def computes_pid(task, response, *, seconds):
    end = time.process_time() + seconds  # a core busy for `seconds`
    while time.process_time() < end:
        pass
    return float(os.getpid())
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module, importable here and (through sys.path) in the workers."""
    (tmp_path / "pool_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pool_rewards"
    sys.modules.pop("pool_rewards", None)


def calls(name, n=5, **args):
    return [(Task(f"t{i}", "", "#### 4", reward=name, reward_args=args), "4") for i in range(n)]


@pytest.mark.parametrize("workers", [1, 2])
def test_failing_calls_cost_only_themselves(user_rewards, workers):
    with RewardPool(workers=workers, timeout=1.0) as pool:
        flaky = pool.score(calls(f"{user_rewards}:flaky"))
        assert [o.score for o in flaky] == [1.0, 1.0, 1.0, 0.0, 1.0]
        assert flaky[3].error == "ValueError: no score for t3" and not flaky[3].timed_out

        t0 = time.monotonic()
        hung = pool.score(calls(f"{user_rewards}:hangs", seconds=60))
        assert time.monotonic() - t0 < 30  # killed at its limit, not waited for
        assert [o.score for o in hung] == [0.5, 0.5, 0.0, 0.5, 0.5]
        assert hung[2].timed_out and hung[2].error == "timed out (no result within 1 s)"
        assert not any(o.failed for i, o in enumerate(hung) if i != 2)

        died = pool.score(calls(f"{user_rewards}:dies"))
        assert [o.score for o in died] == [2.0, 0.0, 2.0, 2.0, 2.0]
        assert died[1].error == "the reward's process died (exit code 3)"

        words = pool.score(calls(f"{user_rewards}:words", n=2))
        assert all(o.error and "returned str 'many', not a number" in o.error for o in words)

        # the replaced workers score on; 1 s was the hang's limit, and a worker forked
        # under a loaded suite (two xdist workers) may take longer for a real call
        pool.timeout = 10.0
        math = pool.score(calls("math_verify", n=3))
        assert [o.score for o in math] == [1.0, 1.0, 1.0]
        assert pool.restarts == 2  # the hung call's worker and the one that died


def test_an_unimportable_reward_fails_each_call_with_the_reason():
    with RewardPool(timeout=5.0) as pool:
        outcomes = pool.score(calls("gone_module_xyz:f", n=2))
    assert [o.score for o in outcomes] == [0.0, 0.0]
    assert all("cannot be imported: No module named 'gone_module_xyz'" in o.error
               for o in outcomes)


def test_rewards_the_explorer_computes_itself_start_no_worker():
    # exact_match (IN_PROCESS_REWARDS) is scored in the caller: a run of such rewards never
    # starts a worker, nor the fork server that would import the rewards
    # (one worker at most: a slow first call may otherwise add a second, as it should)
    with RewardPool(workers=1, timeout=5.0) as pool:
        outcomes = pool.score(calls("exact_match", n=3))
        assert [o.score for o in outcomes] == [0.0, 0.0, 0.0]  # "4" is not "#### 4"
        assert (pool.size, pool.peak) == (0, 0)
        assert [o.score for o in pool.score(calls("math_verify", n=2))] == [1.0, 1.0]
        assert (pool.size, pool.peak) == (1, 1)


@pytest.mark.parametrize("bound", [4, 12])
def test_calls_that_wait_get_workers_up_to_the_bound(user_rewards, bound, tmp_path):
    (tmp_path / "waiting").mkdir()
    with RewardPool(workers=bound, timeout=120.0, cores=1) as pool:
        assert pool.size == 0  # the pool starts its first worker with the first call
        outcomes = pool.score(calls(f"{user_rewards}:waits_for_company", n=2 * bound,
                                    folder=str(tmp_path / "waiting"), company=bound,
                                    seconds=100.0))
        assert not any(o.failed for o in outcomes)
        # the calls waited, so more ran at once than the one core allows computing calls:
        # `bound` of them together (else they would have waited their 100 s), never more
        assert len({o.score for o in outcomes}) == pool.peak == bound
        # they met, rather than giving up on the wait (the reward says which: no clock here,
        # a loaded machine starts the workers slower)
        assert all(o.score > 0 for o in outcomes)


def test_calls_that_compute_get_one_worker_per_core(user_rewards):
    with RewardPool(workers=12, timeout=60.0, cores=2) as pool:
        outcomes = pool.score(calls(f"{user_rewards}:computes_pid", n=12, seconds=0.3))
        assert not any(o.failed for o in outcomes)
        assert len({o.score for o in outcomes}) == pool.peak == 2


OUTLIVE_SIGNALS = """
import json, multiprocessing.forkserver, os, signal, time
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

calls = [(Task(f"t{i}", "", "#### 4", reward="math_verify"), "4") for i in range(2)]
seen = {}
with RewardPool(workers=1, timeout=10.0) as pool:
    seen["before"] = [o.score for o in pool.score(calls)]
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    worker = pool._workers[0].proc.pid
    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        for pid in (server, worker):
            os.kill(pid, sig)
    time.sleep(0.5)
    seen["server_running"] = os.waitpid(server, os.WNOHANG) == (0, 0)
    seen["after"] = [o.score for o in pool.score(calls)]
    seen["restarts"] = pool.restarts
    seen["same_worker"] = pool._workers[0].proc.pid == worker
print(json.dumps(seen))
"""


def test_workers_and_their_fork_server_outlive_slurms_stop_signals():
    # Slurm signals every process of a step (USR2 before the time limit, TERM at it): a role
    # that is stopping still scores its last batch, so its workers must not die of them.
    # In a fresh interpreter, as a role is: this test process's fork server may be another
    # fixture's (conftest's `mp`), and one killed here would break the tests after it.
    result = subprocess.run([sys.executable, "-c", OUTLIVE_SIGNALS], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"before": [1.0, 1.0], "server_running": True, "after": [1.0, 1.0],
                    "restarts": 0, "same_worker": True}
