"""The colocated placement's in-memory weight handover (`sync.memory.MemoryHandover`):
the follower gets each newest version once, a buffer the engine is copying from is never
written into, and a waiting follower wakes when a version comes."""

from __future__ import annotations

import threading
import time

import torch

from rft_hpc.sync.memory import MemoryHandover


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3,), value), "b": torch.full((2, 2), value)}


def test_the_newest_version_is_taken_once_as_a_copy():
    handover = MemoryHandover()
    assert handover.take() is None
    live = weights(1.0)
    handover.send(live, 1)
    live["a"].add_(5.0)  # the trainer goes on changing its parameters in place
    version, state = handover.take()
    assert version == 1 and torch.equal(state["a"], torch.full((3,), 1.0))
    assert handover.take() is None  # taken already
    handover.give_back(state)
    handover.send(weights(2.0), 2)
    handover.send(weights(3.0), 3)  # two versions before the follower looks: the newest
    version, state = handover.take()
    assert version == 3 and torch.equal(state["b"], torch.full((2, 2), 3.0))


def test_a_lent_buffer_is_never_written_while_the_engine_copies_from_it():
    handover = MemoryHandover()
    handover.send(weights(1.0), 1)
    _, lent = handover.take()
    for v in range(2, 6):  # the trainer publishes on while the engine holds version 1
        handover.send(weights(float(v)), v)
    assert torch.equal(lent["a"], torch.full((3,), 1.0))
    handover.give_back(lent)
    version, state = handover.take()
    assert version == 5 and torch.equal(state["a"], torch.full((3,), 5.0))
    assert state is not lent


def test_buffers_are_reused_turn_by_turn():
    handover = MemoryHandover()
    seen = set()
    for v in range(1, 8):
        handover.send(weights(float(v)), v)
        version, state = handover.take()
        assert version == v and float(state["a"][0]) == v
        seen.add(id(state["a"]))
        handover.give_back(state)
    assert len(seen) <= 2


def test_the_newest_version_stays_for_a_checkpoint_to_write():
    handover = MemoryHandover()
    assert handover.newest() is None
    handover.send(weights(4.0), 4)
    _, state = handover.take()
    handover.give_back(state)
    version, kept = handover.newest()
    assert version == 4 and torch.equal(kept["a"], torch.full((3,), 4.0))


def test_a_waiting_follower_wakes_when_a_version_comes_or_the_handover_closes():
    handover = MemoryHandover()
    assert handover.wait(0.01) is False
    woke = []

    def follower():
        woke.append(handover.wait(30.0))

    thread = threading.Thread(target=follower)
    thread.start()
    time.sleep(0.05)
    handover.send(weights(1.0), 1)
    thread.join(10)
    assert woke == [True]
    handover.take()
    thread = threading.Thread(target=follower)
    thread.start()
    handover.close()
    thread.join(10)
    assert woke == [True, True] and not thread.is_alive()
