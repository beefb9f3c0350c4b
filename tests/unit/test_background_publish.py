"""sync.background: versions written on a thread land whole and in order, hold the weights
as they were when published (not as training changed them after), and a failed write
raises in the trainer."""

from __future__ import annotations

import pytest
import torch

from rft_hpc.sync.background import BackgroundWeightWriter
from rft_hpc.sync.weight_files import latest_weights_version, load_weights


def test_each_version_holds_the_weights_of_its_publish_not_later_changes(tmp_path):
    weights = {"w": torch.zeros(1000), "b": torch.arange(5, dtype=torch.float64)}
    writer = BackgroundWeightWriter(tmp_path)
    for version in range(1, 6):
        weights["w"].fill_(float(version))
        writer.submit(weights, version)
        weights["w"].fill_(-1.0)  # the next optimizer step, while the file is written
    writer.wait()
    assert latest_weights_version(tmp_path) == 5
    for version in (3, 4, 5):  # publish_weights keeps the newest 3
        loaded = load_weights(tmp_path, version)
        assert torch.equal(loaded["w"], torch.full((1000,), float(version)))
        assert torch.equal(loaded["b"], weights["b"])
    assert writer.write_seconds > 0


def test_a_failed_write_raises_at_the_next_wait(tmp_path):
    blocker = tmp_path / "weights"
    blocker.write_text("a file where the weights folder should be")
    writer = BackgroundWeightWriter(blocker)
    writer.submit({"w": torch.ones(3)}, 1)
    with pytest.raises(OSError):
        writer.wait()
    assert writer.wait() == pytest.approx(0.0, abs=1.0)  # raised once, then clear
