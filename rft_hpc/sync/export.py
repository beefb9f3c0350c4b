"""A published weights version of a run as a Hugging Face model folder.

`export_model` writes config.json (its dtype that of the weights), generation_config.json,
the tokenizer files with their chat template (copied from the run's model folder, as they
are) and the weights as safetensors shards (`model.safetensors`, or
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), plus
`rft_hpc_export.json` (where they came from). Transformers' `from_pretrained` and vLLM load
the folder as it is. The folder is written under a temporary name and renamed when complete.

A LoRA run's versions are adapters: exported as a peft adapter folder
(`adapter_model.safetensors`, `adapter_config.json` naming the run's model folder as the
base, the tokenizer files), or with `merged` as the Hugging Face folder above with the
adapter's update added into the base weights (peft's `merge_and_unload`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.config.lora import LoraSettings
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, atomic_write_json, open_run_dir, read_json
from rft_hpc.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    add_adapter,
    is_adapter_state,
    load_adapter_state,
    merged_model,
)
from rft_hpc.models.reward_model import (
    HEAD,
    is_reward_model_folder,
    reward_model_config,
    score_pad_id,
)
from rft_hpc.sync.storage import (
    commit_folder,
    dtype_name,
    make_temp_folder,
    numbered_folders,
    save_safetensors,
)
from rft_hpc.sync.weight_files import (
    KIND_ADAPTER,
    KIND_DELTA,
    KIND_FULL,
    load_weights,
    read_manifest,
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
                 stage: str | None = None, shard_bytes: int = SHARD_BYTES,
                 merged: bool = False) -> dict[str, Any]:
    """Write weights `version` (default the newest) of `run_path` as a Hugging Face model
    folder at `out` (which must not exist, or be empty); a LoRA adapter as a peft adapter
    folder, or with `merged` merged into the base as a Hugging Face model folder. Returns
    what `rft_hpc_export.json` records: run, stage, version, model folder, dtype, files,
    kind (`full`, `lora-adapter` or `merged`)."""
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
    manifest = read_manifest(chosen.weights, version)
    kind = KIND_FULL if manifest["kind"] == KIND_DELTA else manifest["kind"]  # rebuilt whole
    if kind == KIND_ADAPTER:
        if not merged:
            return _export_adapter(run, chosen, version, state, manifest["adapter"],
                                   Path(model), out)
        state, kind = _merged_state(config, state, manifest["adapter"]), "merged"
    elif merged:
        raise UserError(f"weights v{version} of {chosen.root.name} are a whole model, not a "
                        "LoRA adapter: export them without --merged")
    model_config = read_json(Path(model) / "config.json")
    if f"{HEAD}.weight" in state and "lm_head.weight" not in state:  # a reward model
        model_config = _reward_model_config(Path(model), model_config)
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
                  "model": str(Path(model).resolve()), "dtype": dtype, "files": files,
                  "kind": kind}
        _commit(tmp, out, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _commit(tmp: Path, out: Path, record: dict[str, Any]) -> None:
    """Write `rft_hpc_export.json` into `tmp` and rename `tmp` to `out`."""
    atomic_write_json(tmp / "rft_hpc_export.json", record)
    if out.exists():
        out.rmdir()
    commit_folder(tmp, out)


def _export_adapter(run: RunDir, stage: RunDir, version: int, state: dict[str, torch.Tensor],
                    adapter: dict[str, Any], model: Path, out: Path) -> dict[str, Any]:
    """A peft adapter folder: the adapter's tensors and config (its base: `model`) and the
    model folder's tokenizer files."""
    tmp = make_temp_folder(out.parent, out.name)
    try:
        for entry in sorted(model.iterdir()):
            if entry.is_file() and not _WEIGHT_FILES.fullmatch(entry.name) and \
                    entry.name not in ("config.json", "generation_config.json"):
                shutil.copy2(entry, tmp / entry.name)
        save_safetensors(tmp / ADAPTER_FILE, state)
        atomic_write_json(tmp / ADAPTER_CONFIG_FILE, {
            **adapter, "base_model_name_or_path": str(model.resolve())})
        dtypes = {dtype_name(t.dtype) for t in state.values()}
        record = {"run": str(run.root), "stage": stage.root.name, "version": version,
                  "model": str(model.resolve()), "dtype": dtypes.pop() if len(dtypes) == 1
                  else None, "files": [ADAPTER_FILE, ADAPTER_CONFIG_FILE],
                  "kind": KIND_ADAPTER}
        _commit(tmp, out, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _merged_state(config: ExperimentConfig, state: dict[str, torch.Tensor],
                  adapter: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The whole model's weights with the adapter `state` merged in: the run's model folder
    (with the stage's whole-model start weights, if any), the adapter described by
    `adapter` (peft's config), `merge_and_unload`."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(state.values())).dtype
    base = AutoModelForCausalLM.from_pretrained(str(config.model.path), local_files_only=True,
                                                dtype=dtype)
    start = config.model.start_weights
    if start is not None:
        weights = load_weights(Path(start).parent, int(Path(start).name[1:]))
        if not is_adapter_state(weights):
            base.load_state_dict(weights)
    settings = LoraSettings(rank=adapter["r"], alpha=adapter["lora_alpha"],
                            dropout=adapter["lora_dropout"],
                            target_modules=list(adapter["target_modules"]))
    model = add_adapter(base, settings)
    load_adapter_state(model, state)
    return merged_model(model).state_dict()


def _reward_model_config(model: Path, config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a reward model trained from the model folder `model`."""
    if is_reward_model_folder(model):
        return config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return reward_model_config(config, score_pad_id(tokenizer))


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
