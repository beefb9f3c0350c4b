"""The trainer does not end before it has seen every step the explorers say they wrote:
their last segments may reach its node after their final heartbeats (rft_hpc/trainer/loop.py
`next_batch`)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from rft_hpc.buffer import Experience, SegmentWriter
from rft_hpc.buffer.reader import BufferReader
from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.runtime.common import StopFlag, write_heartbeat
from rft_hpc.trainer.loop import next_batch


def records(step: int, n: int = 4) -> list[Experience]:
    return [Experience(np.arange(6, dtype=np.int32), 2, logprobs=np.zeros(6, np.float32),
                       reward=1.0, task_id=f"t{step}-{i}", group_id=i, taskset="math",
                       policy_version=0, step=step) for i in range(n)]


def test_the_trainer_waits_for_segments_its_explorers_say_they_wrote(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    config = ExperimentConfig.model_validate({"buffer": {"poll_interval": 0.05}})
    writer = SegmentWriter(run.buffer, "explorer-0", "rl", steps_per_segment=1)
    writer.write_step(0, records(0))
    write_heartbeat(run, "explorer-0", status="done", step=2)  # seen before step 1's segment
    late = threading.Timer(0.5, lambda: writer.write_step(1, records(1)))
    late.start()
    try:
        batch = next_batch(BufferReader(run.buffer, config.buffer), 64, 0, config=config,
                           run=run, stop=StopFlag())
    finally:
        late.join()
    assert batch is not None and sorted({r.step for r in batch.records}) == [0, 1]
    assert len(batch) == 8
