"""Four writer processes and one reader at the same time: every record exactly once, intact."""

from __future__ import annotations

import random
import time
from collections import Counter
from multiprocessing.context import BaseContext
from pathlib import Path

from helpers.buffer_workers import check_record, concurrent_writer_main

from rft_hpc.buffer import BufferReader
from rft_hpc.buffer.layout import stray_temporaries

WRITERS = 4
STEPS = 40
RECORDS = 16


def test_four_writers_one_reader(buffer_dir: Path, mp: BaseContext, rng: random.Random) -> None:
    writers = [f"w{k}" for k in range(WRITERS)]
    procs = [mp.Process(target=concurrent_writer_main,
                        args=(str(buffer_dir), name, STEPS, RECORDS, rng.randrange(1 << 30)))
             for name in writers]
    for p in procs:
        p.start()
    reader = BufferReader(buffer_dir)
    seen: Counter[tuple[str, int, int]] = Counter()
    refs: Counter[str] = Counter()
    last_step = dict.fromkeys(writers, -1)
    taken_while_writing = 0
    expected = {(w, s, i) for w in writers for s in range(STEPS) for i in range(RECORDS)}
    deadline = time.monotonic() + 60
    while len(seen) < len(expected) and time.monotonic() < deadline:
        writing = any(p.is_alive() for p in procs)
        reader.poll()
        batch = reader.take(rng.randrange(1, 200))
        if writing:
            taken_while_writing += len(batch)
        for ref, record in zip(batch.refs, batch.records, strict=True):
            parts = check_record(record)
            # FIFO hands out each writer's steps in order.
            assert parts["step"] >= last_step[parts["writer"]]
            last_step[parts["writer"]] = parts["step"]
            assert ref.writer == parts["writer"] and ref.segment == parts["step"]
            assert ref.index == parts["index"]
            seen[parts["writer"], parts["step"], parts["index"]] += 1
            refs[str(ref)] += 1
        if not len(batch):
            time.sleep(0.005)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # Nothing more arrives after the writers are done.
    reader.poll()
    assert len(reader.take(10**6)) == 0
    assert max(seen.values()) == 1, "a record was handed out twice"
    assert max(refs.values()) == 1
    assert set(seen) == expected
    assert taken_while_writing > 0, "the reader never read while the writers were writing"
    assert reader.counters["corrupt_segments"] == 0
    for w in writers:
        assert stray_temporaries(buffer_dir / w) == []
