"""Delta weight versions (`sync.full_every`): the codec is lossless for every dtype, and a
receiver that follows a chain of deltas (restarting mid-chain, holding corrupted bits, or
reading a corrupted file) ends with exactly the bits that whole versions give."""

from __future__ import annotations

import logging

import pytest
import torch

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.rundir import RunDir
from rft_hpc.runtime.common import StopFlag
from rft_hpc.sync.delta import DELTA_FILE, decode_into, encode
from rft_hpc.sync.follower import WeightFollower
from rft_hpc.sync.publisher import WeightPublisher
from rft_hpc.sync.weight_files import (
    WeightsError,
    latest_weights_version,
    load_weights,
    read_manifest,
    version_dir,
)

K = 3  # sync.full_every


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bytes: equal bits, not equal values (NaN, -0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(bits(got[name]), bits(t)), name


def test_codec_restores_every_dtype_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    base = {"f32": torch.randn(33, 17, generator=g),
            "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
            "f16": torch.randn(4, 5, generator=g).half(),
            "f64": torch.randn(7, generator=g).double(),
            "i64": torch.arange(9), "flag": torch.tensor([True, False]),
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    new = {n: t.clone() for n, t in base.items()}
    new["f32"][0, :5] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 3.0])
    new["f32"] = new["f32"].t()  # non-contiguous
    new["bf16"] += 1e-2
    new["f16"][1] = 7
    new["f64"][3] = float("-inf")
    new["i64"][2] = -1
    new["flag"] = ~new["flag"]
    new["scalar"] = torch.tensor(-2.5)
    for name in base:
        held = base[name].t().contiguous() if name == "f32" else base[name].clone()
        decode_into(held, encode(new[name].contiguous(), held))
        assert torch.equal(bits(held), bits(new[name])), name


class Engine:
    """An explorer's engine, as the follower drives it: keeps a copy of what it loads."""

    def __init__(self) -> None:
        self.version, self.state = -1, {}

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.state = {n: t.clone() for n, t in state.items()}
        self.version = version


def trainer_updates(steps: int, dtype: torch.dtype):
    """The state dict after each of `steps` AdamW steps at lr 1e-5 (a tiny model's shapes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 24), torch.nn.Linear(24, 48),
                                torch.nn.LayerNorm(48), torch.nn.Linear(48, 32)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(steps):
        logits = model(torch.randint(0, 32, (4, 6)))
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32),
                                                 torch.randint(0, 32, (24,)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield {n: t.detach() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_sync_ends_bit_identical_to_full_sync(tmp_path, dtype, caplog):
    runs = {k: RunDir(tmp_path / f"every-{k}") for k in (1, K)}
    publishers = {k: WeightPublisher(ExperimentConfig.model_validate(
        {"sync": {"full_every": k, "background": k == K}}), run) for k, run in runs.items()}
    follower = WeightFollower(runs[K], Engine(), StopFlag())
    kinds = []
    try:
        for version, state in enumerate(trainer_updates(8, dtype), start=1):
            for publisher in publishers.values():
                publisher.publish(state, version)
                publisher.flush()
            kinds.append(read_manifest(runs[K].weights, version)["kind"])
            if version == 5:  # the explorer restarts mid-chain: nothing held
                follower = WeightFollower(runs[K], Engine(), StopFlag())
            if version == 6:  # the held bits went bad: the delta's checksums find it
                next(iter(follower.held[1].values())).view(torch.uint8)[0] ^= 1
            with caplog.at_level(logging.WARNING, "rft_hpc.sync.weight_files"):
                assert follower.refresh() == version
            full = load_weights(runs[1].weights, version)
            assert_bit_identical(follower.engine.state, full)
            assert_bit_identical(follower.engine.state, state)
            # a reader starting now rebuilds it from the chain's whole version
            assert_bit_identical(load_weights(runs[K].weights, version), full)
    finally:
        follower.close()
    assert kinds == ["full", "delta", "delta"] * 2 + ["full", "delta"]
    assert [r.message for r in caplog.records if "does not fit" in r.message] != []
    delta = read_manifest(runs[K].weights, 8)
    assert (delta["manifest_version"], delta["base"], delta["full"]) == (3, 7, 7)
    assert read_manifest(runs[1].weights, 8)["manifest_version"] == 1
    sizes = {k: version_dir(run.weights, 8).joinpath(
        DELTA_FILE if k == K else "model.safetensors").stat().st_size for k, run in runs.items()}
    assert sizes[K] < sizes[1]
    # pruning kept the newest 3 and what they are rebuilt from (v6: whole v4 and delta v5)
    assert sorted(p.name for p in runs[K].weights.glob("v*")) == [
        f"v00000{v}" for v in range(4, 9)]


def test_a_corrupted_delta_file_is_an_error_held_base_or_not(tmp_path):
    run = RunDir(tmp_path)
    publisher = WeightPublisher(ExperimentConfig.model_validate(
        {"sync": {"full_every": 4, "background": False}}), run)
    states = list(trainer_updates(3, torch.float32))
    for version, state in enumerate(states, start=1):
        publisher.publish(state, version)
    assert read_manifest(run.weights, 3)["kind"] == "delta"
    held = (2, load_weights(run.weights, 2))
    path = version_dir(run.weights, 3) / DELTA_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        load_weights(run.weights, 3, held=held)
    with pytest.raises(WeightsError, match="corrupt"):
        load_weights(run.weights, 3)
    assert latest_weights_version(run.weights) == 3
