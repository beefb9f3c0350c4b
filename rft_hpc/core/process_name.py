"""A process's name as `ps`, `top` and the kernel show it: `rft-<role>`."""

from __future__ import annotations

import contextlib
from pathlib import Path


def name_process(role: str) -> None:
    """Name this process `rft-<role>` (the kernel keeps 15 characters); where the system
    has no `/proc/self/comm` (not Linux) nothing changes."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"rft-{role}"[:15])
