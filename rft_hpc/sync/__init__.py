"""Weight sync from trainer to explorers: files, gloo/NCCL, MPI (docs/weights-format.md)."""

from rft_hpc.sync.weight_files import (
    WeightsError,
    WeightsGone,
    latest_weights_version,
    load_latest_weights,
    load_weights,
    publish_weights,
)

__all__ = [
    "WeightsError",
    "WeightsGone",
    "latest_weights_version",
    "load_latest_weights",
    "load_weights",
    "publish_weights",
]
