"""The one retry of shared-file reads (rft_hpc/core/retry.py): bounded backoff, counted,
logged once, and verdicts left to proof."""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from pathlib import Path

import pytest

from rft_hpc.core.retry import (
    TRANSIENT_ERRNOS,
    ReadRetry,
    RetryPolicy,
    StillUnreadable,
    io_errno,
    io_metrics,
)


class Failing:
    """A read of a real file that first raises the given errors, one per call."""

    def __init__(self, path: Path, *errors: BaseException) -> None:
        self.path = path
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.path.read_bytes()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "segment.h5"
    path.write_bytes(b"payload")
    return path


def oserror(code: int, path: Path) -> OSError:
    return OSError(code, "injected", str(path))


def test_the_default_policy_is_a_few_tries_over_a_few_seconds() -> None:
    delays = RetryPolicy().delays()
    assert 3 <= len(delays) + 1 <= 6
    assert delays == sorted(delays) and 1.0 <= sum(delays) <= 5.0
    assert all(d <= RetryPolicy().max_delay_s for d in delays)


@pytest.mark.parametrize("code", sorted(TRANSIENT_ERRNOS))
def test_transient_errors_are_retried_with_growing_waits_and_counted(
        data: Path, code: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rft_hpc.core.retry")
    waits: list[float] = []
    counters: Counter[str] = Counter()
    read = Failing(data, oserror(code, data), oserror(code, data))
    got = ReadRetry(counters, sleep=waits.append).read("segment", data, read)
    assert got == b"payload" and read.calls == 3
    assert waits == RetryPolicy().delays()[:2]
    assert io_metrics(counters) == {"io_retries": 2, "io_recovered": 1, "io_gave_up": 0,
                                    "io_late": 0}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one warning per read, naming the path and the errno
    assert str(data) in warnings[0] and errno.errorcode[code] in warnings[0]


def test_errors_that_outlast_the_tries_end_in_still_unreadable_within_the_bound(
        data: Path) -> None:
    policy = RetryPolicy(tries=3, first_delay_s=0.05, factor=2.0)
    counters: Counter[str] = Counter()
    read = Failing(data, *(oserror(errno.ESTALE, data) for _ in range(10)))
    t0 = time.monotonic()
    with pytest.raises(StillUnreadable) as caught:
        ReadRetry(counters, policy).read("segment", data, read)
    elapsed = time.monotonic() - t0
    assert read.calls == 3
    assert 0.15 <= elapsed < 1.0, elapsed  # 0.05 + 0.1 s of waits, real sleeps
    assert caught.value.errno == errno.ESTALE and caught.value.filename == str(data)
    assert io_metrics(counters) == {"io_retries": 2, "io_recovered": 0, "io_gave_up": 1,
                                    "io_late": 0}


def test_errors_that_are_not_transient_are_raised_at_once(data: Path) -> None:
    counters: Counter[str] = Counter()
    retry = ReadRetry(counters, sleep=lambda s: pytest.fail("slept"))
    for error in (PermissionError(errno.EACCES, "no", str(data)),
                  FileNotFoundError(errno.ENOENT, "gone", str(data)),
                  OSError(errno.ENOSPC, "full", str(data))):
        read = Failing(data, error)
        with pytest.raises(type(error)):
            retry.read("segment", data, read)
        assert read.calls == 1
    proven = Failing(data, ValueError("checksum mismatch in tokens"))
    with pytest.raises(ValueError, match="checksum"):
        retry.read("segment", data, proven, proof=lambda e: isinstance(e, ValueError))
    assert proven.calls == 1
    assert counters["io_retries"] == 0


def test_enoent_of_a_file_that_existed_is_retried(data: Path) -> None:
    read = Failing(data, FileNotFoundError(errno.ENOENT, "gone for a moment", str(data)))
    assert ReadRetry(sleep=lambda s: None).read("segment", data, read, existed=True) \
        == b"payload"
    assert read.calls == 2


def test_an_error_without_errno_is_judged_only_when_it_repeats_exactly(data: Path) -> None:
    retry = ReadRetry(Counter(), sleep=lambda s: None)
    twice = Failing(data, OSError("bad object header"), OSError("bad object header"))
    with pytest.raises(OSError, match="bad object header"):
        retry.read("segment", data, twice)
    assert twice.calls == 2
    once = Failing(data, KeyError("kind"))
    assert retry.read("segment", data, once) == b"payload" and once.calls == 2
    changing = Failing(data, *(RuntimeError(f"odd {i}") for i in range(10)))
    with pytest.raises(StillUnreadable) as caught:
        retry.read("segment", data, changing)
    assert caught.value.errno is None and changing.calls == 4


def test_the_errno_hdf5_writes_into_its_message_counts() -> None:
    exc = OSError("Unable to synchronously open file (file read failed: time = Sun Dec  6, "
                  "filename = 'x.h5', errno = 116, error message = 'Stale file handle')")
    assert exc.errno is None and io_errno(exc) == errno.ESTALE
    wrapped = RuntimeError("reading failed")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert io_errno(wrapped) == errno.EIO
    assert io_errno(ValueError("checksum mismatch")) is None


def test_a_nested_give_up_is_not_retried_again(data: Path) -> None:
    inner = StillUnreadable(errno.EIO, data, 4, OSError(errno.EIO, "x"))
    read = Failing(data, inner)
    with pytest.raises(StillUnreadable):
        ReadRetry(sleep=lambda s: pytest.fail("slept")).read("archive", data, read)
    assert read.calls == 1


def test_a_named_file_not_visible_yet_is_waited_for_and_counted_late(data: Path) -> None:
    waits: list[float] = []
    counters: Counter[str] = Counter()
    missing = [FileNotFoundError(errno.ENOENT, "no such file", str(data)) for _ in range(6)]
    read = Failing(data, *missing)
    got = ReadRetry(counters, sleep=waits.append).read("manifest", data, read, named=True)
    assert got == b"payload" and read.calls == 7  # more waits than the tries of an error
    assert waits == RetryPolicy().appear_delays()[:6]
    assert io_metrics(counters) == {"io_retries": 6, "io_recovered": 1, "io_gave_up": 0,
                                    "io_late": 1}


def test_the_wait_for_a_named_file_is_bounded_by_appear_s() -> None:
    policy = RetryPolicy(appear_s=60.0)
    waits = policy.appear_delays()
    assert sum(waits) == pytest.approx(60.0) and max(waits) == policy.max_delay_s
    assert waits[:3] == policy.delays()[:3]  # the same growth, then steady
    counters: Counter[str] = Counter()
    never = Failing(Path("/nonexistent"), *(FileNotFoundError(errno.ENOENT, "x")
                                            for _ in range(len(waits) + 1)))
    with pytest.raises(StillUnreadable) as caught:
        ReadRetry(counters, policy, sleep=lambda s: None).read("x", "/n", never, named=True)
    assert caught.value.errno == errno.ENOENT and never.calls == len(waits) + 1
    assert counters["io_gave_up"] == 1


def test_a_named_file_that_is_gone_ends_the_wait_at_once(data: Path) -> None:
    counters: Counter[str] = Counter()
    read = Failing(data, *(FileNotFoundError(errno.ENOENT, "x") for _ in range(9)))
    looks = iter([False, False, True])
    with pytest.raises(FileNotFoundError):
        ReadRetry(counters, sleep=lambda s: None).read("x", data, read, named=True,
                                                       absent=lambda: next(looks))
    assert read.calls == 3 and counters["io_retries"] == 2


def test_errors_and_waits_have_their_own_budgets(data: Path) -> None:
    """EIO while waiting for a file to appear uses the tries of an error, not the wait."""
    counters: Counter[str] = Counter()
    read = Failing(data, FileNotFoundError(errno.ENOENT, "x"), oserror(errno.EIO, data),
                   FileNotFoundError(errno.ENOENT, "x"), oserror(errno.EIO, data),
                   oserror(errno.EIO, data))
    policy = RetryPolicy(tries=4)
    assert ReadRetry(counters, policy, sleep=lambda s: None).read(
        "x", data, read, named=True) == b"payload"
    assert counters["io_retries"] == 5 and counters["io_late"] == 1


def test_writes_are_done_again_after_transient_errors_and_counted(data: Path) -> None:
    counters: Counter[str] = Counter()
    done: list[int] = []

    def write() -> int:
        done.append(len(done))
        if len(done) < 3:
            raise oserror(errno.EIO, data)
        return len(done)

    assert ReadRetry(counters, sleep=lambda s: None).write("state", data, write) == 3
    assert io_metrics(counters)["io_retries"] == 2 and counters["io_recovered"] == 1


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "full"), ValueError("bug")])
def test_writes_that_fail_for_good_are_not_done_again(data: Path, error: Exception) -> None:
    calls: list[int] = []

    def write() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        ReadRetry(Counter(), sleep=lambda s: None).write("state", data, write)
    assert calls == [1]


def test_a_file_is_read_again_until_it_settles(data: Path) -> None:
    counters: Counter[str] = Counter()
    values = iter(["running", "running", "done"])
    got = ReadRetry(counters, sleep=lambda s: None).read_settled(
        "heartbeat", data, lambda: next(values), lambda v: v == "done")
    assert got == "done" and counters["io_retries"] == 2 and counters["io_late"] == 1


def test_a_file_that_never_settles_gives_its_last_value_after_appear_s(data: Path) -> None:
    waits: list[float] = []
    policy = RetryPolicy(appear_s=5.0)
    got = ReadRetry(Counter(), policy, sleep=waits.append).read_settled(
        "heartbeat", data, lambda: "running", lambda v: v == "done")
    assert got == "running" and sum(waits) == pytest.approx(5.0)


def test_an_errno_quoted_by_torch_is_found() -> None:
    exc = RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with "
                       "strerror: Input/output error")
    assert io_errno(exc) == errno.EIO
    assert io_errno(RuntimeError("strerror: Permission denied")) is None  # no passing fault


def test_a_write_failing_without_an_errno_is_done_again_unless_it_repeats(data: Path) -> None:
    hdf5 = OSError("Unable to synchronously create file (can't retrieve stat info for file)")
    failing = Failing(data, hdf5)
    assert ReadRetry(Counter(), sleep=lambda s: None).write("segment", data, failing) \
        == b"payload"
    again = Failing(data, *(OSError("the same") for _ in range(3)))
    with pytest.raises(OSError, match="the same"):
        ReadRetry(Counter(), sleep=lambda s: None).write("segment", data, again)
    assert again.calls == 2


def test_hdf5_failing_to_stat_a_file_is_an_io_error_not_proof() -> None:
    exc = OSError("Unable to synchronously open file (can't retrieve stat info for file)")
    assert io_errno(exc) == errno.EIO
