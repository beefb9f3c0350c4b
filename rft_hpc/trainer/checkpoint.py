"""Full trainer state: save it whole, load it back so training continues bit for bit.

Layout (in the run directory's `ckpt/`)::

    ckpt/LATEST                        "trainer/step-<NNNNNN>\\n", replaced atomically
    ckpt/trainer/step-<NNNNNN>/
      model.safetensors                model.state_dict()
      optimizer.pt                     torch.save(optimizer.state_dict())
      scheduler.pt                     torch.save(scheduler.state_dict()), with a scheduler
      rng.json                         python, numpy, torch (and CUDA) RNG states
      cursor.json                      the buffer reader's cursor
      <name>.pt                        torch.save(state_dict()) of each further part (the
                                       PPO critic and its optimizer), when there are some
      state.json                       format, step, config hash, extra, model file checksum,
                                       the ranks that saved it

Every state is whole, whatever the ranks held: the model's full weights (gathered from FSDP or
Megatron shards) and the optimizer's full state keyed by parameter names (`optim_state`), so
a checkpoint saved by N ranks is resumed by M; `state.json`'s `ranks` records N (docs/
run-directory.md). A checkpoint folder is written under a `.tmp-` name, fsynced and renamed
into place before `LATEST` names it; a trainer killed mid-save leaves the previous checkpoint
in force. The RNG states are those of the saving process (rank 0).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler

from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import PROCESS_RETRY, read_bytes
from rft_hpc.core.rundir import (
    atomic_write_json,
    atomic_write_text,
    read_json,
    remove_tree,
    trainer_step_folder_name,
)
from rft_hpc.core.storage import naming_full
from rft_hpc.sync.storage import (
    CHECKSUM_ALGORITHM,
    FileDigest,
    commit_folder,
    load_safetensors,
    make_temp_folder,
    prune_numbered,
    remove_temporaries,
    save_safetensors,
)

T = TypeVar("T")

STATE_FORMAT = "rft-hpc-trainer-state"
STATE_FORMAT_VERSION = 1
_STEP_FOLDER = re.compile(r"step-(\d{6,})")
_POINTER = re.compile(r"trainer/step-\d{6,}")


class CheckpointError(UserError):
    """A trainer checkpoint cannot be used: corrupt, incomplete, or from another config."""


@dataclass(frozen=True)
class TrainerState:
    """What `load_trainer_state` restored besides the objects it loaded in place."""

    step: int
    cursor: dict[str, Any]
    extra: dict[str, Any]
    config_hash: str
    path: Path
    ranks: dict[str, Any]
    """How the saving trainer was spread (`world_size`, `backend`, `model_parallel`); empty
    for a checkpoint written before rft-hpc recorded it."""


def save_trainer_state(ckpt_dir: str | Path, step: int, *, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None = None,
                       cursor: dict[str, Any], extra: dict[str, Any], config_hash: str,
                       keep: int = 2, modules: Mapping[str, Any] | None = None,
                       ranks: Mapping[str, Any] | None = None) -> Path:
    """Save the whole trainer state as `ckpt_dir/trainer/step-<NNNNNN>` and point LATEST at it.

    Written into a `.tmp-` folder (every file fsynced), renamed into place (replacing an
    earlier save of the same step), then `ckpt_dir/LATEST` is replaced atomically and all
    checkpoints but the newest `keep` and this one are deleted. One writer per `ckpt_dir`.
    `modules`: further parts with a `state_dict()` (a critic, its optimizer), saved by name.
    `ranks`: how the trainer is spread (`TrainerState.ranks`), recorded in `state.json`.
    Returns the checkpoint folder.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    ckpt_dir = Path(ckpt_dir)
    parent = ckpt_dir / "trainer"
    remove_temporaries(parent)
    final = parent / trainer_step_folder_name(step)
    tmp = make_temp_folder(parent, final.name)
    try:
        digest = save_safetensors(tmp / "model.safetensors", model.state_dict())
        _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
        for name, part in (modules or {}).items():
            _torch_save(part.state_dict(), tmp / f"{name}.pt")
        atomic_write_json(tmp / "rng.json", _rng_state())
        atomic_write_json(tmp / "cursor.json", cursor)
        atomic_write_json(tmp / "state.json", {
            "format": STATE_FORMAT, "format_version": STATE_FORMAT_VERSION, "step": step,
            "config_hash": config_hash, "extra": extra, "created": time.time(),
            "has_scheduler": scheduler is not None, "checksum_algorithm": CHECKSUM_ALGORITHM,
            "modules": sorted(modules or {}), "ranks": dict(ranks or {}),
            "model": digest.as_json()})
        commit_folder(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    atomic_write_text(ckpt_dir / "LATEST", f"trainer/{final.name}\n")
    prune_numbered(parent, _STEP_FOLDER, keep, protect={step})
    return final


def load_trainer_state(ckpt_dir: str | Path, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None = None,
                       config_hash: str | None = None,
                       modules: Mapping[str, Any] | None = None,
                       model_parallel: int | None = None) -> TrainerState | None:
    """Restore the checkpoint `ckpt_dir/LATEST` names, or return None when there is none.

    Loads the model, optimizer and scheduler in place and restores the RNG states, so that
    training continues exactly as if it had never stopped. With `config_hash`, a checkpoint
    of another config is refused (`CheckpointError` naming both hashes) before anything is
    touched; so is a corrupt model file, or a scheduler or one of `modules` (parts with a
    `load_state_dict`, as given to `save_trainer_state`) to restore that was never saved.
    Any number of ranks loads a checkpoint saved by any other (its states are whole), but
    with `model_parallel` one saved by tensor-parallel groups of another size is refused
    first (`CheckpointError` naming both).
    """
    pointer = Path(ckpt_dir) / "LATEST"
    try:
        target = read_bytes(pointer, what="checkpoint pointer").decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    if not _POINTER.fullmatch(target):
        raise CheckpointError(f"{pointer} holds {target[:60]!r}, not trainer/step-<N>")
    folder = Path(ckpt_dir) / target
    try:
        state = _read_named(folder / "state.json", read_json)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder} is missing or incomplete: {e}") from e
    if state.get("format") != STATE_FORMAT or state.get("format_version", 0) > STATE_FORMAT_VERSION:
        raise CheckpointError(f"{folder}: not a trainer checkpoint this rft-hpc can read")
    saved_tp = state.get("ranks", {}).get("model_parallel", model_parallel)
    if model_parallel is not None and saved_tp != model_parallel:
        raise CheckpointError(
            f"checkpoint {folder} was saved by tensor-parallel groups of {saved_tp} ranks, "
            f"this trainer's are {model_parallel}: trainer.megatron.tensor_parallel cannot "
            f"change on a resume (set it back to {saved_tp}; the number of ranks may change)")
    if config_hash is not None and state["config_hash"] != config_hash:
        raise CheckpointError(
            f"checkpoint {folder} was written with config hash {state['config_hash']}, but the "
            f"current config hashes to {config_hash}: the config changed since the run started")
    if scheduler is not None and not state["has_scheduler"]:
        raise CheckpointError(f"{folder} holds no scheduler state, but a scheduler was given")
    missing = sorted(set(modules or {}) - set(state.get("modules", [])))
    if missing:
        raise CheckpointError(f"{folder} holds no {', '.join(missing)} state")
    tensors, digest = load_safetensors(folder / "model.safetensors")
    expected = FileDigest(state["model"]["bytes"], state["model"]["checksum"])
    if digest != expected:
        raise CheckpointError(f"{folder}/model.safetensors is corrupt: got {digest}, "
                              f"state.json says {expected}")
    model.load_state_dict(tensors)
    optimizer.load_state_dict(_read_named(folder / "optimizer.pt", _torch_load))
    if scheduler is not None:
        scheduler.load_state_dict(_read_named(folder / "scheduler.pt", _torch_load))
    for name, part in (modules or {}).items():
        part.load_state_dict(_read_named(folder / f"{name}.pt", _torch_load))
    _set_rng_state(_read_named(folder / "rng.json", read_json))
    return TrainerState(step=state["step"], cursor=_read_named(folder / "cursor.json", read_json),
                        extra=state["extra"], config_hash=state["config_hash"], path=folder,
                        ranks=state.get("ranks", {}))


def _torch_save(obj: object, path: Path) -> None:
    """`torch.save` to a temporary path, durably, done whole again after a transient error.

    Through a Python file, not a path: torch's own writer reports a full disk as a bare
    "file write failed" and a failed `stat` of the folder as a RuntimeError without its
    errno; a Python file raises the OSError with its errno (StorageFull, or retried)."""
    with naming_full(path):
        PROCESS_RETRY.write("checkpoint file", path, lambda: _torch_save_once(obj, path))


def _torch_save_once(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read_named(path: Path, read: Callable[[Path], T]) -> T:
    """`read(path)` of a file of the checkpoint `LATEST` names, with retries: waited for
    while it is not visible on this node yet (`core.retry`, `named`)."""
    return PROCESS_RETRY.read("checkpoint file", path, lambda: read(path), named=True)


def _torch_load(path: Path) -> Any:
    """Load a state dict saved by `_torch_save`: tensors and plain data only, onto the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _rng_state() -> dict[str, Any]:
    """The RNG states of this process as JSON-ready data."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by `_rng_state` (CUDA ones for the devices present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        saved = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(saved[:torch.cuda.device_count()])
