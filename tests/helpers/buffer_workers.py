"""Helpers shared by the buffer tests, and the code their writer and reader processes run.

Every test record is rebuilt from its `task_id` alone (`record_from_id`), so any process can
check that a record it reads is exactly the one that was written:

    <writer>-s<step>-r<index>[;n=<tokens>][;ts=<taskset>][;pr=<priority>][;pv=<version>]

Process entry points (`*_main`) are plain module-level functions, so that a
`multiprocessing` context that starts fresh interpreters (forkserver, spawn) can run them;
`python tests/helpers/buffer_workers.py probe-poll ...` is the command line the strace test runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from rft_hpc.buffer import BufferConfig, BufferReader, Experience, SegmentWriter

_ID = re.compile(r"^(?P<writer>[^;]+)-s(?P<step>\d+)-r(?P<index>\d+)(?P<opts>(;[a-z]+=[^;]*)*)$")
DEFAULT_TOKENS = 16
READER_MAX_PENDING = 24
"""Small on purpose in the cursor tests: polls and takes interleave over many segments."""
MARK_BEGIN = "/rft-hpc-marker-begin"
MARK_END = "/rft-hpc-marker-end"
"""Paths stat-ed around the measured polls, to find them in an strace log."""


# -- records that carry their own expected content ---------------------------------------


def make_id(writer: str, step: int, index: int, **opts: Any) -> str:
    """The task id of record `index` of `step` from `writer`; `opts` go into the id.

    Known options: n (token count), ts (task set), pr (priority, a float32 value), pv
    (policy version).
    """
    return f"{writer}-s{step}-r{index}" + "".join(f";{k}={v}" for k, v in opts.items())


def parse_id(task_id: str) -> dict[str, Any]:
    """The parts of a task id made by `make_id` (raises ValueError for anything else)."""
    m = _ID.match(task_id)
    if m is None:
        raise ValueError(f"not a test task id: {task_id!r}")
    opts = dict(kv.split("=", 1) for kv in m.group("opts").split(";") if kv)
    return {"writer": m.group("writer"), "step": int(m.group("step")),
            "index": int(m.group("index")), **opts}


def record_from_id(task_id: str) -> Experience:
    """The one record a test writes under `task_id`: every field follows from the id."""
    p = parse_id(task_id)
    seed = zlib.crc32(task_id.encode())
    rng = np.random.default_rng(seed)
    n = int(p.get("n", DEFAULT_TOKENS))
    step = p["step"]
    return Experience(
        tokens=rng.integers(0, 2**31 - 1, n, dtype=np.int32),
        prompt_length=n // 3,
        logprobs=-rng.random(n, dtype=np.float32),
        reward=float(seed % 1024) / 1024.0,  # exact in float32, as the file stores it
        task_id=task_id,
        group_id=step * 1000 + p["index"] // 4,
        taskset=p.get("ts", "default"),
        policy_version=int(p.get("pv", step)),
        step=step,
        priority=float(p.get("pr", 0.0)),
        created=1.7e9 + step,
        info={"writer": p["writer"], "index": p["index"], "tags": ["test", "é"]},
    )


def check_record(record: Any) -> dict[str, Any]:
    """Assert that `record` is exactly what its task id implies; return the id's parts."""
    expected = record_from_id(record.task_id)
    assert record == expected, f"record {record.task_id} differs from what was written"
    return parse_id(record.task_id)


def step_records(writer: str, step: int, n_records: int,
                 sizes: Sequence[int] | None = None, **opts: Any) -> list[Experience]:
    """The records of one step (token counts from `sizes`, default `DEFAULT_TOKENS` each)."""
    out = []
    for i in range(n_records):
        extra = dict(opts)
        if sizes is not None:
            extra["n"] = sizes[i]
        out.append(record_from_id(make_id(writer, step, i, **extra)))
    return out


def write_steps(buffer: Path, steps: Iterable[int], n_records: int = 4, *,
                writer: str = "w0", into: SegmentWriter | None = None,
                sizes: Sequence[int] | None = None,
                opts_of: Callable[[int, int], dict[str, Any]] | None = None) -> SegmentWriter:
    """Write one segment per step (non-durable), `n_records` records each; the writer.

    `into` continues an existing writer; `sizes` gives each record's token count and
    `opts_of(step, index)` further options of its id.
    """
    w = into or SegmentWriter(buffer, writer, "rl", durable=False)
    for step in steps:
        records = [record_from_id(make_id(
            w.writer, step, i, **({} if sizes is None else {"n": sizes[i]}),
            **({} if opts_of is None else opts_of(step, i)))) for i in range(n_records)]
        assert w.write_step(step, records) is not None
    return w


def random_sizes(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    """`n` token counts spread log-uniformly over [lo, hi] (tiny to large records)."""
    return [round(lo * (hi / lo) ** rng.random()) for _ in range(n)]


# -- reading -------------------------------------------------------------------------------


def read_new(reader: BufferReader, batch: int = 4096) -> list[Any]:
    """Poll once and take every record available now."""
    reader.poll()
    out: list[Any] = []
    while True:
        b = reader.take(batch)
        if not len(b):
            return out
        out.extend(b.records)


def drain(reader: BufferReader, batch_size: int, *, first_batch: int = 0,
          max_batches: int | None = None, versioned: bool = False) -> list[dict[str, Any]]:
    """The fixed poll/take loop of the cursor tests: what each batch handed out.

    Batch number b is taken at policy version b when `versioned`. Stops after `max_batches`
    batches or when a poll and a take bring nothing.
    """
    out = []
    b = first_batch
    while max_batches is None or b - first_batch < max_batches:
        reader.poll()
        batch = reader.take(batch_size, b if versioned else None)
        if not len(batch) and not batch.dropped_stale:
            break
        for r in batch.records:
            check_record(r)
        out.append({"refs": [str(r) for r in batch.refs],
                    "ids": [r.task_id for r in batch.records],
                    "weights": batch.weights, "uses": batch.uses,
                    "dropped": batch.dropped_stale, "version": b if versioned else None})
        b += 1
    return out


# -- process entry points -------------------------------------------------------------------


def concurrent_writer_main(buffer: str, writer: str, steps: int, n_records: int,
                           seed: int) -> None:
    """Write `steps` steps of `n_records` records of varied sizes, with small random sleeps."""
    rng = random.Random(seed)
    w = SegmentWriter(buffer, writer, "rl", durable=False)
    for step in range(steps):
        time.sleep(rng.uniform(0.0, 0.01))
        w.write_step(step, step_records(writer, step, n_records,
                                        random_sizes(rng, n_records, 1, 512)))


def killable_writer_main(conn: Connection, buffer: str, writer: str, log: str, seed: int,
                         durable: bool, steps_per_segment: int, n_records: int,
                         max_tokens: int, max_steps: int | None = None) -> None:
    """Restartable writer that writes until killed (or `max_steps` steps, then flushes).

    Sends {"next_step", "removed_temporaries"} once constructed, waits for "go", then
    writes steps of records of random sizes (for at most 10 s), appending
    "<step_start> <step_end>" to `log` right after each segment is committed.
    """
    w = SegmentWriter(buffer, writer, "rl", durable=durable,
                      steps_per_segment=steps_per_segment)
    conn.send({"next_step": w.next_step, "removed_temporaries": w.removed_temporaries})
    assert conn.recv() == "go"
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    deadline = time.monotonic() + 10.0
    written = 0
    while time.monotonic() < deadline and (max_steps is None or written < max_steps):
        step = w.next_step
        start = w.committed_step
        records = step_records(writer, step, n_records,
                               random_sizes(rng, n_records, 1, max_tokens))
        written += 1
        if w.write_step(step, records) is not None:
            os.write(fd, f"{start} {w.committed_step}\n".encode())
    start = w.committed_step
    if w.flush() is not None:
        os.write(fd, f"{start} {w.committed_step}\n".encode())
    os.close(fd)


def compacting_writer_main(conn: Connection, buffer: str, writer: str, log: str, seed: int,
                           durable: bool, min_segments: int, fanout: int) -> None:
    """A writer that compacts its own folder after every two steps, until killed (10 s).

    Sends {"next_step"} once its writer has recovered, waits for "go"; appends each
    committed step's end to `log`. Every committed segment counts as consumed.
    """
    from rft_hpc.buffer.compact import compact_writer
    from rft_hpc.config.buffer import CompactConfig

    config = CompactConfig(min_segments=min_segments, fanout=fanout)
    w = SegmentWriter(buffer, writer, "rl", durable=durable)
    conn.send({"next_step": w.next_step})
    assert conn.recv() == "go"
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for _ in range(2):
            step = w.next_step
            w.write_step(step, step_records(writer, step, 3, random_sizes(rng, 3, 1, 64)))
            os.write(fd, f"{w.committed_step}\n".encode())
        compact_writer(Path(buffer), writer, w.committed_step, config, durable=durable)
    os.close(fd)


def resume_drain_main(buffer: str, config: dict[str, Any], state_file: str, out_file: str,
                      batch_size: int, first_batch: int, versioned: bool) -> None:
    """Build a reader from a saved cursor, drain the rest, write the batches as JSON."""
    with open(state_file, encoding="utf-8") as f:
        state = json.load(f)
    reader = BufferReader(buffer, BufferConfig.model_validate(config), state=state,
                          max_pending=READER_MAX_PENDING)
    out = drain(reader, batch_size, first_batch=first_batch, versioned=versioned)
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f)


def tiny_writer_main(buffer: str, writer: str, n_segments: int) -> None:
    """Write `n_segments` one-step segments of one 1-token record each, quickly."""
    write_steps(Path(buffer), range(n_segments), 1, writer=writer, sizes=[1])


def _stat_quietly(path: str) -> None:
    """stat(2) a path that need not exist (a marker in strace's log)."""
    with contextlib.suppress(FileNotFoundError):
        os.stat(path)


def probe_poll(cases: Sequence[tuple[str, str]], polls: int) -> list[dict[str, int]]:
    """For each (buffer, cursor file): restore a reader, poll once to warm up, then `polls`
    polls between a stat of `MARK_BEGIN` and one of `MARK_END` (markers for strace)."""
    out = []
    for buffer, state_file in cases:
        with open(state_file, encoding="utf-8") as f:
            reader = BufferReader(buffer, state=json.load(f))
        warm = reader.poll()
        _stat_quietly(MARK_BEGIN)
        added = sum(reader.poll() for _ in range(polls))
        _stat_quietly(MARK_END)
        out.append({"warm_up_added": warm, "added": added, "pending": reader.pending})
    return out


def receive(conn: Connection, proc: Any, timeout: float = 60.0) -> Any:
    """The next message from a child process; fails fast if the child dies first or stays
    silent past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.05):
        assert proc.is_alive(), f"child exited with {proc.exitcode} before reporting"
        assert time.monotonic() < deadline, "child did not report in time"
    return conn.recv()


def main(argv: list[str] | None = None) -> int:
    """Command line: `probe-poll --polls N --case BUFFER CURSOR [--case ...]`."""
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe-poll")
    probe.add_argument("--case", nargs=2, action="append", required=True,
                       metavar=("BUFFER", "CURSOR"))
    probe.add_argument("--polls", type=int, default=100)
    args = p.parse_args(argv)
    print(json.dumps(probe_poll([tuple(c) for c in args.case], args.polls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
