"""`reward_job`: where reward models run (docs/reward-job.md).

By default (`count: 0`) each explorer scores its tasks' reward-model and LLM-judge terms itself, in
batched forwards on its own device between generation batches. With `count: N` an array of
N reward jobs, each with its own Slurm settings and GPUs, scores every reward-model and judge term
of every explorer: explorer `i` sends its batches to reward job `i % N` through the run
directory, and each reward job batches the requests of all its explorers together. The
explorers' reward functions stay in their own worker pools either way.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from rft_hpc.config.launch import SlurmRoleConfig
from rft_hpc.core.config_section import ConfigSection


class RewardJobConfig(ConfigSection):
    """The reward job: an array of processes that score the explorers' reward-model and
    LLM-judge terms."""

    count: int = Field(0, ge=0)
    """Reward jobs (an array of this many, `reward-<j>`): 0 scores reward models and LLM
    judges inside each explorer, on its own device (the default); N >= 1 scores every
    reward-model and judge term of every explorer in these N jobs, explorer `i` in job
    `i % N`."""

    slurm: SlurmRoleConfig = Field(default_factory=SlurmRoleConfig)
    """Slurm settings of the reward job array under `rft-hpc submit` (partition, GPUs, time
    ...), as `launch.slurm.<role>` has them for the other roles; one process per array
    task. `rft-hpc run` runs each reward job as a local process instead."""

    @field_validator("slurm")
    @classmethod
    def _one_process(cls, settings: SlurmRoleConfig) -> SlurmRoleConfig:
        if settings.tasks() != 1:
            raise ValueError("nodes x tasks_per_node must be 1: each reward job is one "
                             "process (set reward_job.count for more reward jobs)")
        return settings
