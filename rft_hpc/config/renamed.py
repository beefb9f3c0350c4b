"""Settings that had a second name: the old name is refused with a message naming the new one.

Each setting has one name. Where an earlier version accepted the same setting under another
name (a `trainer` shorthand for a key of the `algorithm` section), a config that still uses
that name fails to load, with the key's line and the name to write instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from rft_hpc.config.explain import Key, dotted

RENAMED: dict[tuple[str, ...], tuple[str, str]] = {
    ("trainer", "algorithm"): ("algorithm.algorithm_type", ""),
    ("trainer", "clip_ratio"): ("algorithm.policy_loss_fn_args.clip_range", ""),
    ("trainer", "kl_coef"): ("algorithm.kl_loss_fn_args.kl_coef", "with kl_loss_fn: k3"),
    ("algorithm", "policy_loss_fn_args", "loss_agg_mode"): ("algorithm.loss_agg_mode", ""),
}
"""Old key path (from the top of a config, or of a stage) -> (its name now, a note)."""


def take_renamed(data: dict[object, object]) -> list[tuple[tuple[Key, ...], str]]:
    """(key path, message) of each old name in `data`, at the top level and in each entry
    of `stages`; each is removed from `data`, so that validation reports the config's other
    problems and not the same key again as unknown."""
    found = list(_find(data, ()))
    stages = data.get("stages")
    if isinstance(stages, list):
        for index, stage in enumerate(stages):
            if isinstance(stage, dict):
                found += _find(stage, ("stages", index))
    out = []
    for mapping, where, old in found:
        mapping.pop(old[-1], None)  # YAML aliases may share one mapping between two paths
        new, note = RENAMED[old]
        new_key = f"{dotted(where)}.{new}" if where else new
        out.append(((*where, *old), f"was renamed to {new_key}"
                     + (f" ({note})" if note else "") + "; write that instead"))
    return out


def _find(data: dict[object, object], where: tuple[Key, ...],
          ) -> Iterator[tuple[dict[object, object], tuple[Key, ...], tuple[str, ...]]]:
    """(the mapping holding it, the stage prefix, the old path) of each old name in `data`."""
    for old in RENAMED:
        mapping: object = data
        for key in old[:-1]:
            mapping = mapping.get(key) if isinstance(mapping, dict) else None
        if isinstance(mapping, dict) and old[-1] in mapping:
            yield mapping, where, old
