"""core.watch: a waiter is woken by an entry renamed into or created in a watched folder, and
otherwise sleeps its whole timeout; StopFlag.sleep ends early on such a change."""

from __future__ import annotations

import os
import threading
import time

from rft_hpc.core.watch import FolderWatch
from rft_hpc.runtime.common import StopFlag


def _later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_a_rename_into_the_folder_wakes_the_waiter_before_its_timeout(tmp_path):
    (tmp_path / ".tmp-x").write_text("1")
    watch = FolderWatch(tmp_path)
    assert watch.active  # Linux: inotify is there
    thread = _later(0.2, lambda: os.replace(tmp_path / ".tmp-x", tmp_path / "x"))
    t0 = time.monotonic()
    assert watch.wait(30.0)
    assert time.monotonic() - t0 < 20.0  # woken by the rename, not by the 30 s timeout
    thread.join()


def test_a_new_subfolder_wakes_the_waiter_and_a_quiet_folder_does_not(tmp_path):
    watch = FolderWatch(tmp_path)
    assert not watch.wait(0.05)
    thread = _later(0.1, lambda: (tmp_path / "explorer-0").mkdir())
    assert watch.wait(30.0)
    thread.join()
    assert not watch.wait(0.05)  # the event was consumed: nothing new since


def test_changes_made_before_the_wait_end_it_at_once(tmp_path):
    watch = FolderWatch(tmp_path)
    (tmp_path / "a").write_text("1")
    t0 = time.monotonic()
    assert watch.wait(30.0)
    assert time.monotonic() - t0 < 20.0


def test_a_missing_folder_is_not_watched_and_waits_sleep(tmp_path):
    watch = FolderWatch(tmp_path / "not-yet")
    assert not watch.active
    assert not watch.wait(0.01)
    (tmp_path / "not-yet").mkdir()
    assert watch.add(tmp_path / "not-yet") and watch.active
    watch.close()
    assert not watch.active and not watch.wait(0.01)


def test_stop_flag_sleep_returns_early_on_a_change_without_stopping(tmp_path):
    stop, watch = StopFlag(), FolderWatch(tmp_path)
    thread = _later(0.1, lambda: (tmp_path / "LATEST").write_text("3\n"))
    t0 = time.monotonic()
    assert stop.sleep(30.0, watch) is False
    assert time.monotonic() - t0 < 20.0
    thread.join()
