"""Preparing the stages of a run: directories, frozen configs, models and offline data."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rft_hpc.buffer.jsonl import import_jsonl, write_new_writer
from rft_hpc.buffer.records import SFTSample
from rft_hpc.config import ExperimentConfig
from rft_hpc.errors import UserError
from rft_hpc.roles.common import freeze_config
from rft_hpc.rundir import RunDir, read_json
from rft_hpc.tasks.source import build_tasks

OFFLINE_WRITER = "import-data"


def prepare_model(config: ExperimentConfig) -> ExperimentConfig:
    """Resolve `model.path` to an absolute folder, building it first when `model.init` says so."""
    path = config.model.path
    if path is None:
        raise UserError("model.path is not set: point it at a local Hugging Face model folder "
                        "(or set model.init: tiny to build a tiny one there)")
    path = path.resolve()
    if not path.exists():
        if config.model.init != "tiny":
            raise UserError(f"model folder {path} does not exist")
        from rft_hpc.models.tiny import init_tiny_model

        init_tiny_model(path)
    return config.model_copy(update={"model": config.model.model_copy(update={"path": path})})


_NOT_YET = (
    ("sync", "method", ("nccl", "mpi")),
    ("explorer", "engine", ("vllm",)),
    ("trainer", "algorithm", ("ppo", "dpo")),
)


def check_runnable(config: ExperimentConfig) -> None:
    """Refuse, before anything starts, settings this version validates but cannot run yet."""
    for name, stage in config.stage_configs():
        if stage.mode == "bench":
            raise UserError(f"stage {name}: mode bench is not available yet")
        for section, key, values in _NOT_YET:
            value = getattr(getattr(stage, section), key)
            if value in values:
                raise UserError(f"stage {name}: {section}.{key}: {value} is not available yet "
                                f"in this version of rft-hpc")


def freeze_run_config(config: ExperimentConfig, run: RunDir) -> None:
    """Write the run's config.yaml, or check that a resumed run still has the same one."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    if run.config.exists():
        if yaml.safe_load(run.config.read_text()) != yaml.safe_load(text):
            raise UserError(f"{run.root} already holds a run with a different config; give "
                            "this one another run.name, or run the same config to resume it")
        return
    run.create()
    from rft_hpc.rundir import atomic_write_text

    atomic_write_text(run.config, text)


def stage_dir(run: RunDir, index: int, name: str) -> Path:
    """Folder of stage `index` (a run directory of its own)."""
    return run.root / "stages" / f"{index}-{name}"


def prepare_stage(config: ExperimentConfig, folder: Path, start_weights: Path | None) -> RunDir:
    """Create a stage's run directory, freeze its config, import its offline data once."""
    stage = config.model_copy(update={"model": config.model.model_copy(
        update={"start_weights": start_weights})})
    run = RunDir(folder).create()
    if not run.config.exists():
        freeze_config(stage, run.config)
    if stage.mode == "train" and not (run.buffer / OFFLINE_WRITER).exists():
        _import_offline_data(stage, run)
    return run


def _import_offline_data(config: ExperimentConfig, run: RunDir) -> None:
    data = config.data
    if data is None:
        raise UserError("mode train needs offline data: set `data` (source: tasks or jsonl)")
    if data.source == "jsonl":
        if data.path is None:
            raise UserError("data.path is not set (data.source is jsonl)")
        import_jsonl(data.path, data.kind, run.buffer, tokenizer=config.model.path,
                     writer=OFFLINE_WRITER)
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(config.model.path), local_files_only=True)
    train, _ = build_tasks(config.tasks, config.run.seed)
    samples = []
    for task in train:
        prompt = list(tok(task.prompt, add_special_tokens=True)["input_ids"])
        answer = list(tok(task.answer, add_special_tokens=False)["input_ids"])
        samples.append(SFTSample(prompt + answer + [tok.eos_token_id], len(prompt),
                                 task_id=task.task_id, taskset=task.taskset))
    write_new_writer(samples, "sft", run.buffer, OFFLINE_WRITER)


def stage_result(run: RunDir) -> dict | None:
    """The result record of a finished stage, or None if it has not finished."""
    path = run.state / "result.json"
    return read_json(path) if path.exists() else None


def dump(obj: object) -> str:
    """JSON for small records written by the runner."""
    return json.dumps(obj, indent=2, sort_keys=True)
