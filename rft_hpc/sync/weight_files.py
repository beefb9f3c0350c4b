"""The `checkpoint` weight-sync method: versioned weight folders on the shared filesystem.

The trainer publishes; explorers poll `LATEST` and load. Layout (docs/weights-format.md)::

    weights/LATEST                     "<version>\\n", replaced atomically after each publish
    weights/v<NNNNNN>/model.safetensors
    weights/v<NNNNNN>/manifest.json    format, version, files with size and CRC-32, tensors

A LoRA run (`model.lora`) publishes the adapter alone: `adapter_model.safetensors` and
`adapter_config.json` instead of `model.safetensors` (the folder is a peft adapter folder),
and a manifest of version 2 that says so (`kind`, `adapter`).

With `sync.full_every` > 1 a whole model's version may be written as a delta against the
version published before it (manifest version 3, `kind: delta`, `delta.safetensors`: the
codec is rft_hpc/sync/delta.py); loading such a version applies it to the tensors of its base
that the reader holds, or rebuilds it from the whole version its chain starts from.

A version folder is written under a `.tmp-` name, fsynced and renamed into place before
`LATEST` names it, so `LATEST` never points at an incomplete version. Old versions are pruned
after `LATEST` moves on; a reader caught loading one gets `WeightsGone` and retries with the
version `LATEST` names now (`load_latest_weights` does that).

Every file (and `LATEST`) is read with retries (`rft_hpc.core.retry`); I/O errors that
outlast them raise `WeightsUnavailable`, no verdict on the weights. A version's manifest that
is missing while `LATEST` names that version is one this node does not see yet (the
publisher's rename, seen late through attribute caches: `LATEST` may be seen first): it is
waited for (`RetryPolicy.appear_s`), then a clear `WeightsError`. Once `LATEST` names a newer
version a missing version is gone (pruned), not damaged: `WeightsGone`.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.core.retry import PROCESS_RETRY, StillUnreadable, read_bytes
from rft_hpc.core.rundir import (
    atomic_write_json,
    atomic_write_text,
    read_json,
    remove_tree,
    weights_folder_name,
)
from rft_hpc.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_FILE, is_adapter_state
from rft_hpc.sync.delta import CODEC, DELTA_FILE, DeltaMismatch, apply_state, describe, encode_state
from rft_hpc.sync.protocols import WeightSink
from rft_hpc.sync.storage import (
    CHECKSUM_ALGORITHM,
    FileDigest,
    ReadBuffer,
    commit_folder,
    dtype_name,
    load_safetensors,
    make_temp_folder,
    numbered_folders,
    prune_numbered,
    remove_temporaries,
    save_safetensors,
)

log = logging.getLogger(__name__)

WEIGHTS_FORMAT = "rft-hpc-weights"
MANIFEST_VERSION = 3
"""The newest manifest version this rft-hpc reads. Full weights are still written as
version 1 (their format did not change); an adapter is written as version 2, which an
rft-hpc that reads only version 1 refuses instead of loading it as a whole model; a delta
as version 3, which older readers refuse likewise."""
FULL_MANIFEST_VERSION = 1
DELTA_MANIFEST_VERSION = 3
KIND_FULL = "full"
KIND_ADAPTER = "lora-adapter"
KIND_DELTA = "delta"
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


class WeightsUnavailable(WeightsError):
    """A file of the version kept failing with I/O errors through every retry: the weights
    may well be intact; load them again later."""


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """The folder of weights version `version`: `weights_dir/v<NNNNNN>`."""
    return Path(weights_dir) / weights_folder_name(version)


def publish_weights(weights_dir: str | Path, state_dict: Mapping[str, torch.Tensor],
                    version: int, *, keep: int = 3, extra: dict[str, Any] | None = None,
                    keep_also: Collection[int] = (), adapter: dict[str, Any] | None = None,
                    delta_of: tuple[int, Mapping[str, torch.Tensor]] | None = None,
                    ) -> Path:
    """Publish `state_dict` as weights version `version` and point `LATEST` at it.

    With `adapter` (peft's adapter config as JSON data) `state_dict` is a LoRA adapter's
    tensors: the folder holds `adapter_model.safetensors` and `adapter_config.json` (a peft
    adapter folder) and the manifest (version 2) says `kind: lora-adapter`.

    With `delta_of` = `(base, tensors)`, the tensors of version `base` that this publisher
    published before, a whole model is written as a delta against them (manifest version 3,
    `delta.safetensors`) when `base` is still published and has the same tensor names,
    dtypes and shapes; otherwise whole.

    Steps: delete `.tmp-` leftovers of a killed publisher; write `model.safetensors` (tensors
    moved to CPU one at a time, dtypes and shapes kept) and `manifest.json` into a `.tmp-`
    folder, fsync, rename it to `v<NNNNNN>` (replacing an earlier publish of the same
    version), fsync the parent; replace `LATEST` atomically; delete all versions but the
    newest `keep`, this one and those in `keep_also` (versions an evaluator will score), and
    the versions that the deltas among those need to be rebuilt. One publisher per
    `weights_dir`. Returns the version folder.
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    weights_dir = Path(weights_dir)
    remove_temporaries(weights_dir)
    final = version_dir(weights_dir, version)
    delta = None if adapter is not None or delta_of is None else _delta(
        weights_dir, state_dict, version, *delta_of)
    tmp = make_temp_folder(weights_dir, final.name)
    try:
        if delta is not None:
            blobs, manifest = delta
            digest = save_safetensors(tmp / DELTA_FILE, blobs)
            manifest.update(version=version, created=time.time(),
                            files=[{"name": DELTA_FILE, **digest.as_json()}], extra=extra or {})
        else:
            file = MODEL_FILE if adapter is None else ADAPTER_FILE
            digest = save_safetensors(tmp / file, state_dict)
            if adapter is not None:
                atomic_write_json(tmp / ADAPTER_CONFIG_FILE, adapter)
            manifest = _manifest(state_dict, version, file, digest, extra, adapter)
        atomic_write_json(tmp / MANIFEST_FILE, manifest)
        commit_folder(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise
    atomic_write_text(weights_dir / LATEST_FILE, f"{version}\n")
    _prune(weights_dir, keep, {version, *keep_also})
    return final


def _delta(weights_dir: Path, state_dict: Mapping[str, torch.Tensor], version: int,
           base: int, base_state: Mapping[str, torch.Tensor],
           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The blobs and (partial) manifest of `state_dict` as a delta against `base`, or None
    when it must be published whole (the base is gone, is an adapter, or does not fit)."""
    try:
        base_manifest = read_manifest(weights_dir, base)
    except WeightsError:
        return None
    if base >= version or base_manifest["kind"] not in (KIND_FULL, KIND_DELTA):
        return None
    try:
        blobs = encode_state(state_dict, base_state)
    except DeltaMismatch as e:
        log.info("weights published whole, not as a delta of v%d: %s", base, e)
        return None
    return blobs, {
        "format": WEIGHTS_FORMAT, "manifest_version": DELTA_MANIFEST_VERSION,
        "kind": KIND_DELTA, "base": base,
        "full": base_manifest.get("full", base), "codec": CODEC,
        "checksum_algorithm": CHECKSUM_ALGORITHM, "tensors": describe(state_dict)}


def _prune(weights_dir: Path, keep: int, protect: set[int]) -> None:
    """Delete all versions but the newest `keep`, those in `protect` and every version
    from which a delta among them is rebuilt (its chain back to its whole version)."""
    folders = numbered_folders(weights_dir, _VERSION_FOLDER)
    needed = set(protect)
    for v in set(sorted(folders)[-keep:]) | (protect & set(folders)):
        needed.update(chain_versions(weights_dir, v))
    prune_numbered(weights_dir, _VERSION_FOLDER, keep, protect=needed)


def chain_versions(weights_dir: str | Path, version: int) -> range:
    """The versions a reader may need to rebuild `version`: from the whole version its
    chain starts at to itself (just itself for a whole version, or an unreadable one)."""
    try:
        manifest = read_manifest(weights_dir, version)
    except WeightsError:
        return range(version, version + 1)
    return range(int(manifest.get("full", version)), version + 1)


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


def _read_manifest(weights_dir: str | Path, version: int,
                   wanted: int | None = None) -> dict[str, Any]:
    """The manifest of `version`, read for a load of version `wanted` (default: itself):
    waited for while it is not visible yet and `LATEST` names `wanted` (otherwise it is
    gone, or was never published: `_missing` says which)."""
    folder = version_dir(weights_dir, version)
    path = folder / MANIFEST_FILE
    top = version if wanted is None else wanted

    def absent() -> bool:
        """Nothing to wait for: LATEST moved on, or the folder is seen without the manifest
        (a folder is committed whole: seeing it means seeing what it holds)."""
        try:
            return latest_weights_version(weights_dir) != top or (
                folder.is_dir() and not path.exists())
        except (WeightsError, OSError):  # cannot tell now: wait on
            return False

    try:
        manifest = PROCESS_RETRY.read("weights manifest", path, lambda: read_json(path),
                                      named=True, absent=absent)
    except FileNotFoundError:
        raise _missing(Path(weights_dir), version, folder) from None
    except StillUnreadable as e:
        if e.errno == errno.ENOENT:
            raise WeightsError(
                f"{path} did not appear within {PROCESS_RETRY.policy.appear_s:.0f} s although "
                f"LATEST names v{top}: the publisher's rename never reached this node") from e
        raise WeightsUnavailable(f"{path}: {e.strerror}") from e
    except (OSError, ValueError) as e:
        raise WeightsError(f"{folder / MANIFEST_FILE}: unreadable manifest ({e})") from e
    _check_manifest(manifest, version, folder)
    return manifest


def latest_weights_version(weights_dir: str | Path) -> int | None:
    """The version `LATEST` names, or None when nothing was published (one small read)."""
    path = Path(weights_dir) / LATEST_FILE
    try:
        text = read_bytes(path, what="weights pointer").decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except StillUnreadable as e:
        raise WeightsUnavailable(f"{path}: {e.strerror}") from e
    try:
        return int(text.strip())
    except ValueError:
        raise WeightsError(f"{path} does not hold a version number: {text[:40]!r}") from None


def load_weights(weights_dir: str | Path, version: int, buffer: ReadBuffer | None = None, *,
                 held: tuple[int, dict[str, torch.Tensor]] | None = None,
                 ) -> dict[str, torch.Tensor]:
    """Load weights version `version` as CPU tensors, verified against its manifest.

    Every file's size and checksum, and every tensor's name, dtype and shape, must match the
    manifest. Raises `WeightsGone` when the version was deleted before or during the load (a
    newer one exists: load that), `WeightsUnavailable` when I/O errors outlast the retries
    (load it again later), `WeightsError` for anything else (never published, corrupted,
    unknown format). The tensors are views of one buffer per file: of `buffer`
    (valid until its next use; for a single-file model) when given.

    A delta version (manifest version 3) is applied to `held` = `(base, tensors)`, the
    tensors of its base version that the caller loaded before (changed in place and
    returned; only the delta's file is read); when the caller holds another version, or any
    tensor's checksum after the delta differs from the publisher's, it is rebuilt from the
    whole version its chain starts at and the deltas after it (each checked the same way).
    """
    manifest = _read_manifest(weights_dir, version)
    if manifest.get("kind") != KIND_DELTA:
        return _load_whole(weights_dir, version, manifest, buffer)
    if held is not None and held[0] == manifest["base"]:
        try:
            _apply_delta(weights_dir, version, manifest, held[1])
            return held[1]
        except DeltaMismatch as e:
            log.warning("weights v%d: delta does not fit the held v%d (%s): loading its chain "
                        "from v%d", version, held[0], e, manifest["full"])
    chain = [manifest]
    while chain[-1].get("kind") == KIND_DELTA:
        base = int(chain[-1]["base"])
        if base >= chain[-1]["version"]:
            raise WeightsError(f"weights v{chain[-1]['version']}: a delta of v{base}, not of an "
                               "earlier version")
        chain.append(_read_manifest(weights_dir, base, version))
    start = chain.pop()
    tensors = _load_whole(weights_dir, start["version"], start, buffer)
    for link in reversed(chain):
        try:
            _apply_delta(weights_dir, link["version"], link, tensors)
        except DeltaMismatch as e:
            folder = version_dir(weights_dir, link["version"])
            raise _failure(folder, link, f"{folder} does not rebuild v{link['version']} from "
                           f"v{start['version']}: {e}") from e
    return tensors


def _load_whole(weights_dir: str | Path, version: int, manifest: dict[str, Any],
                buffer: ReadBuffer | None) -> dict[str, torch.Tensor]:
    """The tensors of a whole (or adapter) version whose manifest is `manifest`."""
    folder = version_dir(weights_dir, version)
    tensors = _read_files(folder, manifest, buffer)
    found = {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for n, t in tensors.items()}
    listed = manifest["tensors"]
    if found != listed:
        odd = sorted(set(found) ^ set(listed))
        changed = sorted(n for n in set(found) & set(listed) if found[n] != listed[n])
        raise WeightsError(f"{folder}: tensors differ from the manifest (present in only one: "
                           f"{odd[:5]}; other dtype or shape: {changed[:5]})")
    return tensors


def _apply_delta(weights_dir: str | Path, version: int, manifest: dict[str, Any],
                 held: dict[str, torch.Tensor]) -> None:
    """Turn `held` (the base's tensors) into delta version `version` in place; raises
    `DeltaMismatch` when a result's checksum or a tensor's kind differs from the manifest."""
    if manifest.get("codec") != CODEC:
        raise WeightsError(f"{version_dir(weights_dir, version)}: unknown delta codec "
                           f"{manifest.get('codec')!r}")
    blobs = _read_files(version_dir(weights_dir, version), manifest, None)
    apply_state(held, blobs, manifest["tensors"])


def _read_files(folder: Path, manifest: dict[str, Any],
                buffer: ReadBuffer | None) -> dict[str, torch.Tensor]:
    """The tensors of every file the manifest lists, each file's size and CRC checked."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest["files"]:
        path = folder / entry["name"]
        try:
            part, digest = load_safetensors(path, buffer if len(manifest["files"]) == 1
                                            else None)
        except StillUnreadable as e:
            raise WeightsUnavailable(f"{path}: {e.strerror}") from e
        except (OSError, ValueError) as e:
            raise _failure(folder, manifest, f"cannot read {path}: {e}") from e
        expected = FileDigest(entry["bytes"], entry["checksum"])
        if digest != expected:
            raise _failure(folder, manifest, f"{path} is corrupt: {digest.bytes} bytes with "
                           f"crc32 {digest.checksum}, manifest says {expected.bytes} bytes "
                           f"with crc32 {expected.checksum}")
        tensors.update(part)
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


def _check_manifest(manifest: object, version: int, folder: Path) -> None:
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


def load_start_weights(engine: WeightSink, config: ExperimentConfig) -> None:
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
