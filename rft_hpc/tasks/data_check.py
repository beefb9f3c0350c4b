"""Every task source of a config read and checked before anything starts: `rft-hpc
validate`, `run` and `submit` refuse a missing column or a bad row with one message."""

from __future__ import annotations

from collections.abc import Iterator

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.tasks import FileTasks
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.source import build_tasks


def task_sources(config: ExperimentConfig) -> Iterator[tuple[str, FileTasks]]:
    """(config key, source) of each data-file task source: `tasks`, and the task sets of
    the pipeline of each stage (a stage may change the pipeline, never `tasks`)."""
    found = [("tasks", config.tasks)]
    for index, (_, stage) in enumerate(config.stage_configs()):
        where = f"stages[{index}]." if config.stages else ""
        found += [(f"{where}pipeline.tasksets[{i}].tasks", ts.tasks)
                  for i, ts in enumerate(stage.pipeline.tasksets)]
    seen: set[str] = set()
    for key, source in found:
        fingerprint = source.model_dump_json()
        if isinstance(source, FileTasks) and fingerprint not in seen:
            seen.add(fingerprint)
            yield key, source


def check_task_sources(config: ExperimentConfig) -> None:
    """Read every task source of `config` (train and eval) as the roles will; the first bad
    one raises a `UserError` that names its config key, file, rows and columns."""
    for key, source in task_sources(config):
        try:
            build_tasks(source, config.run.seed)
        except UserError as exc:
            raise UserError(f"{key}: {exc}") from None
