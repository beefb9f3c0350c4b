"""The learning-rate schedule: warm-up, then constant, linear or cosine decay to a floor,
and a resumed scheduler continuing the same curve."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rft_hpc.trainer.lr_schedule import build_scheduler, lr_factor


def test_warmup_then_constant():
    assert [lr_factor(s, 10, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_starts_at_one_and_heads_for_the_floor(schedule):
    factors = [lr_factor(s, 12, warmup=2, schedule=schedule, min_ratio=0.1) for s in range(13)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[12] == pytest.approx(0.1)  # the step after the last
    assert all(a > b for a, b in itertools.pairwise(factors[2:]))
    assert all(0.1 < f <= 1.0 for f in factors[:12])


def test_cosine_halfway_is_the_mean_of_start_and_floor():
    assert lr_factor(5, 10, schedule="cosine", min_ratio=0.2) == pytest.approx(0.6)
    assert lr_factor(5, 10, schedule="linear") == pytest.approx(0.5)
    assert math.isclose(lr_factor(0, 1, schedule="cosine"), 1.0)  # one step: at full rate


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'step'"):
        lr_factor(0, 10, schedule="step")


def _rates(scheduler, optimizer, steps):
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_a_resumed_scheduler_continues_the_curve():
    def fresh():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return opt, build_scheduler(opt, 10, warmup=2, schedule="cosine", min_ratio=0.0)

    opt, sched = fresh()
    whole = _rates(sched, opt, 10)
    opt, sched = fresh()
    first = _rates(sched, opt, 4)
    state = sched.state_dict()
    opt, sched = fresh()
    sched.load_state_dict(state)
    for group in opt.param_groups:  # the optimizer's state carries the rate in a checkpoint
        group["lr"] = sched.get_last_lr()[0]
    assert first + _rates(sched, opt, 6) == pytest.approx(whole)
    assert whole[1] == pytest.approx(0.1) and 0.0 < whole[-1] < 0.01
