"""The `checkpoint` weight-sync method: versioned weight folders on the shared filesystem.

The trainer publishes; explorers poll `LATEST` and load. Layout (docs/weights-format.md)::

    weights/LATEST                     "<version>\\n", replaced atomically after each publish
    weights/v<NNNNNN>/model.safetensors
    weights/v<NNNNNN>/manifest.json    format, version, files with size and CRC-32, tensors

A LoRA run (`model.lora`) publishes the adapter alone: `adapter_model.safetensors` and
`adapter_config.json` instead of `model.safetensors` (the folder is a peft adapter folder),
and a manifest of version 2 that says so (`kind`, `adapter`).

A version folder is written under a `.tmp-` name, fsynced and renamed into place before
`LATEST` names it, so `LATEST` never points at an incomplete version. Old versions are pruned
after `LATEST` moves on; a reader caught loading one gets `WeightsGone` and retries with the
version `LATEST` names now (`load_latest_weights` does that).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import atomic_write_json, atomic_write_text, read_json, weights_folder_name
from rft_hpc.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_FILE, is_adapter_state
from rft_hpc.sync.storage import (
    CHECKSUM_ALGORITHM,
    FileDigest,
    ReadBuffer,
    commit_folder,
    dtype_name,
    load_safetensors,
    make_temp_folder,
    prune_numbered,
    remove_temporaries,
    save_safetensors,
)

WEIGHTS_FORMAT = "rft-hpc-weights"
MANIFEST_VERSION = 2
"""The newest manifest version this rft-hpc reads. Full weights are still written as
version 1 (their format did not change); an adapter is written as version 2, which an
rft-hpc that reads only version 1 refuses instead of loading it as a whole model."""
FULL_MANIFEST_VERSION = 1
KIND_FULL = "full"
KIND_ADAPTER = "lora-adapter"
MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
_VERSION_FOLDER = re.compile(r"v(\d{6,})")


class WeightsError(RuntimeError):
    """Published weights are missing, unreadable or do not match their manifest."""


class WeightsGone(WeightsError):
    """The requested version was deleted (pruned or replaced) before or while it was loaded.

    Not a fault: read `LATEST` again and load the version it names.
    """


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """The folder of weights version `version`: `weights_dir/v<NNNNNN>`."""
    return Path(weights_dir) / weights_folder_name(version)


def publish_weights(weights_dir: str | Path, state_dict: Mapping[str, torch.Tensor],
                    version: int, *, keep: int = 3, extra: dict[str, Any] | None = None,
                    keep_also: Collection[int] = (), adapter: dict[str, Any] | None = None,
                    ) -> Path:
    """Publish `state_dict` as weights version `version` and point `LATEST` at it.

    With `adapter` (peft's adapter config as JSON data) `state_dict` is a LoRA adapter's
    tensors: the folder holds `adapter_model.safetensors` and `adapter_config.json` (a peft
    adapter folder) and the manifest (version 2) says `kind: lora-adapter`.

    Steps: delete `.tmp-` leftovers of a killed publisher; write `model.safetensors` (tensors
    moved to CPU one at a time, dtypes and shapes kept) and `manifest.json` into a `.tmp-`
    folder, fsync, rename it to `v<NNNNNN>` (replacing an earlier publish of the same
    version), fsync the parent; replace `LATEST` atomically; delete all versions but the
    newest `keep`, this one and those in `keep_also` (versions an evaluator will score).
    One publisher per `weights_dir`. Returns the version folder.
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    weights_dir = Path(weights_dir)
    remove_temporaries(weights_dir)
    final = version_dir(weights_dir, version)
    tmp = make_temp_folder(weights_dir, final.name)
    try:
        file = MODEL_FILE if adapter is None else ADAPTER_FILE
        digest = save_safetensors(tmp / file, state_dict)
        if adapter is not None:
            atomic_write_json(tmp / ADAPTER_CONFIG_FILE, adapter)
        atomic_write_json(tmp / MANIFEST_FILE, _manifest(state_dict, version, file, digest,
                                                         extra, adapter))
        commit_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(weights_dir / LATEST_FILE, f"{version}\n")
    prune_numbered(weights_dir, _VERSION_FOLDER, keep, protect={version, *keep_also})
    return final


def _manifest(state_dict: Mapping[str, torch.Tensor], version: int, file: str,
              digest: FileDigest, extra: dict[str, Any] | None,
              adapter: dict[str, Any] | None) -> dict[str, Any]:
    manifest = {
        "format": WEIGHTS_FORMAT,
        "manifest_version": FULL_MANIFEST_VERSION if adapter is None else 2,
        "version": version,
        "created": time.time(),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": [{"name": file, **digest.as_json()}],
        "tensors": {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
                    for name, t in state_dict.items()},
        "extra": extra or {},
    }
    if adapter is not None:
        manifest.update(kind=KIND_ADAPTER, adapter=adapter)
    return manifest


def read_manifest(weights_dir: str | Path, version: int) -> dict[str, Any]:
    """The checked manifest of weights version `version` (`WeightsError` when missing or
    unreadable, `WeightsGone` when pruned); `kind` is filled in (`full` for version 1)."""
    return {"kind": KIND_FULL, **_read_manifest(weights_dir, version)}


def _read_manifest(weights_dir: str | Path, version: int) -> dict[str, Any]:
    folder = version_dir(weights_dir, version)
    try:
        manifest = read_json(folder / MANIFEST_FILE)
    except FileNotFoundError:
        raise _missing(Path(weights_dir), version, folder) from None
    except (OSError, ValueError) as e:
        raise WeightsError(f"{folder / MANIFEST_FILE}: unreadable manifest ({e})") from e
    _check_manifest(manifest, version, folder)
    return manifest


def latest_weights_version(weights_dir: str | Path) -> int | None:
    """The version `LATEST` names, or None when nothing was published (one small read)."""
    path = Path(weights_dir) / LATEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise WeightsError(f"{path} does not hold a version number: {text[:40]!r}") from None


def load_weights(weights_dir: str | Path, version: int,
                 buffer: ReadBuffer | None = None) -> dict[str, torch.Tensor]:
    """Load weights version `version` as CPU tensors, verified against its manifest.

    Every file's size and checksum, and every tensor's name, dtype and shape, must match the
    manifest. Raises `WeightsGone` when the version was deleted before or during the load (a
    newer one exists: load that), `WeightsError` for anything else (never published,
    corrupted, unknown format). The tensors are views of one buffer per file: of `buffer`
    (valid until its next use; for a single-file model) when given.
    """
    folder = version_dir(weights_dir, version)
    manifest = _read_manifest(weights_dir, version)
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest["files"]:
        path = folder / entry["name"]
        try:
            part, digest = load_safetensors(path, buffer if len(manifest["files"]) == 1
                                            else None)
        except (OSError, ValueError) as e:
            raise _failure(folder, manifest, f"cannot read {path}: {e}") from e
        expected = FileDigest(entry["bytes"], entry["checksum"])
        if digest != expected:
            raise _failure(folder, manifest, f"{path} is corrupt: {digest.bytes} bytes with "
                           f"crc32 {digest.checksum}, manifest says {expected.bytes} bytes "
                           f"with crc32 {expected.checksum}")
        tensors.update(part)
    found = {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for n, t in tensors.items()}
    listed = manifest["tensors"]
    if found != listed:
        odd = sorted(set(found) ^ set(listed))
        changed = sorted(n for n in set(found) & set(listed) if found[n] != listed[n])
        raise WeightsError(f"{folder}: tensors differ from the manifest (present in only one: "
                           f"{odd[:5]}; other dtype or shape: {changed[:5]})")
    return tensors


def load_latest_weights(weights_dir: str | Path,
                        retries: int = 5) -> tuple[int, dict[str, torch.Tensor]] | None:
    """Load the version `LATEST` names: `(version, tensors)`, or None if none is published.

    A version pruned while it was being loaded is retried with the then-current `LATEST`,
    up to `retries` times.
    """
    failures = 0
    while True:
        version = latest_weights_version(weights_dir)
        if version is None:
            return None
        try:
            return version, load_weights(weights_dir, version)
        except WeightsGone:
            failures += 1
            if failures > retries:
                raise


def _check_manifest(manifest: Any, version: int, folder: Path) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != WEIGHTS_FORMAT:
        raise WeightsError(f"{folder}: not an rft-hpc weights manifest")
    if manifest.get("manifest_version", 0) > MANIFEST_VERSION:
        raise WeightsError(f"{folder}: manifest_version {manifest['manifest_version']} is newer "
                           f"than this rft-hpc reads ({MANIFEST_VERSION}); upgrade rft-hpc")
    if manifest.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise WeightsError(f"{folder}: unknown checksum {manifest.get('checksum_algorithm')!r}")
    if manifest.get("version") != version:
        raise WeightsError(f"{folder}: manifest says version {manifest.get('version')}")


def _missing(weights_dir: Path, version: int, folder: Path) -> WeightsError:
    """The error for a version folder without a manifest."""
    if folder.is_dir():
        return WeightsError(f"{folder} has no {MANIFEST_FILE}: not a complete weights version")
    latest = latest_weights_version(weights_dir)
    if latest is not None and latest >= version:
        return WeightsGone(f"weights v{version:06d} are gone from {weights_dir} "
                           f"(pruned or replaced); LATEST is {latest}")
    return WeightsError(f"weights v{version:06d} were never published in {weights_dir} "
                        f"(LATEST is {latest})")


def _failure(folder: Path, manifest: dict[str, Any], message: str) -> WeightsError:
    """`WeightsGone` if the folder vanished or was replaced under the reader, else the error."""
    try:
        unchanged = read_json(folder / MANIFEST_FILE) == manifest
    except (OSError, ValueError):
        unchanged = False
    if unchanged:
        return WeightsError(message)
    return WeightsGone(f"{folder} was deleted or replaced while being loaded ({message})")


def load_start_weights(engine: Any, config: ExperimentConfig) -> None:
    """Load the stage's starting weights (multi-stage runs: `model.start_weights`, a
    `weights/v<N>` folder) into `engine` (anything with `load_weights(state, version)`) over
    the model folder's own; nothing happens when the stage starts from the model folder.
    Start weights that are a LoRA adapter (an earlier stage of a LoRA run) go into the
    engine's adapter, full weights into its base model."""
    if config.model.start_weights is not None:
        folder = Path(config.model.start_weights)
        state = load_weights(folder.parent, int(folder.name[1:]))
        if is_adapter_state(state) and config.model.lora is None:
            raise UserError(f"model.start_weights {folder} is a LoRA adapter: set model.lora "
                            "to continue training it (or export it merged and start from that)")
        engine.load_weights(state, 0)
