"""Weight sync from the trainer to the explorers (docs/weights-format.md).

`checkpoint` is the portable method, and the fallback of the faster ones: versioned weight
folders on the shared filesystem with a `LATEST` pointer.
"""

from rft_hpc.sync.checkpoint import (
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
