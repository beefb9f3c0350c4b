#!/usr/bin/env python
"""Scale simulation of the buffer: many writers, a polling trainer, compaction on.

    python tools/bench/scale.py [--writers 16 64 256] [--steps 96] [--records 4]
        [--min-segments 16] [--fanout 4] [--save-every 8] [--fsync] [--dir DIR] [--json]

For each writer count W, in one process (writers take turns, so the figures do not depend
on how many cores there are): W writers `explorer-<i>` each commit `--steps` one-step
segments of `--records` small records; after each round of W segments the trainer's reader
polls, takes everything (a consumed step), and polls once more with nothing new (an idle
poll); every `--save-every` rounds it "checkpoints" (its cursor) and compacts what that
cursor consumed (`buffer.compact`), as the trainer does. Explorer and trainer ledgers are
written as the roles write them, and at the end `rft-hpc audit`'s `audit_run` checks the
stage, timed.

Filesystem metadata operations are counted by wrapping the calls the buffer code makes:
`os.stat/lstat/listdir/scandir/open/unlink/remove/rename/replace/mkdir`, `io.open` and
HDF5 file opens (`h5py.File`), one operation per call. Printed per W: operations per idle
and per busy poll, early in the run and late (the targets: at most linear growth with W,
none with consumed steps), operations per consumed segment (polls + compaction), the
buffer's file count over time against the bound compaction promises, and audit seconds per
record. Ratios are against the smallest W.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rft_hpc.buffer import BufferReader, Experience, SegmentWriter
from rft_hpc.buffer.compact import Compactor
from rft_hpc.buffer.layout import ensure_buffer_dir
from rft_hpc.config import ExperimentConfig
from rft_hpc.config.buffer import CompactConfig
from rft_hpc.core.rundir import atomic_write_json
from rft_hpc.ledger.audit import audit_run
from rft_hpc.ledger.log import LedgerWriter, compact_refs
from rft_hpc.runtime.common import freeze_config

_OS_CALLS = ("stat", "lstat", "listdir", "scandir", "open", "unlink", "remove", "rename",
             "replace", "mkdir")


class MetadataCounter:
    """Counts path-level filesystem calls while `active` (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[MetadataCounter]:
        """Wrap the counted calls for the duration of the block."""
        saved: list[tuple[Any, str, Any]] = []

        def wrap(owner: Any, name: str, label: str) -> None:
            real = getattr(owner, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                if self.active:
                    self.counts[label] += 1
                return real(*args, **kwargs)

            saved.append((owner, name, real))
            setattr(owner, name, counted)

        for name in _OS_CALLS:
            wrap(os, name, name)
        wrap(io, "open", "open")
        counter = self
        real_file = h5py.File

        class CountedFile(real_file):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if counter.active:
                    counter.counts["open"] += 1
                super().__init__(*args, **kwargs)

        saved.append((h5py, "File", real_file))
        h5py.File = CountedFile
        try:
            yield self
        finally:
            for owner, name, real in reversed(saved):
                setattr(owner, name, real)

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int]:
        """Run `fn` counting; (its result, operations it made)."""
        before = sum(self.counts.values())
        self.active = True
        try:
            result = fn()
        finally:
            self.active = False
        return result, sum(self.counts.values()) - before


@dataclass
class Figures:
    """What one writer count measured."""

    writers: int
    steps: int
    records: int
    idle_poll_early: float = 0.0
    idle_poll_late: float = 0.0
    busy_poll_early: float = 0.0
    busy_poll_late: float = 0.0
    ops_per_consumed_segment: float = 0.0
    compaction_ops: int = 0
    files_over_time: list[int] = field(default_factory=list)
    files_max: int = 0
    files_bound: int = 0
    files_without_compaction: int = 0
    audit_seconds: float = 0.0
    audit_ok: bool = False
    seconds: float = 0.0


def _records(writer: int, step: int, n: int, rng: np.random.Generator) -> list[Experience]:
    return [Experience(rng.integers(0, 1000, 12, dtype=np.int32), 4, reward=float(i % 2),
                       task_id=f"e{writer}-s{step}-r{i}", group_id=step, policy_version=step,
                       step=step) for i in range(n)]


def _mean(xs: list[int]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def _file_count(buffer: Path) -> int:
    return sum(len(os.listdir(buffer / w)) for w in os.listdir(buffer)
               if (buffer / w).is_dir())


def run_one(root: Path, writers: int, args: argparse.Namespace,
            counter: MetadataCounter) -> Figures:
    """Simulate W writers and the trainer; return the figures."""
    t_start = time.monotonic()
    fig = Figures(writers, args.steps, writers * args.steps * args.records)
    cfg = ExperimentConfig.model_validate({
        "trainer": {"steps": args.steps, "batch_size": writers * args.records},
        "explorer": {"count": writers, "tasks_per_step": 1, "repeat": args.records},
        "buffer": {"compact": {"min_segments": args.min_segments, "fanout": args.fanout}}})
    freeze_config(cfg, root / "config.yaml")
    stage = root / "stages" / "0-main"
    freeze_config(cfg, stage / "config.yaml")
    buffer = ensure_buffer_dir(stage / "buffer")
    rng = np.random.default_rng(0)
    seg_writers = [SegmentWriter(buffer, f"explorer-{i}", "rl", durable=args.fsync)
                   for i in range(writers)]
    ledgers = [LedgerWriter(stage / "ledger", f"explorer-{i}", durable=False)
               for i in range(writers)]
    for lw in ledgers:
        lw.start(0, first_redone=0)
    trainer_ledger = LedgerWriter(stage / "ledger", "trainer", durable=False)
    trainer_ledger.start(0, first_redone=1)
    reader = BufferReader(buffer, cfg.buffer)
    compactor = Compactor(buffer, CompactConfig(min_segments=args.min_segments,
                                                fanout=args.fanout), durable=args.fsync)
    idle: list[int] = []
    busy: list[int] = []
    consumed_ops = 0
    samples = {max(1, round(args.steps * q)) for q in (0.25, 0.5, 0.75, 1.0)}
    for step in range(args.steps):
        for i, w in enumerate(seg_writers):
            w.write_step(step, _records(i, step, args.records, rng))
            ledgers[i].append("step", step=step, records=args.records, version=step,
                              seconds=0.0)
        _, ops = counter.measure(reader.poll)
        busy.append(ops)
        batch = reader.take(writers * args.records)
        assert len(batch) == writers * args.records, (len(batch), step)
        consumed_ops += ops
        _, ops = counter.measure(reader.poll)
        idle.append(ops)
        trainer_ledger.append("step", step=step + 1, consumed=compact_refs(batch.refs),
                              published=step + 1, dropped_stale=0, seconds=0.0)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            cursor = reader.state_dict()
            trainer_ledger.append("save", step=step + 1)
            _, ops = counter.measure(lambda c=cursor: compactor.run(c))
            fig.compaction_ops += ops
            consumed_ops += ops
        if step + 1 in samples:
            fig.files_over_time.append(_file_count(buffer))
        fig.files_max = max(fig.files_max, _file_count(buffer)) if step % 4 == 3 else \
            fig.files_max
    for i, lw in enumerate(ledgers):
        lw.append("stop", step=args.steps, reason="done")
        lw.close()
        seg_writers[i].close()
    trainer_ledger.append("stop", step=args.steps, reason="done")
    trainer_ledger.close()
    atomic_write_json(stage / "state" / "trainer.json",
                      {"role": "trainer", "status": "done", "step": args.steps})
    fig.files_max = max(fig.files_max, *fig.files_over_time)
    quarter = max(1, args.steps // 4)
    fig.idle_poll_early, fig.idle_poll_late = _mean(idle[1:quarter + 1]), _mean(idle[-quarter:])
    fig.busy_poll_early, fig.busy_poll_late = _mean(busy[1:quarter + 1]), _mean(busy[-quarter:])
    fig.ops_per_consumed_segment = consumed_ops / (writers * args.steps)
    tiers = 1 + max(0, int(math.log(max(1, args.steps / args.min_segments), args.fanout)))
    # Per writer: segments consumed since its last fold (< min_segments + save_every), one
    # not yet consumed, fewer than `fanout` archives per tier; plus the FORMAT file.
    fig.files_bound = writers * (args.min_segments + args.save_every + 1
                                 + (args.fanout - 1) * tiers) + 1
    fig.files_without_compaction = writers * args.steps + 1
    t0 = time.monotonic()
    report = audit_run(root)
    fig.audit_seconds = time.monotonic() - t0
    fig.audit_ok = report.ok
    fig.seconds = time.monotonic() - t_start
    return fig


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base else "-"


def print_table(figs: list[Figures], args: argparse.Namespace) -> bool:
    """The growth table, with each target's verdict; True when all are met."""
    b = figs[0]
    print(f"\nscale: {args.steps} steps per writer, {args.records} records per step, one-step "
          f"segments, compaction min_segments {args.min_segments} fanout {args.fanout}, "
          f"checkpoint every {args.save_every} steps, fsync {'on' if args.fsync else 'off'}")
    head = ("writers", "idle poll ops (early->late)", "busy poll ops (early->late)",
            "ops/consumed seg", "files over time (max | bound | w/o compaction)",
            "audit s (per 1k records)")
    print(" | ".join(head))
    for f in figs:
        print(" | ".join([
            f"{f.writers} ({_ratio(f.writers, b.writers)})",
            f"{f.idle_poll_early:.1f}->{f.idle_poll_late:.1f} "
            f"({_ratio(f.idle_poll_late, b.idle_poll_late)})",
            f"{f.busy_poll_early:.1f}->{f.busy_poll_late:.1f} "
            f"({_ratio(f.busy_poll_late, b.busy_poll_late)})",
            f"{f.ops_per_consumed_segment:.2f} "
            f"({_ratio(f.ops_per_consumed_segment, b.ops_per_consumed_segment)})",
            f"{'/'.join(map(str, f.files_over_time))} ({f.files_max} | {f.files_bound} | "
            f"{f.files_without_compaction})",
            f"{f.audit_seconds:.2f} ({1000 * f.audit_seconds / f.records:.3f}; "
            f"{_ratio(f.audit_seconds / f.records, b.audit_seconds / b.records)}) "
            f"{'PASS' if f.audit_ok else 'FAIL'}",
        ]))
    per_writer = [f.idle_poll_late / f.writers for f in figs]
    busy_per_writer = [f.busy_poll_late / f.writers for f in figs]
    targets = {
        "poll ops grow at most linearly with writers":
            max(per_writer) <= 1.05 * per_writer[0] and
            max(busy_per_writer) <= 1.05 * busy_per_writer[0],
        "poll ops do not grow with consumed steps":
            all(f.idle_poll_late <= f.idle_poll_early and f.busy_poll_late <= f.busy_poll_early
                for f in figs),
        "file count stays bounded with compaction":
            all(f.files_max <= f.files_bound for f in figs),
        "audit time linear in records (per-record time within 2x)":
            all(f.audit_seconds / f.records <= 2 * b.audit_seconds / b.records for f in figs)
            and all(f.audit_ok for f in figs),
    }
    for name, ok in targets.items():
        print(f"  {'MET    ' if ok else 'NOT MET'}  {name}")
    return all(targets.values())


def main(argv: list[str] | None = None) -> int:
    """Run the simulation for each writer count and print the growth table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writers", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=96, help="steps (segments) per writer")
    p.add_argument("--records", type=int, default=4, help="records per step")
    p.add_argument("--min-segments", type=int, default=16)
    p.add_argument("--fanout", type=int, default=4)
    p.add_argument("--save-every", type=int, default=8, help="trainer steps per checkpoint")
    p.add_argument("--fsync", action="store_true", help="fsync segments and archives")
    p.add_argument("--dir", type=Path, default=None, help="where to work (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the buffers written")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = p.parse_args(argv)
    if args.steps < 4 or any(w < 1 for w in args.writers):
        p.error("--steps must be >= 4 and every writer count >= 1")
    base = Path(tempfile.mkdtemp(prefix="rft-scale-", dir=args.dir))
    figs = []
    counter = MetadataCounter()
    try:
        with counter.installed():
            for w in sorted(args.writers):
                figs.append(run_one(base / f"w{w}", w, args, counter))
                print(f"{w} writers: {figs[-1].seconds:.1f} s", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    ok = print_table(figs, args)
    if args.json:
        print(json.dumps([asdict(f) for f in figs], indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
