"""Local roles forked from the fork server (`rft_hpc.run.forked`): a `python -m` command
runs as that program would (arguments, environment, own session, atexit, exit status), its
output goes to its log, and the launcher stops it as it stops a `subprocess.Popen`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rft_hpc.run.forked import ForkedProcess, forkable

PROGRAM = [sys.executable, "-m", "helpers.child_program"]


def test_only_python_m_commands_of_this_interpreter_are_forked():
    assert forkable(PROGRAM)
    assert not forkable(["mpiexec", "-n", "1", *PROGRAM])
    assert not forkable(["/usr/bin/python3", "-m", "helpers.child_program"])


def test_a_forked_program_gets_its_arguments_environment_log_and_exit_status(tmp_path):
    log = tmp_path / "child.log"
    log.write_text("earlier life\n")
    child = ForkedProcess([*PROGRAM, "0", "3"], {"CHILD_VALUE": "42"}, log)
    assert child.wait(timeout=60) == 3 and child.poll() == 3 and child.returncode == 3
    assert log.read_text().splitlines() == [
        "earlier life", "argv ['0', '3'] own session True value 42", "atexit"]


def test_a_forked_program_is_stopped_like_a_popen(tmp_path):
    log = tmp_path / "child.log"
    child = ForkedProcess([*PROGRAM, "60", "0"], {}, log)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)
    assert child.poll() is None
    deadline = time.monotonic() + 60
    while "argv" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # its SIGTERM handler is set once it has printed
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 15
    assert log.read_text().splitlines()[-2:] == ["terminated", "atexit"]
    killed = ForkedProcess([*PROGRAM, "60", "0"], {}, log)
    killed.kill()
    assert killed.wait(timeout=60) == -signal.SIGKILL
    killed.send_signal(signal.SIGTERM)  # ended: nothing to signal, no error
