"""Whole-buffer views for people: `verify` (check every segment) and `summarize` (inspect)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rft_hpc.buffer.archive import is_archive, read_archive
from rft_hpc.buffer.jsonl import iter_segments
from rft_hpc.buffer.layout import open_buffer_dir, quarantine_segment, stray_temporaries
from rft_hpc.buffer.segment import SCHEMAS, CorruptSegment, read_segment, read_segment_attrs
from rft_hpc.core.retry import StillUnreadable


@dataclass
class Problem:
    """One unreadable segment and what `verify` did about it."""

    path: str
    reason: str
    quarantined_to: str | None = None


@dataclass
class VerifyReport:
    """Result of `verify_buffer`."""

    segments: int = 0
    """Segments checked, those held by archives included."""
    archives: int = 0
    records: int = 0
    problems: list[Problem] = field(default_factory=list)
    temporaries: list[str] = field(default_factory=list)

    @property
    def unfixed(self) -> list[Problem]:
        return [p for p in self.problems if p.quarantined_to is None]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def verify_buffer(buffer: Path, *, fix: bool = False) -> VerifyReport:
    """Read and check every committed segment and archive (structure and all checksums).

    With `fix`, each corrupt segment is moved to `<buffer>/quarantine/<writer>/` beside a
    `.reason.txt`. Temporary files are listed (they belong to live or dead writers; a
    restarted writer removes its own) but never touched.
    """
    open_buffer_dir(buffer)
    report = VerifyReport()
    writers: set[str] = set()
    for writer, path in iter_segments(buffer):
        writers.add(writer)
        try:
            if is_archive(path):
                parts = read_archive(path)
                report.segments += len(parts)
                report.archives += 1
                report.records += sum(p.num_records for p in parts)
                continue
            seg = read_segment(path)
        except StillUnreadable as exc:  # no proof of damage: reported, never quarantined
            report.segments += 1
            report.problems.append(Problem(str(path), f"{exc.strerror} (not quarantined)"))
            continue
        except CorruptSegment as exc:
            report.segments += 1
            problem = Problem(str(path), exc.reason)
            if fix:
                reason = f"rft-hpc buffer verify --fix: {exc.reason}"
                problem.quarantined_to = str(quarantine_segment(buffer, path, reason))
            report.problems.append(problem)
            continue
        report.segments += 1
        report.records += seg.num_records
    for writer in sorted(writers):
        report.temporaries += [str(buffer / writer / t) for t in stray_temporaries(buffer / writer)]
    return report


@dataclass
class WriterSummary:
    """Per-writer figures shown by `rft-hpc buffer inspect`."""

    writer: str
    kinds: list[str] = field(default_factory=list)
    segments: int = 0
    """Segments, those held by archives included."""
    archives: int = 0
    corrupt_segments: int = 0
    records: int = 0
    tokens: int = 0
    steps: list[int] | None = None
    """[first step, end step) over the readable segments."""
    policy_versions: list[int] | None = None
    reward_mean: float | None = None
    reward_std: float | None = None
    tasksets: dict[str, int] = field(default_factory=dict)


_SUMMARY_FIELDS = ("tokens", "chosen_tokens", "rejected_tokens", "reward", "policy_version",
                   "taskset")


def summarize_buffer(buffer: Path) -> list[WriterSummary]:
    """Per-writer counts, step range, policy versions, reward mean/std and token totals.

    Reads only what the figures need; corrupt segments are counted, not fatal.
    """
    open_buffer_dir(buffer)
    out: dict[str, WriterSummary] = {}
    rewards: dict[str, list[np.ndarray]] = {}
    tasksets: dict[str, Counter[str]] = {}
    for writer, path in iter_segments(buffer):
        s = out.setdefault(writer, WriterSummary(writer))
        try:
            s.segments += int(read_segment_attrs(path).get("num_segments", 1))
        except CorruptSegment:
            s.segments += 1
        s.archives += is_archive(path)
        try:
            seg = read_segment(path, fields=_SUMMARY_FIELDS)
        except CorruptSegment:
            s.corrupt_segments += 1
            continue
        if seg.kind not in s.kinds:
            s.kinds.append(seg.kind)
        s.steps = _span(s.steps, seg.step_start, seg.step_end)
        s.records += seg.num_records
        for g in SCHEMAS[seg.kind].groups:
            s.tokens += int(seg.columns[g.offsets][-1])
        tasksets.setdefault(writer, Counter()).update(seg.columns["taskset"])
        if "reward" in seg.columns and seg.num_records:
            rewards.setdefault(writer, []).append(seg.columns["reward"].astype(np.float64))
            v = seg.columns["policy_version"]
            s.policy_versions = _span(s.policy_versions, int(v.min()), int(v.max()))
    for writer, parts in rewards.items():
        r = np.concatenate(parts)
        out[writer].reward_mean = _finite(r.mean())
        out[writer].reward_std = _finite(r.std())
    for writer, counts in tasksets.items():
        out[writer].tasksets = dict(sorted(counts.items()))
    return [out[w] for w in sorted(out)]


def _span(span: list[int] | None, lo: int, hi: int) -> list[int]:
    return [lo, hi] if span is None else [min(span[0], lo), max(span[1], hi)]


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
