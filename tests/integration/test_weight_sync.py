"""The checkpoint weight-sync method: publish, load, prune, verify, survive SIGKILL."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch

from rft_hpc.core.rundir import TEMP_PREFIX
from rft_hpc.models.tiny import init_tiny_model
from rft_hpc.sync import weight_files as sync
from rft_hpc.sync.crc import RunningCrc, crc32_combine
from rft_hpc.sync.storage import load_safetensors, save_safetensors, wait_for_deletions
from rft_hpc.sync.weight_files import (
    WeightsError,
    WeightsGone,
    latest_weights_version,
    load_latest_weights,
    load_weights,
    publish_weights,
    version_dir,
)

# Shared with the publisher subprocess of the SIGKILL test: the weights of each version.
STATE_CODE = textwrap.dedent("""
    def state_for(version):
        g = torch.Generator().manual_seed(version)
        return {"w": torch.randn(1 << 20, generator=g),
                "h": torch.randn(256, 1024, generator=g).to(torch.bfloat16)}
""")
namespace: dict = {"torch": torch}
exec(STATE_CODE, namespace)
state_for = namespace["state_for"]


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "layer.weight": torch.randn(17, 33, generator=g),
        "layer.bias": torch.randn(33, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(3, 1, 2, generator=g).half(),
        "flag": torch.tensor(True),
        "strided": torch.randn(8, 6, generator=g).t(),  # non-contiguous
        "empty": torch.zeros(0, 4),
    }


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8),
                           tensor.contiguous().reshape(-1).view(torch.uint8)), name


def test_round_trip_is_bit_exact_and_manifest_describes_it(tmp_path):
    state = mixed_state()
    folder = publish_weights(tmp_path, state, 7, extra={"step": 7})
    assert folder == tmp_path / "v000007"
    assert sorted(os.listdir(folder)) == ["manifest.json", "model.safetensors"]
    assert latest_weights_version(tmp_path) == 7
    assert (tmp_path / "LATEST").read_text() == "7\n"
    assert_bit_equal(load_weights(tmp_path, 7), state)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "rft-hpc-weights" and manifest["manifest_version"] == 1
    assert manifest["version"] == 7 and manifest["extra"] == {"step": 7}
    assert manifest["checksum_algorithm"] == "crc32"
    [entry] = manifest["files"]
    assert entry["name"] == "model.safetensors"
    assert entry["bytes"] == (folder / "model.safetensors").stat().st_size
    assert manifest["tensors"]["layer.bias"] == {"dtype": "bfloat16", "shape": [33]}
    assert manifest["tensors"]["strided"] == {"dtype": "float32", "shape": [6, 8]}
    # a standard safetensors file: the reference library reads it
    assert_bit_equal(safetensors.torch.load_file(folder / "model.safetensors"), state)


def test_reads_files_written_by_the_safetensors_library(tmp_path):
    state = {k: v.contiguous() for k, v in mixed_state().items()}
    safetensors.torch.save_file(state, tmp_path / "ref.safetensors")
    tensors, digest = load_safetensors(tmp_path / "ref.safetensors")
    assert_bit_equal(tensors, state)
    assert digest.bytes == (tmp_path / "ref.safetensors").stat().st_size
    ours = save_safetensors(tmp_path / "ours.safetensors", state)
    assert load_safetensors(tmp_path / "ours.safetensors")[1] == ours


def test_latest_moves_and_keep_prunes_older_versions(tmp_path):
    assert latest_weights_version(tmp_path) is None
    assert load_latest_weights(tmp_path) is None
    for version in range(1, 6):
        publish_weights(tmp_path, {"x": torch.full((4,), float(version))}, version, keep=2)
        assert latest_weights_version(tmp_path) == version
        # a pruned version vanishes at once; its files go on the deletion thread
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("v")) == [
            f"v{v:06d}" for v in range(max(1, version - 1), version + 1)]
    wait_for_deletions()
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v000004", "v000005"]
    with pytest.raises(WeightsGone, match="LATEST is 5"):
        load_weights(tmp_path, 1)
    version, tensors = load_latest_weights(tmp_path)
    assert version == 5 and tensors["x"].tolist() == [5.0] * 4
    # a trainer resumed from an older checkpoint re-publishes an older version: it is kept
    publish_weights(tmp_path, {"x": torch.full((4,), -3.0)}, 3, keep=1)
    assert latest_weights_version(tmp_path) == 3
    wait_for_deletions()
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "v000003", "v000005"]
    # re-publishing an existing version replaces it whole
    publish_weights(tmp_path, {"x": torch.full((2,), 9.0)}, 5, keep=3)
    assert load_weights(tmp_path, 5)["x"].tolist() == [9.0, 9.0]


def test_never_published_version_is_an_error_not_gone(tmp_path):
    with pytest.raises(WeightsError, match="never published") as info:
        load_weights(tmp_path, 3)
    assert not isinstance(info.value, WeightsGone)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_file_raises_weights_error(tmp_path, damage):
    folder = publish_weights(tmp_path, mixed_state(), 1)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-20] ^= 0x01  # one bit of tensor data
    else:
        data = data[:-3]
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"corrupt|cannot read") as info:
        load_weights(tmp_path, 1)
    assert not isinstance(info.value, WeightsGone)


def test_missing_manifest_is_an_error(tmp_path):
    folder = publish_weights(tmp_path, mixed_state(), 1)
    (folder / "manifest.json").unlink()
    with pytest.raises(WeightsError, match=r"no manifest\.json"):
        load_weights(tmp_path, 1)


def test_version_pruned_while_loading_raises_gone_and_latest_loader_retries(tmp_path,
                                                                            monkeypatch):
    publish_weights(tmp_path, {"x": torch.zeros(3)}, 1)
    real_load = sync.load_safetensors
    calls = []

    def publish_newer_then_read(path, buffer=None):
        # the trainer publishes v2 with keep=1 right after the reader read v1's manifest
        if not calls:
            publish_weights(tmp_path, {"x": torch.ones(3)}, 2, keep=1)
        calls.append(path)
        return real_load(path, buffer)

    monkeypatch.setattr(sync, "load_safetensors", publish_newer_then_read)
    with pytest.raises(WeightsGone):
        load_weights(tmp_path, 1)
    calls.clear()
    publish_weights(tmp_path, {"x": torch.zeros(3)}, 1, keep=5)  # LATEST back to 1
    version, tensors = load_latest_weights(tmp_path)
    assert version == 2 and tensors["x"].tolist() == [1.0, 1.0, 1.0]
    assert [p.parent.name for p in calls] == ["v000001", "v000002"]


PUBLISHER = STATE_CODE + textwrap.dedent("""
    import os, signal, sys, time
    import torch
    torch.set_num_threads(1)
    from rft_hpc.sync.weight_files import publish_weights

    for line in sys.stdin:  # "<weights dir> <seconds before SIGKILL>"
        folder, delay = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                version = 0
                while True:
                    version += 1
                    publish_weights(folder, state_for(version), version, keep=2)
            finally:
                os._exit(1)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, flush=True)
""")


def test_sigkill_while_publishing_never_exposes_an_incomplete_version(tmp_path, rng):
    """Publishers killed at random moments: LATEST and every visible version stay whole."""
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    published = leftovers = 0
    try:
        for trial in range(10):
            folder = tmp_path / f"trial-{trial}"
            proc.stdin.write(f"{folder} {rng.uniform(0.01, 0.3):.4f}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "True", "publisher died on its own"
            latest = latest_weights_version(folder)
            entries = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
            visible = [name for name in entries if name.startswith("v")]
            leftovers += any(name.startswith(TEMP_PREFIX) for name in entries)
            if latest is not None:
                published += 1
                assert f"v{latest:06d}" in visible
            for name in visible:  # every visible version is complete and correct
                version = int(name[1:])
                assert_bit_equal(load_weights(folder, version), state_for(version))
            # a restarted publisher carries on and cleans up what the killed one left
            publish_weights(folder, state_for(99), 99, keep=2)
            wait_for_deletions()
            assert not [p for p in folder.iterdir() if p.name.startswith(TEMP_PREFIX)]
            assert_bit_equal(load_latest_weights(folder)[1], state_for(99))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    print(f"{published} trials had published versions, {leftovers} left temporaries")
    assert published >= 3  # the kills did land amid publishing, not only before it


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_model_loaded_from_published_weights_gives_identical_logits(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in trained.parameters():  # differ from the initial weights
            p.add_(0.01 * torch.randn_like(p))
    publish_weights(tmp_path, trained.state_dict(), 3)
    explorer = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    explorer.load_state_dict(load_weights(tmp_path, 3))
    ids = torch.randint(3, 20, (2, 16))
    with torch.no_grad():
        assert torch.equal(explorer(ids).logits, trained(ids).logits)
    assert version_dir(tmp_path, 3).is_dir()


def test_loads_into_a_reused_buffer_give_each_version_whole(tmp_path):
    from rft_hpc.sync.storage import ReadBuffer

    buffer = ReadBuffer()
    big = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    small = {"w": torch.full((10,), 3.0), "b": torch.zeros(7, dtype=torch.bfloat16)}
    publish_weights(tmp_path, big, 1, keep=5)
    publish_weights(tmp_path, small, 2, keep=5)
    first = load_weights(tmp_path, 1, buffer)
    assert torch.equal(first["w"], big["w"]) and torch.equal(first["b"], big["b"])
    address = first["w"].untyped_storage().data_ptr()
    second = load_weights(tmp_path, 2, buffer)  # smaller: into the same memory
    assert torch.equal(second["w"], small["w"]) and torch.equal(second["b"], small["b"])
    assert second["w"].untyped_storage().data_ptr() == address


def test_running_crc_equals_zlib_with_no_one_or_more_threads():
    rng = random.Random(7)
    for _ in range(300):  # crc32_combine against zlib on odd lengths, empty ones included
        a, b = rng.randbytes(rng.randint(0, 300)), rng.randbytes(rng.choice([0, 1, 7, 4099]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = rng.randbytes(3 << 20)
    for workers in (0, 1, 2, 3):
        with RunningCrc(workers) as crc:
            pos = 0
            while pos < len(data):
                n = rng.choice([0, 1, 1000, 1 << 20])
                crc.add(memoryview(data)[pos:pos + n])
                pos += n
            assert crc.value == zlib.crc32(data), workers
    cores = os.sched_getaffinity(0)
    try:  # pinned to one core, the caller checksums: threads there only add switches
        os.sched_setaffinity(0, {min(cores)})
        with RunningCrc.for_this_process(2) as crc:
            assert crc._pool is None
            crc.add(data)
            assert crc.value == zlib.crc32(data)
    finally:
        os.sched_setaffinity(0, cores)
