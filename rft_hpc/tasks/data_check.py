"""Every task source and offline data file of a config read and checked before anything
starts: `rft-hpc validate`, `run` and `submit` refuse a missing column or a bad row with
one message."""

from __future__ import annotations

from collections.abc import Iterator

from rft_hpc.config import ExperimentConfig
from rft_hpc.config.offline_data import DataConfig
from rft_hpc.config.tasks import FileTasks
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.offline_rows import load_offline_examples
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


def offline_sources(config: ExperimentConfig) -> Iterator[tuple[str, DataConfig]]:
    """(config key, data) of each offline data file (`data: {source: file}`) that a stage
    imports: those of the stages in mode `train`, or `both` with `data` set."""
    seen: set[str] = set()
    for index, (_, stage) in enumerate(config.stage_configs()):
        data = stage.data
        if data is None or data.source != "file" or stage.mode not in ("train", "both"):
            continue
        fingerprint = data.model_dump_json(exclude={"taskset"})
        if fingerprint not in seen:
            seen.add(fingerprint)
            given = bool(config.stages) and config.stages[index].data is not None
            yield (f"stages[{index}].data" if given else "data"), data


def check_task_sources(config: ExperimentConfig) -> None:
    """Read every task source of `config` (train and eval) and every offline data file as
    the roles will; the first bad one raises a `UserError` that names its config key, file,
    rows and columns (chat messages under `prompt.format: raw` too)."""
    for key, source in task_sources(config):
        try:
            build_tasks(source, config.run.seed)
        except UserError as exc:
            raise UserError(f"{key}: {exc}") from None
    for key, data in offline_sources(config):
        try:
            examples = load_offline_examples(data.file_source(), data.kind,
                                             layout=data.layout)
            held_out = data.eval_source()
            if held_out is not None:
                load_offline_examples(held_out, data.kind, layout=data.layout)
        except UserError as exc:
            raise UserError(f"{key}: {exc}") from None
        chat = next((e for e in examples if e.prompt.messages is not None), None)
        if chat is not None and config.prompt.format == "raw":
            raise UserError(f"{key}: {data.path} holds chat messages ({chat.prompt.task_id} "
                            "first), but prompt.format is raw: set prompt.format: chat (a raw "
                            "prompt is one string)")
