"""The `nccl` weight-sync method on gloo: real processes, several versions, a killed peer."""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import pytest
import torch
from helpers.sync_workers import collective_receiver, digests, reusing_receiver, state_for

from rft_hpc.sync.collective import CollectiveSender
from rft_hpc.sync.fabric import (
    Destination,
    Layout,
    SyncFailed,
    plan,
    sender_tensors,
    source_buffers,
)

CTX = multiprocessing.get_context("forkserver")


def collect(q, n: int) -> list[list]:
    """`n` reports from the receivers (each [id, kind, version, detail])."""
    return [q.get(timeout=60) for _ in range(n)]


def test_plan_round_trip_keeps_every_byte():
    state = state_for(7)
    layout = Layout.of(state, 65536)
    pieces = plan(layout)
    assert any(p.packed and len(p.runs) > 1 for p in pieces)  # small tensors share buckets
    assert any(not p.packed for p in pieces)  # the big one travels in place, chunked
    assert all(p.nbytes <= 65536 for p in pieces)
    assert sum(p.nbytes for p in pieces) == layout.total_bytes
    dest = Destination(Layout.from_json(layout.to_json()), pieces, torch.device("cpu"))
    for src, dst in zip(source_buffers(pieces, sender_tensors(state, torch.device("cpu"))),
                        dest.buffers, strict=True):
        dst.copy_(src)
    assert digests(dest.state_dict()) == digests(state)
    assert list(dest.state_dict()) == list(state)


def test_versions_arrive_intact(tmp_path: Path):
    q = CTX.Queue()
    procs = [CTX.Process(target=collective_receiver, args=(str(tmp_path), i, 3, q))
             for i in range(2)]
    for p in procs:
        p.start()
    sender = CollectiveSender(tmp_path, 2, timeout=20, join_timeout=60, bucket_mb=0.25,
                              checksum=True)
    for v in (1, 2, 3):
        assert sender.send(state_for(v), v) == [0, 1]
    got = collect(q, 6)
    sender.close()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for i in range(2):
        mine = [g for g in got if g[0] == i]
        assert [g[2] for g in mine] == [1, 2, 3] and {g[1] for g in mine} == {"got"}
        for _, _, v, dig in mine:
            assert dig == digests(state_for(v))
    assert sender.generation == 1


def test_given_back_buffers_are_reused_and_kept_ones_never_overwritten(tmp_path: Path):
    q = CTX.Queue()
    proc = CTX.Process(target=reusing_receiver, args=(str(tmp_path), q))
    proc.start()
    sender = CollectiveSender(tmp_path, 1, timeout=20, join_timeout=60, bucket_mb=0.25)
    for v in (3, 4, 5):  # one layout (BIG_VERSIONS have another)
        assert sender.send(state_for(v), v) == [0]
    got = collect(q, 4)
    sender.close()
    proc.join(30)
    assert proc.exitcode == 0
    assert [(kind, v) for kind, v, _, _ in got] == [("got", 3), ("got", 4), ("got", 5),
                                                     ("kept", 4)]
    for _, v, dig, _ in got:
        assert dig == digests(state_for(v))  # v4 intact although v5 came after it
    address = {v: ptr for kind, v, _, ptr in got if kind == "got"}
    assert address[4] == address[3]  # v3 given back: v4 landed in its buffers
    assert address[5] != address[4]  # v4 kept: v5 got buffers of its own


def test_killed_receiver_fails_the_sync_then_a_new_generation_works(tmp_path: Path):
    # Every side uses the same timeout: the sender's next generation waits that long for
    # survivors to notice the failure.
    q = CTX.Queue()
    survivor = CTX.Process(target=collective_receiver, args=(str(tmp_path), 0, 5, q, None, 3))
    doomed = CTX.Process(target=collective_receiver, args=(str(tmp_path), 1, 5, q, 1, 3))
    survivor.start()
    doomed.start()
    sender = CollectiveSender(tmp_path, 2, timeout=3, join_timeout=60, bucket_mb=0.25,
                              checksum=True)
    assert sender.send(state_for(1), 1) == [0, 1]
    with pytest.raises(SyncFailed) as failure:  # receiver 1 dies in the middle of v2
        sender.send(state_for(2), 2)
    assert failure.value.version == 2
    doomed.join(30)
    assert doomed.exitcode == -9
    sender.join_timeout = 2  # the dead receiver will not come: go ahead without it
    assert sender.send(state_for(3), 3) == [0]
    assert sender.generation == 2

    restarted = CTX.Process(target=collective_receiver, args=(str(tmp_path), 1, 5, q, None, 3))
    restarted.start()
    sender.join_timeout = 60
    # v4 goes to the survivor alone until the restarted receiver has joined; then the
    # sender regroups (generation 3) and both get it.
    while sender.send(state_for(4), 4) != [0, 1]:
        pass
    assert sender.generation == 3
    assert sender.send(state_for(5), 5) == [0, 1]
    got = []
    while sum(g[1:3] == ["got", 5] for g in got) < 2:
        got.extend(collect(q, 1))
    sender.close()
    for p in (survivor, restarted):
        p.join(30)
        assert p.exitcode == 0
    outcomes = [(g[0], g[1], g[2]) for g in got]
    assert (0, "got", 1) in outcomes and (1, "got", 1) in outcomes
    assert (0, "failed", 2) in outcomes  # the survivor learns of the failure too
    assert (0, "got", 3) in outcomes
    assert [o for o in outcomes if o[0] == 1][-2:] == [(1, "got", 4), (1, "got", 5)]
    for _, kind, v, dig in got:
        if kind == "got":
            assert dig == digests(state_for(v))
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
