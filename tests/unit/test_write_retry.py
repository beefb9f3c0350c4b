"""Writes and late-visible files on a shared filesystem (rft_hpc/core/rundir.py,
rft_hpc/core/retry.py): whole writes done again after a transient error, opens for append
retried, a file a pointer names waited for until it appears."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from rft_hpc.core import rundir
from rft_hpc.core.retry import PROCESS_COUNTERS, open_append
from rft_hpc.core.rundir import RunDir, atomic_write_text, commit_file, remove_tree
from rft_hpc.runtime.common import final_heartbeat, write_heartbeat
from rft_hpc.sync.weight_files import load_weights, publish_weights


def fail_first(real, code: int, times: int = 1):
    """`real`, failing with `code` on its first `times` calls."""
    calls = []

    def call(*args, **kwargs):
        calls.append(args)
        if len(calls) <= times:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)
    return call, calls


def later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_an_atomic_write_is_done_again_under_a_fresh_name(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    opened, calls = fail_first(open, errno.EIO)
    monkeypatch.setattr(rundir, "open", opened, raising=False)
    before = PROCESS_COUNTERS["io_retries"]
    atomic_write_text(tmp_path / "state.json", "{}\n")
    assert (tmp_path / "state.json").read_text() == "{}\n"
    assert len(calls) == 2 and calls[0][0] != calls[1][0]  # a new temporary name
    assert os.listdir(tmp_path) == ["state.json"]
    assert PROCESS_COUNTERS["io_retries"] == before + 1


def test_a_commit_whose_rename_happened_but_failed_counts_as_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real = os.replace

    def replace_then_fail(src, dst):
        real(src, dst)
        raise OSError(errno.EIO, "the reply was lost")

    tmp = tmp_path / ".tmp-seg"
    tmp.write_bytes(b"data")
    monkeypatch.setattr(os, "replace", replace_then_fail)
    commit_file(tmp, tmp_path / "seg", durable=False)
    assert os.listdir(tmp_path) == ["seg"]


def test_an_open_for_append_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    opened, calls = fail_first(os.open, errno.ESTALE)
    monkeypatch.setattr(os, "open", opened)
    fd = open_append(tmp_path / "ledger.jsonl")
    os.write(fd, b"x\n")
    os.close(fd)
    assert len(calls) == 2 and (tmp_path / "ledger.jsonl").read_bytes() == b"x\n"


def test_removing_a_tree_stops_at_an_io_error_without_raising(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def stale(*args, **kwargs):
        raise OSError(errno.ESTALE, "Stale file handle")
    monkeypatch.setattr(rundir.shutil, "rmtree", stale)
    (tmp_path / "tmp").mkdir()
    remove_tree(tmp_path / "tmp")  # left for the next cleanup
    assert (tmp_path / "tmp").is_dir()


def test_weights_latest_names_are_waited_for_until_they_appear(tmp_path: Path):
    folder = publish_weights(tmp_path, {"x": torch.ones(2)}, 1)
    hidden = tmp_path / "elsewhere"
    folder.rename(hidden)  # LATEST names v1, which this node does not see yet
    timer = later(0.3, lambda: hidden.rename(folder))
    late = PROCESS_COUNTERS["io_late"]
    try:
        assert load_weights(tmp_path, 1)["x"].tolist() == [1.0, 1.0]
    finally:
        timer.join()
    assert PROCESS_COUNTERS["io_late"] == late + 1


def test_a_finished_roles_last_heartbeat_is_waited_for(tmp_path: Path):
    run = RunDir(tmp_path)
    write_heartbeat(run, "trainer", status="running", step=5)
    timer = later(0.3, lambda: write_heartbeat(run, "trainer", status="done", step=6))
    try:
        beat = final_heartbeat(run, "trainer")
    finally:
        timer.join()
    assert (beat["status"], beat["step"]) == ("done", 6)
