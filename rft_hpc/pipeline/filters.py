"""Experience filters: records the trainer drops from a batch before its step.

Filters run on the trainer's side (see docs/pipeline.md for why): the batch still counts as
consumed in full, and only the records left are trained on. A group is the batch's records
with one `group_id` (one task at one explorer step). Only rollouts (`Experience`) are
filtered; SFT samples and DPO pairs pass. Each filter reports `filter/<name>/dropped`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import Experience, Record
from rft_hpc.config.pipeline import (
    DuplicateFilter,
    FilterConfig,
    ResponseLengthFilter,
    RewardStdFilter,
    operator_name,
)
from rft_hpc.pipeline.shaping import response_tokens


def _groups(records: Sequence[Record], keep: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i in keep:
        r = records[i]
        if isinstance(r, Experience):
            groups[r.group_id].append(i)
    return groups


def apply_filter(flt: FilterConfig, records: Sequence[Record], keep: list[int]) -> list[int]:
    """The indices of `keep` (into `records`) that `flt` lets through, in order."""
    dropped: set[int] = set()
    if isinstance(flt, RewardStdFilter):
        for members in _groups(records, keep).values():
            rewards = np.array([records[i].reward for i in members],  # type: ignore[union-attr]
                               dtype=np.float64)
            if rewards.std() <= flt.min_std + 1e-12:
                dropped.update(members)
    elif isinstance(flt, ResponseLengthFilter):
        for i in keep:
            r = records[i]
            if isinstance(r, Experience):
                n = response_tokens(r)
                if n < flt.min_tokens or (flt.max_tokens is not None and n > flt.max_tokens):
                    dropped.add(i)
    elif isinstance(flt, DuplicateFilter):
        for members in _groups(records, keep).values():
            seen: set[bytes] = set()
            for i in members:
                r = records[i]
                assert isinstance(r, Experience) and r.response_mask is not None
                key = r.tokens[r.response_mask > 0].tobytes()
                if key in seen:
                    dropped.add(i)
                seen.add(key)
    else:
        raise AssertionError(f"unknown filter {flt!r}")
    return [i for i in keep if i not in dropped]


def filter_batch(batch: Batch, chain: Sequence[FilterConfig]) -> tuple[Batch, dict[str, float]]:
    """`batch` without the records `chain` drops (applied in order), and the metrics:
    `filter/<name>/dropped` per filter and `filter/kept`. No chain: `batch` itself."""
    if not chain:
        return batch, {}
    keep = list(range(len(batch)))
    metrics: dict[str, float] = {}
    for flt in chain:
        left = apply_filter(flt, batch.records, keep)
        metrics[f"filter/{operator_name(flt)}/dropped"] = float(len(keep) - len(left))
        keep = left
    metrics["filter/kept"] = float(len(keep))
    kept = Batch(records=[batch.records[i] for i in keep], refs=[batch.refs[i] for i in keep],
                 weights=[batch.weights[i] for i in keep], uses=[batch.uses[i] for i in keep],
                 dropped_stale=batch.dropped_stale)
    return kept, metrics
