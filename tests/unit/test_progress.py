"""A role's rate and time left from its heartbeat, their text, and a local role's state."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rft_hpc.monitor.progress import format_eta, format_rate, format_step, progress
from rft_hpc.run.processes import alive, start_token
from rft_hpc.run.status import role_state
from rft_hpc.runtime.command import role_env
from rft_hpc.runtime.logs import LOG_LEVEL_ENV, step_line


def test_rate_and_time_left_come_from_the_steps_this_process_did():
    # restarted at step 10, 20 steps in 40 s since: 0.5 steps/s, 70 steps left -> 140 s
    p = progress({"step": 30, "total": 100, "started": 1000.0, "start_step": 10,
                  "time": 1040.0})
    assert (p.step, p.total, p.rate, p.eta) == (30, 100, 0.5, 140.0)


def test_no_rate_before_the_first_step_and_nothing_left_once_done():
    first = progress({"step": 10, "total": 100, "started": 1000.0, "start_step": 10,
                      "time": 1005.0})
    assert first.rate is None and first.eta is None
    assert progress({"step": 100, "total": 100}).eta == 0.0
    # a trainer that ran out of data is done short of its total
    assert progress({"status": "done", "step": 40, "total": 100, "started": 0.0,
                     "start_step": 0, "time": 10.0}).eta == 0.0
    assert progress({}) == progress({"status": "starting"})
    assert progress({}).step is None and progress({}).eta is None


@pytest.mark.parametrize(("rate", "text"), [
    (None, "-"), (0.0, "-"), (4.0, "4.0 steps/s"), (1.0, "1.0 steps/s"), (0.8, "1.2 s/step"),
    (0.1, "10.0 s/step"), (1 / 250, "250 s/step")])
def test_rate_text(rate, text):
    assert format_rate(rate) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "-"), (0.0, "0s"), (-3.0, "0s"), (44.6, "45s"), (59.4, "59s"), (60.0, "1m00s"),
    (185.0, "3m05s"), (3599.0, "59m59s"), (3600.0, "1h00m"), (7650.0, "2h07m"),
    (90000.0, "25h00m")])
def test_time_left_text(seconds, text):
    assert format_eta(seconds) == text


def test_step_text():
    assert (format_step(3, 6), format_step(3, None), format_step(None, 6)) == ("3/6", "3", "-")


def test_step_line():
    assert step_line(3, 6, version=2, reward=0.41234, seconds=1.234) == \
        "step 3/6 version 2 reward 0.412 1.23 s"
    line = step_line(1, None, version=None, reward=None, seconds=0.5, loss=0.123456,
                     taskset="eval")
    assert line == "step 1/- version - reward - 0.50 s loss 0.1235 taskset eval"


@pytest.mark.parametrize(("status", "lives", "state"), [
    ("running", True, "running"), (None, True, "running"), ("stopped", True, "running"),
    ("done", True, "finished"), ("done", False, "finished"), ("stopped", False, "stopped"),
    ("running", False, "dead"), (None, False, "dead"),
    ("running", None, "running"), ("stopped", None, "stopped"), ("done", None, "finished")])
def test_role_state(status, lives, state):
    assert role_state(status, lives) == state


def test_a_process_counts_as_alive_until_it_ends_and_only_as_itself():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        token = start_token(proc.pid)
        assert token is not None and alive(proc.pid, token) and alive(proc.pid)
        assert not alive(proc.pid, str(int(token) + 1))  # the pid, reused by another process
        proc.kill()
        deadline = time.monotonic() + 30
        while alive(proc.pid, token):
            assert time.monotonic() < deadline, "a killed process still counts as alive"
            time.sleep(0.01)
        assert Path(f"/proc/{proc.pid}").exists()  # a zombie (not reaped yet) counts as ended
        proc.wait()
        assert not alive(proc.pid, token) and not alive(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_log_level_travels_in_the_roles_environment(monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert LOG_LEVEL_ENV not in role_env(2)
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    assert role_env(2)[LOG_LEVEL_ENV] == "WARNING"
