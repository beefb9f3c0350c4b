"""A published weights version of a run as a Hugging Face model folder.

`export_model` writes config.json (its dtype that of the weights), generation_config.json,
the tokenizer files with their chat template (copied from the run's model folder, as they
are) and the weights as safetensors shards (`model.safetensors`, or
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), plus
`rft_hpc_export.json` (where they came from). Transformers' `from_pretrained` and vLLM load
the folder as it is. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import load_config
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, atomic_write_json, open_run_dir, read_json
from rft_hpc.sync.checkpoint import load_weights
from rft_hpc.sync.storage import (
    commit_folder,
    dtype_name,
    make_temp_folder,
    numbered_folders,
    save_safetensors,
)

SHARD_BYTES = 5 << 30
"""Largest safetensors shard written (Hugging Face's default `max_shard_size`, 5 GiB)."""

_VERSION = re.compile(r"v(\d{6,})")
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.index\.json$")
"""Files of a model folder that hold (or index) its weights: replaced, never copied."""


def stage_dirs(run: RunDir) -> list[RunDir]:
    """The stage directories of a run in order (the run itself for a one-stage run)."""
    stages = sorted((p for p in run.stages.glob("*-*") if p.is_dir()),
                    key=lambda p: int(p.name.partition("-")[0]) if p.name[0].isdigit() else 0)
    return [RunDir(p) for p in stages] or [run]


def published_versions(stage: RunDir) -> list[int]:
    """The complete weights versions a stage published (with a manifest), ascending."""
    return sorted(v for v, p in numbered_folders(stage.weights, _VERSION).items()
                  if (p / "manifest.json").is_file())


def choose_version(run: RunDir, version: int | None, stage: str | None,
                   ) -> tuple[RunDir, int]:
    """The stage and version to export: `version` (default the newest) of the stage named
    `stage` (default the last stage that published any)."""
    stages = stage_dirs(run)
    if stage is not None:
        named = [s for s in stages if s.root.name.partition("-")[2] == stage
                 or s.root.name == stage]
        if not named:
            names = ", ".join(s.root.name.partition("-")[2] or s.root.name for s in stages)
            raise UserError(f"run {run.root} has no stage {stage!r} (stages: {names})")
        stages = named
    with_weights = [s for s in stages if published_versions(s)]
    if not with_weights:
        raise UserError(f"{run.root} holds no published weights (weights/v<N>) to export")
    chosen = with_weights[-1]
    versions = published_versions(chosen)
    if version is None:
        return chosen, versions[-1]
    if version not in versions:
        raise UserError(f"stage {chosen.root.name} has no weights version {version} "
                        f"(published: {', '.join(map(str, versions))})")
    return chosen, version


def export_model(run_path: Path, out: Path, *, version: int | None = None,
                 stage: str | None = None, shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Write weights `version` (default the newest) of `run_path` as a Hugging Face model
    folder at `out` (which must not exist, or be empty). Returns what `rft_hpc_export.json`
    records: run, stage, version, model folder, dtype, files."""
    run = open_run_dir(run_path)
    chosen, version = choose_version(run, version, stage)
    config = load_config(chosen.config if chosen.config.is_file() else run.config)
    model = config.model.path
    if model is None or not (Path(model) / "config.json").is_file():
        raise UserError(f"the run's model folder {model} is gone: export needs its config "
                        "and tokenizer")
    out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder: choose another --out")
    state = load_weights(chosen.weights, version)
    model_config = read_json(Path(model) / "config.json")
    if model_config.get("tie_word_embeddings") and "lm_head.weight" in state:
        state.pop("lm_head.weight")  # tied: transformers and vLLM take the embeddings
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    tmp = make_temp_folder(out.parent, out.name)
    try:
        for entry in sorted(Path(model).iterdir()):
            if entry.is_file() and not _WEIGHT_FILES.fullmatch(entry.name):
                shutil.copy2(entry, tmp / entry.name)
        dtype = dtype_name(dtypes.pop()) if len(dtypes) == 1 else None
        _write_config(tmp, model_config, dtype)
        files = _write_shards(tmp, state, shard_bytes)
        record = {"run": str(run.root), "stage": chosen.root.name, "version": version,
                  "model": str(Path(model).resolve()), "dtype": dtype, "files": files}
        atomic_write_json(tmp / "rft_hpc_export.json", record)
        if out.exists():
            out.rmdir()
        commit_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _write_config(folder: Path, config: dict[str, Any], dtype: str | None) -> None:
    """config.json with the weights' dtype; a generation_config.json from it when the
    model folder had none (what transformers derives from config.json)."""
    if dtype is not None:
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype", "torch_dtype"]
        config = {**config, **dict.fromkeys(keys, dtype)}
    atomic_write_json(folder / "config.json", config)
    if not (folder / "generation_config.json").exists():
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(k) is not None}
        atomic_write_json(folder / "generation_config.json",
                          {**generation, "_from_model_config": True})


def _write_shards(folder: Path, state: dict[str, torch.Tensor], limit: int) -> list[str]:
    """The tensors in shards of at most `limit` bytes (a larger tensor alone in one), in
    state-dict order; the index file when there is more than one shard."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        save_safetensors(folder / "model.safetensors", state)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(folder / file, {n: state[n] for n in names})
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*files, "model.safetensors.index.json"]
