"""Streaming explorers (rft_hpc.explorer.step_stream): reward batches scored as they come, steps
kept in flight together and committed in order, the same records as the step barrier (up to
the float order of the engine's batches), and
an asynchronous demo run whose steps overlap and whose audit passes."""

from __future__ import annotations

import pytest
from helpers.explore import explore_step
from helpers.paths import DEMO
from helpers.runs import rft, rollouts, short

from rft_hpc.engines.hf import HFEngine
from rft_hpc.explorer.protocols import StepTasks, Workflow
from rft_hpc.explorer.step_stream import StepStream
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

SLOW = "helpers.rewards:slow_exact_match"


def tasks(step: int, reward: str = "exact_match", **args) -> list[Task]:
    return [Task(f"s{step}t{i}", f"{step}+{i}=", str(step + i), reward=reward,
                 reward_args=args) for i in range(3)]


def test_a_batch_submitted_later_finishes_first_when_the_earlier_one_is_slow():
    with RewardPool(workers=2, timeout=30.0) as pool:
        slow = pool.submit([(tasks(0, SLOW, seconds=3.0)[0], "0")])
        fast = pool.submit([(t, "x") for t in tasks(1)])
        while not fast.done:
            pool.pump(timeout=None)
        assert not slow.done  # the slow call holds only its own batch
        assert [o.score for o in fast.result()] == [0.0, 0.0, 0.0]
        with pytest.raises(RuntimeError, match="still being scored"):
            slow.result()
        while not slow.done:
            pool.pump(timeout=None)
        assert [o.score for o in slow.result()] == [1.0]


def test_steps_in_flight_are_committed_in_order_with_the_step_barriers_records(tiny_model):
    engine = HFEngine(tiny_model)
    settings = SamplingSettings(repeat=4, max_new_tokens=4, temperature=1.0)
    with RewardPool(workers=2, timeout=30.0) as pool:
        stream = StepStream(engine, settings, pool, window=3)
        assert isinstance(stream, Workflow)
        # step 0's rewards are slow: steps 1 and 2 are generated and scored meanwhile
        plan = {0: tasks(0, SLOW, seconds=1.0), 1: tasks(1), 2: tasks(2)}
        for step, ts in plan.items():
            stream.submit(StepTasks(step, ts, range(10 * step, 10 * step + len(ts)),
                                    seed=100 + step))
        assert not stream.has_room and len(stream) == 3
        got = []
        while len(stream):
            stream.advance()
            got += list(stream.completed())
        assert [c.step for c in got] == [0, 1, 2]
        assert got[0].metrics["steps_in_flight"] == 3.0  # 1 and 2 were done and waiting
        for done in got:
            # the step barrier: the step alone in flight
            want, _ = explore_step(engine, plan[done.step], settings,
                                   first_group_id=10 * done.step, step=done.step,
                                   seed=100 + done.step, pool=pool)
            for e in [*want, *done.experiences]:
                e.created = 0.0  # the time each was made
            # the engine generated the three steps in one batch: the same tokens (each group
            # samples from its own seed), log-probs equal up to the float order of another
            # batch shape, all else equal
            for e, w in zip(done.experiences, want, strict=True):
                assert e.logprobs == pytest.approx(w.logprobs, abs=1e-5)
                e.logprobs = w.logprobs
            assert done.experiences == want  # tokens, rewards, ids
            assert all(e.policy_version == 0 and e.step == done.step
                       for e in done.experiences)


@pytest.mark.timeout(400)
def test_an_asynchronous_run_keeps_steps_in_flight_and_its_audit_passes(tmp_path, tiny_model):
    result = rft("run", DEMO, *short(tmp_path, tiny_model, "--set", "sync.offset=2",
                                     "--set", "explorer.count=1",
                                     "--set", "explorer.reward_workers=2",
                                     "--set", f"tasks.reward=tests.{SLOW}"),
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "demo"
    stage = run / "stages" / "1-grpo"
    rows = read_metrics(stage / "metrics" / "explorer-0.jsonl")
    assert max(r["steps_in_flight"] for r in rows) > 1  # step s+1 went out before s was in
    records = rollouts(stage)
    assert len(records) == 12 * 2 * 8  # 6 trainer steps of 32 records, 16 per explorer step
    # two explorer steps per trainer step: on-policy, step s would sample with version s // 2
    lags = [r.step // 2 - r.policy_version for r in records]
    assert max(lags) <= 2 and max(lags) >= 1  # ahead of the weights, within sync.offset
    audit = rft("audit", run)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]


def test_an_engine_that_fails_to_start_leaves_no_reward_worker(tmp_path):
    """The reward workers start while the engine loads; when it fails they must stop: they
    ignore stop signals, and multiprocessing joins a role's children at its exit (a forked
    explorer whose vLLM import failed hung there, its error never logged)."""
    import multiprocessing

    from rft_hpc.config import load_config
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.explorer.role import single_turn_workflow

    config = load_config(DEMO, [f"run.root={tmp_path}", "explorer.reward_workers=2"])

    def broken_engine():
        raise ImportError("no engine here")

    before = set(multiprocessing.active_children())
    with pytest.raises(ImportError, match="no engine here"):
        single_turn_workflow(config, RunDir(tmp_path / "run"), "explorer-0", broken_engine)
    assert set(multiprocessing.active_children()) <= before
