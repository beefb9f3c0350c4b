"""The trainer role: read experiences, update the policy, publish weights, checkpoint.

Per step: take `batch_size` records from the buffer (the reader's policy and staleness
bound), compute the loss of the algorithm (GRPO or SFT), step AdamW, and every
`sync.interval` steps publish the weights as version `step`. The full state (model,
optimizer, schedule, RNG, buffer cursor) is saved every `save_interval` steps and when a
stop signal arrives, so a restarted trainer continues where the saved one stopped.

With several ranks (`rft_hpc.trainer.distributed`) rank 0 runs the loop above and tells the
other ranks, before each step, whether a batch follows (`batch`), nothing yet (`wait`, sent
while it waits for data so that no rank sits in a collective for long) or the end (`stop`:
steps done, no more data, or a stop signal). The other ranks only follow: they take part in
each step and return when told to stop. Under FSDP (`trainer.parallel: fsdp`) the full
weights exist only when every rank gathers them, so rank 0 also asks for `weights` (before
it publishes or evaluates) and `checkpoint` (before it saves), and sends `stop` only after
its final save and publish.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.runtime.common import StopFlag, load_stage, set_threads
from rft_hpc.runtime.logs import setup_logging
from rft_hpc.trainer.checkpoint import TrainerState, load_trainer_state
from rft_hpc.trainer.distributed import (
    DistContext,
    broadcast_object,
    init_distributed,
    shutdown,
)
from rft_hpc.trainer.loop import Followers, TrainerLoop, rank_layout
from rft_hpc.trainer.protocols import StageTrainer
from rft_hpc.trainer.reward_model import RewardModelTrainer
from rft_hpc.trainer.trainer import Trainer, config_hash

log = logging.getLogger(__name__)


def _follow(trainer: StageTrainer, step: int) -> int:
    """A rank other than 0: take part in each step until rank 0 says stop."""
    while True:
        kind = broadcast_object(None, trainer.dist)
        if kind == "stop":
            return step
        if kind == "batch":
            trainer.step(None)
            step += 1
        elif kind == "weights":
            trainer.full_state_dict()
        elif kind == "checkpoint":
            trainer.checkpoint_parts()


def restore(trainer: StageTrainer, run: RunDir, chash: str) -> TrainerState | None:
    """Load the latest checkpoint on every rank; the ranks must agree on its step. A
    checkpoint saved by another number of ranks is resharded as it loads (its states are
    whole); rank 0 logs the change."""
    model, optimizer = trainer.restore_parts()
    saved = load_trainer_state(run.ckpt, model, optimizer, trainer.scheduler,
                               config_hash=chash, modules=trainer.checkpoint_modules(),
                               model_parallel=trainer.backend.model_parallel)
    step = saved.step if saved else 0
    lead = broadcast_object(step, trainer.dist)
    if lead != step:
        raise RuntimeError(f"rank {trainer.dist.rank} restored step {step}, rank 0 step {lead}")
    now = rank_layout(trainer)
    if saved and trainer.dist.is_main and saved.ranks and saved.ranks != now:
        was = saved.ranks
        log.info("resuming step %d saved by %d rank(s) (%s, model-parallel %d) on %d rank(s) "
                 "(%s, model-parallel %d): the whole saved states were resharded", step,
                 was.get("world_size", 0), was.get("backend", "?"), was.get("model_parallel", 1),
                 now["world_size"], now["backend"], now["model_parallel"])
    return saved


def build_trainer(config: ExperimentConfig, dist: DistContext) -> StageTrainer:
    """The stage's trainer: a reward model's or a policy's (any algorithm)."""
    if config.algorithm.algorithm_type == "reward_model":
        return RewardModelTrainer(config, dist)
    return Trainer(config, dist)


def run_trainer(stage_dir: Path) -> int:
    """Train a stage to `trainer.steps` (or until stopped); returns the steps done.

    Under a multi-rank launch (`init_distributed`) every rank calls this; rank 0 leads.
    """
    setup_logging("trainer")
    config, run = load_stage(stage_dir)
    set_threads(config.trainer.threads, config.trainer.cpus)
    stop = StopFlag()  # other ranks too: a signal must not kill them mid-step
    dist = init_distributed()
    if not dist.is_main:
        setup_logging(f"trainer-rank{dist.rank}")
    try:
        trainer = build_trainer(config, dist)
        chash = config_hash(config)
        saved = restore(trainer, run, chash)
        if not dist.is_main:
            return _follow(trainer, saved.step if saved else 0)
        followers = Followers(dist)
        with followers.stopped_by_a_full_disk():  # the loop's start (its files) included
            return TrainerLoop(trainer, run, stop, saved, chash, followers).run()
    finally:
        shutdown()
