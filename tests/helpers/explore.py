"""One explorer step through the explorer's own single-turn path, for tests that need a
step's records without a run: a `StepStream` with a window of one step (the step barrier)
and reward worker processes (`RewardPool`)."""

from __future__ import annotations

from collections.abc import Sequence

from rft_hpc.buffer.records import Experience
from rft_hpc.engines.protocol import StreamingEngine
from rft_hpc.explorer.protocols import StepTasks
from rft_hpc.explorer.step_stream import StepStream
from rft_hpc.explorer.workflow import SamplingSettings
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task


def explore_step(engine: StreamingEngine, tasks: Sequence[Task], settings: SamplingSettings,
                 *, first_group_id: int, step: int, seed: int,
                 pool: RewardPool | None = None) -> tuple[list[Experience], dict[str, float]]:
    """Step `step`'s records of `tasks` (group ids `first_group_id + index`, sampling seed
    `seed`) and its metrics, as the explorer writes them; scored by `pool` (left open), or
    by a pool of one worker started and stopped here."""
    own = pool is None
    pool = RewardPool(workers=1, timeout=60.0) if pool is None else pool
    stream = StepStream(engine, settings, pool, window=1)
    try:
        stream.submit(StepTasks(step, list(tasks),
                                range(first_group_id, first_group_id + len(tasks)), seed))
        while True:
            stream.advance()
            for done in stream.completed():
                return done.experiences, done.metrics
    finally:
        if own:
            stream.close()
