"""Where a stage's explorer and trainer run: a process each, or one colocated process.

`launch.colocate` chooses. `auto` colocates under `rft-hpc run` wherever one process can
serve the stage (`colocation_problem` finds nothing against it) and keeps a process each
under `rft-hpc submit`; `true` colocates under both and refuses, at the key that stands in
the way, a stage it cannot serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from rft_hpc.config.explain import Key

if TYPE_CHECKING:
    from rft_hpc.config.schema import ExperimentConfig

Launcher = Literal["local", "slurm"]


def colocation_problems(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """Why one process cannot run this stage's explorer and trainer: (keys, reason) for
    each setting that stands in the way; nothing when it can."""
    slurm = config.launch.slurm.trainer
    if config.mode != "both":
        yield ("mode",), f"mode {config.mode} runs no explorer beside the trainer"
    if config.explorer.count != 1:
        yield ("explorer", "count"), (f"a colocated process runs one explorer, got "
                                      f"{config.explorer.count}")
    if slurm.nodes * slurm.tasks_per_node != 1:
        yield ("launch", "slurm", "trainer"), (
            f"a colocated process is one trainer rank, got {slurm.nodes} node(s) x "
            f"{slurm.tasks_per_node} task(s)")
    if config.sync.method != "checkpoint":
        yield ("sync", "method"), (f"colocated, weights are handed over in memory; "
                                   f"sync.method {config.sync.method} is for a process each")
    if config.explorer.cpus is not None or config.trainer.cpus is not None:
        key = "explorer" if config.explorer.cpus is not None else "trainer"
        yield (key, "cpus"), "cores pinned to one role ask for a process each"


def colocated(config: ExperimentConfig, launcher: Launcher) -> bool:
    """Whether `config`'s stage runs colocated when started by `launcher`."""
    choice = config.launch.colocate
    if choice == "auto":
        return launcher == "local" and next(colocation_problems(config), None) is None
    return bool(choice)


def colocate_refusals(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """The config check of `launch.colocate: true`: each stage it cannot serve, at the key
    that stands in the way (the stage's own keys under `stages`)."""
    for index, (_, stage) in enumerate(config.stage_configs()):
        if stage.launch.colocate is not True:
            continue
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        for keys, reason in colocation_problems(stage):
            if keys == ("mode",):
                continue  # a stage that trains or explores alone runs as it would split
            yield (*where, *keys), f"launch.colocate is true, but {reason}"
