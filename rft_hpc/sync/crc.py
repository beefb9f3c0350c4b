"""CRC-32 (zlib's) of data that streams past in chunks, computed on helper threads.

`RunningCrc` folds chunks in order on one thread, or, with `workers > 1`, checksums chunks
independently on several threads and joins the results with `crc32_combine` (zlib's
algorithm; Python's zlib does not expose it); with no workers, in the caller as they come.
zlib releases the GIL while it checksums, so on a machine with cores to spare a checksum
costs no time: one thread keeps up with writing (the disk is slower), two with reading from
the page cache (memcpy is faster than one thread's CRC: ~4 GB/s). A process pinned to one
core checksums in the caller (`for_this_process`).
"""

from __future__ import annotations

import functools
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

_POLY = 0xEDB88320  # CRC-32, bit-reversed


def _times(matrix: tuple[int, ...] | list[int], vector: int) -> int:
    """`matrix` (32 columns over GF(2)) times `vector` (32 bits)."""
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


@functools.lru_cache(maxsize=64)
def _zero_bytes(count: int) -> tuple[int, ...]:
    """The operator that feeds `count` zero bytes through a CRC-32 register."""
    operator = [1 << n for n in range(32)]  # identity
    power = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        power = _square(power)  # 2, 4, then 8 zero bits: one zero byte
    while count:
        if count & 1:
            operator = [_times(power, column) for column in operator]
        count >>= 1
        if count:
            power = _square(power)
    return tuple(operator)


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A followed by B, from crc32(A), crc32(B) and len(B) (zlib's
    `crc32_combine`). Operators are cached by length: chunks of one size cost ~32 steps."""
    return _times(_zero_bytes(length2), crc1) ^ crc2 if length2 > 0 else crc1


class RunningCrc:
    """The CRC-32 of byte chunks, computed on worker threads while the caller writes or
    reads the next chunk. Use as a context manager; `value` waits for the last chunk. A
    chunk must not change until `value` returns.

    One worker folds the chunks in order (cheap per chunk: for many small chunks); several
    checksum chunks side by side and combine them (for few large chunks)."""

    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="crc32") if workers else None
        self._parallel = workers > 1
        self._last: Future[int] | None = None
        self._parts: list[tuple[Future[int], int]] = []
        self._crc = 0  # folded so far, with no workers

    @classmethod
    def for_this_process(cls, workers: int) -> RunningCrc:
        """`workers` threads where this process may run on more than one core; none (the
        caller checksums each chunk itself) where it is pinned to one, since threads there
        only add switches and cannot overlap with the caller."""
        return cls(workers if len(os.sched_getaffinity(0)) > 1 else 0)

    def __enter__(self) -> RunningCrc:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def add(self, chunk: bytes | memoryview) -> None:
        """Fold `chunk` into the checksum (asynchronously, with workers)."""
        if self._pool is None:
            self._crc = zlib.crc32(chunk, self._crc)
            return
        if self._parallel:
            self._parts.append((self._pool.submit(zlib.crc32, chunk), len(chunk)))
            return
        prev = self._last
        self._last = self._pool.submit(
            lambda: zlib.crc32(chunk, 0 if prev is None else prev.result()))

    @property
    def value(self) -> int:
        """The checksum of every chunk added so far."""
        if self._pool is None:
            return self._crc
        if self._parallel:
            crc = 0
            for part, length in self._parts:
                crc = crc32_combine(crc, part.result(), length)
            return crc
        return 0 if self._last is None else self._last.result()
