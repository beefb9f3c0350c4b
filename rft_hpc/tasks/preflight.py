"""The checks of a config that need more than the config layer (imports, task files), run by
`rft-hpc validate` and by `run`/`submit` before they start anything.

Pass them to `load_config(path, overrides, checks=PREFLIGHT_CHECKS)`: their problems are
reported like the config's own, each with its key and line, all at once.
"""

from __future__ import annotations

from rft_hpc.config.loader import Check
from rft_hpc.tasks.reward_check import gold_problems, reward_problems, teacher_problems

PREFLIGHT_CHECKS: tuple[tuple[frozenset[str], Check], ...] = (
    (frozenset({"run", "tasks", "pipeline", "stages", "explorer", "mode"}), reward_problems),
    (frozenset({"eval", "stages"}), gold_problems),
    (frozenset({"algorithm", "mode", "explorer", "stages"}), teacher_problems),
)
"""(the top-level sections a check reads, the check); a check is skipped when one of its
sections failed to validate (that section's problems are reported instead)."""
