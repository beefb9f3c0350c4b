"""The explorer's side of the reward job, on real files: a request goes to the folder of
the explorer's reward job, the response's outcomes come back in call order naming their
request, both files are then gone; a reward job that has finished while a request waits
fails the explorer with a message naming it, instead of a hang; so does a local reward
process that died and was not started again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from rft_hpc.config.rewards import RewardModelSpec
from rft_hpc.tasks.remote_reward import HeartbeatWatch, RemoteModelScorer, RewardJobGone
from rft_hpc.tasks.reward_pool import RewardOutcome
from rft_hpc.tasks.reward_requests import (
    job_folder,
    read_request,
    unanswered,
    write_response,
)
from rft_hpc.tasks.task import Task


def calls(n, rm="/models/rm"):
    term = RewardModelSpec(model=rm, normalize="batch", batch_size=4)
    return [(Task(prompt=f"{i}+1=", answer=str(i + 1), task_id=str(i), reward="model:rm",
                  reward_terms=(term,)), str(i)) for i in range(n)]


def test_a_response_comes_back_in_call_order_and_the_files_go(tmp_path):
    # two submissions before a pump go as one request
    old = job_folder(tmp_path, 1) / "explorer-3.deadbeef.000007.req"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an earlier process's request")
    scorer = RemoteModelScorer(tmp_path, explorer=3, count=2)  # job 3 % 2 = 1
    assert not old.exists()  # an earlier process's requests are withdrawn
    first, second = scorer.submit(calls(2)), scorer.submit(calls(3)[2:])
    assert unanswered(job_folder(tmp_path, 1)) == []  # sent by the next pump, together
    scorer.pump(0.0)
    (path,) = unanswered(job_folder(tmp_path, 1))
    request = read_request(path)
    assert request.explorer == 3
    # the request carries what the model reads and which model, as plain JSON
    assert [(t.prompt, t.reward_terms, r) for t, r in request.calls] \
        == [(t.prompt, t.reward_terms, r) for t, r in calls(3)]
    assert json.loads(path.read_text())["calls"][0] == {
        "task_id": "0", "prompt": "0+1=", "messages": None, "answer": "1",
        "reward": "model:rm", "response": "0", "kind": "model",
        "term": {"model": "/models/rm", "stage": None, "normalize": "batch", "weight": 1.0,
                 "batch_size": 4}}
    scorer.pump(0.0)
    assert not first.done and not second.done
    write_response(path.parent, request.id, [RewardOutcome(0.5), RewardOutcome(error="boom"),
                                             RewardOutcome(2.0)])
    scorer.pump(None)
    # each submission's outcomes in its call order, named by their place in the request
    assert first.result() == [RewardOutcome(0.5, request=f"{request.id}/0"),
                              RewardOutcome(error="boom", request=f"{request.id}/1")]
    assert second.result() == [RewardOutcome(2.0, request=f"{request.id}/2")]
    assert os.listdir(path.parent) == []
    scorer.close()


def test_a_finished_reward_job_fails_the_waiting_explorer_with_why(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "reward-0.json").write_text(json.dumps({"role": "reward-0", "status": "done"}))
    scorer = RemoteModelScorer(tmp_path, explorer=0, count=1, liveness_seconds=0.2)
    scorer.submit(calls(2))
    t0 = time.monotonic()
    with pytest.raises(RewardJobGone, match=r"wait for reward-0 .* reward-0 has finished"):
        scorer.pump(None)
    assert time.monotonic() - t0 < 5
    scorer.close()
    assert os.listdir(job_folder(tmp_path, 0)) == []


def test_a_dead_local_reward_process_is_gone_once_it_is_not_started_again(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    beat = {"role": "reward-0", "status": "running", "host": socket.gethostname()}
    (state / "reward-0.json").write_text(json.dumps({**beat, "pid": dead.pid}))
    watch = HeartbeatWatch(tmp_path, 0, restart_seconds=0.3)
    assert watch.gone() is None  # it may be restarting
    time.sleep(0.4)
    assert watch.gone() == (f"reward-0's process {dead.pid} died and was not started again "
                            "within 0.3 s")
    (state / "reward-0.json").write_text(json.dumps({**beat, "pid": os.getpid()}))
    assert watch.gone() is None  # started again: alive
