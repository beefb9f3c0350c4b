"""One thread for the device work of both colocated loops.

Why: on CPUs torch computes with OpenMP, which keeps a team of worker threads for each
thread that calls into it. Two loops computing from two threads make two teams; more
workers than cores make OpenMP stop spinning between parallel regions, and every small op
then waits for a sleeping worker to wake: generation and training each ran at half speed
(measured: 17 -> 35 ms and 26 -> 50 ms a step on 2 cores). So every call that computes
(the engine's generation and weight loads, the trainer's step, weight gathering,
checkpoint parts, held-out evaluation) runs on one `DeviceThread`, with the process's torch
threads, while the loop threads run their bookkeeping with one torch thread each and never
start a team. On a GPU it is the order the device would impose anyway: one call at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class DeviceThread:
    """Runs calls one at a time on a thread of its own, with `threads` torch threads."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device",
                                        initializer=_set_torch_threads, initargs=(threads,))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` run on the device thread; returns its result or raises
        its exception, in the caller's thread."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Let the thread end once the calls submitted are done."""
        self._pool.shutdown(wait=True)


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class OnDevice:
    """`target` with its `methods` run on a `DeviceThread`; every other attribute (and
    protocol membership) is the target's own."""

    def __init__(self, target: object, device: DeviceThread, methods: Collection[str]) -> None:
        self._target, self._device, self._methods = target, device, frozenset(methods)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name in self._methods:
            return functools.partial(self._device.call, value)
        return value


ENGINE_CALLS = ("generate", "poll", "load_weights")
"""What an engine computes with: generation and taking a version in."""
TRAINER_CALLS = ("step", "full_state_dict", "checkpoint_parts")
"""What a trainer computes with: a step, the full weights, the checkpoint's states."""
EVALUATION_CALLS = ("score",)
"""Held-out evaluation's generation and scoring."""
