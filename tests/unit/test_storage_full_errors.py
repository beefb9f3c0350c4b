"""The one recognizer of a full disk or an exceeded quota (rft_hpc/core/storage.py), and the
writes that keep a file whole when the disk fills (append_whole, atomic writes)."""

from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch

from rft_hpc.core import rundir
from rft_hpc.core.storage import (
    StoppedOnFullStorage,
    StorageFull,
    append_whole,
    close_all,
    exit_status,
    full_from_exit,
    storage_full,
)
from rft_hpc.run.processes import role_stopped_full
from rft_hpc.trainer.checkpoint import _torch_save

H5PY = ("Unable to synchronously create file (file write failed: time = Mon Dec  7 08:38:46 "
        "2026\n, filename = '/runs/demo/buffer/explorer-0/.tmp-00000003.h5.42', file "
        "descriptor = 3, errno = 28, error message = 'No space left on device', buf = 0x55e9, "
        "total write size = 48, bytes this sub-write = 48, offset = 0)")
SAFETENSORS = ('Error while serializing: IoError(Os { code: 122, kind: QuotaExceeded, message: '
               '"Disk quota exceeded" })')


@pytest.mark.parametrize(("exc", "code", "path"), [
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x"), errno.ENOSPC, "/runs/x"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT, None),
    (OSError(H5PY), errno.ENOSPC, "/runs/demo/buffer/explorer-0/.tmp-00000003.h5.42"),
    (RuntimeError(SAFETENSORS), errno.EDQUOT, None),
    (RuntimeError("safetensors: StorageFull"), errno.ENOSPC, None),
])
def test_a_full_disk_is_recognized_in_each_libraries_words(exc, code, path):
    full = storage_full(exc)
    assert full is not None and full.errno == code and full.filename == path
    assert errno.errorcode[code] in str(full) and exit_status(full) == code


def test_a_full_disk_is_recognized_anywhere_in_the_chain():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/runs/ckpt/x.pt")
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as outer:
        full = storage_full(outer)
    assert full is not None and full.name == "EDQUOT" and full.filename == "/runs/ckpt/x.pt"
    assert full.describe() == "Disk quota exceeded (EDQUOT) writing /runs/ckpt/x.pt"


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "I/O error"), RuntimeError("file write "
                                 "failed"), ValueError("errno = 5"), KeyError("code: 2")])
def test_other_errors_are_not_a_full_disk(exc):
    assert storage_full(exc) is None


def test_exit_status_of_a_stopped_role_says_which():
    assert full_from_exit(28).name == "ENOSPC" and full_from_exit(122).name == "EDQUOT"
    assert full_from_exit(1) is None and full_from_exit(None) is None and \
        full_from_exit(75) is None


def test_a_short_append_is_cut_off_and_raised(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    append_whole(fd, b'{"a": 1}\n', path)
    real = os.write
    monkeypatch.setattr(os, "write", lambda f, data: real(f, data[:3]))  # the disk fills
    with pytest.raises(StorageFull, match="ENOSPC") as caught:
        append_whole(fd, b'{"b": 2}\n', path)
    assert caught.value.filename == str(path)
    monkeypatch.setattr(os, "write", real)
    os.close(fd)
    assert path.read_bytes() == b'{"a": 1}\n'


def test_an_atomic_write_on_a_full_disk_names_the_file_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "fsync", full)
    with pytest.raises(StorageFull) as caught:
        rundir.atomic_write_json(tmp_path / "state.json", {"step": 1})
    assert caught.value.filename == str(tmp_path / "state.json")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_part_on_a_full_disk_keeps_its_errno(tmp_path, monkeypatch):
    def full(_fd: int) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageFull, match="EDQUOT") as caught:
        _torch_save({"w": torch.zeros(3)}, tmp_path / "optimizer.pt")
    assert caught.value.filename == str(tmp_path / "optimizer.pt")


def test_close_all_closes_every_part_and_raises_the_first_failure():
    closed = []

    def failing(name: str):
        def close() -> None:
            closed.append(name)
            raise OSError(errno.ENOSPC, name)
        return close

    with pytest.raises(OSError, match="a"):
        close_all((failing("a"), failing("b"), lambda: closed.append("c")))
    assert closed == ["a", "b", "c"]


def test_the_launcher_names_the_role_the_error_and_the_path(tmp_path):
    log = tmp_path / "stage" / "jobs" / "explorer-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("INFO explorer-1: step 1/6\nerror: explorer-1 stopped: No space left on "
                   "device (ENOSPC) writing /r/state/explorer-1.json: free space or raise the "
                   "quota, then run the same command again; nothing committed is lost\n")
    said = role_stopped_full("explorer-1", 28, log)
    assert isinstance(said, StoppedOnFullStorage) and said.exit_status == 28
    assert str(said).startswith("explorer-1 stopped: No space left on device (ENOSPC) writing "
                                "/r/state/explorer-1.json: free space")
    log.write_text("")  # the log could not hold it: the error and the stage folder
    said = role_stopped_full("explorer-1", 122, log)
    assert "Disk quota exceeded (EDQUOT)" in str(said) and str(tmp_path / "stage") in str(said)
    assert str(said).count("nothing committed is lost") == 1


def test_the_first_failure_is_named_not_the_closes_that_failed_after_it():
    try:
        try:
            raise StorageFull(errno.ENOSPC, "/runs/buffer/explorer-0/00000003.h5")
        finally:
            raise StorageFull(errno.ENOSPC, "/runs/ledger/explorer-0.jsonl")
    except OSError as exc:
        full = storage_full(exc)
    assert full is not None and full.filename == "/runs/buffer/explorer-0/00000003.h5"


def test_a_full_disk_crosses_process_boundaries_whole():
    full = pickle.loads(pickle.dumps(StorageFull(errno.EDQUOT, "/runs/x.h5")))
    assert isinstance(full, StorageFull) and full.describe() == \
        "Disk quota exceeded (EDQUOT) writing /runs/x.h5"
