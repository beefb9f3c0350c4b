"""`rft-hpc audit`: check a run's invariants from its buffer and ledgers alone.

Per stage: the trainer's effective history is steps 1..N, each once; no buffer record was
consumed more often than `buffer.max_uses`; every consumed record exists in the buffer (or
was lost to quarantine, which is reported); FIFO consumption skipped no record; published
weight versions increase; each explorer's effective history is steps 0..M-1, each once, its
versions never go back within a process, and its committed segments match its ledger.
No trainer checkpoint is needed (docs/ledger.md, "Audit").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from rft_hpc.config import ExperimentConfig, load_config
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import RunDir, open_run_dir, read_json
from rft_hpc.ledger.buffer_scan import BufferScan, Ref, scan_buffer
from rft_hpc.ledger.replay import History, LedgerError, replay, sequence_problems
from rft_hpc.ledger.reward_audit import audit_reward_jobs

PASS, FAIL, INFO = "PASS", "FAIL", "-"
SHOWN = 5
"""Records or steps named in one problem's message before "..."."""


@dataclass
class Check:
    """One line of the verdict: what was checked, PASS/FAIL/- and the problems found."""

    name: str
    result: str
    detail: str
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "result": self.result, "detail": self.detail,
                "problems": self.problems}


def _check(name: str, detail: str, problems: list[str]) -> Check:
    return Check(name, FAIL if problems else PASS, detail, problems)


@dataclass
class StageAudit:
    """The audit of one stage directory."""

    name: str
    path: Path
    checks: list[Check] = field(default_factory=list)
    trainer: dict[str, Any] | None = None
    explorers: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, Any] = field(default_factory=dict)
    reward_jobs: dict[str, Any] | None = None
    """What the reward jobs did (docs/reward-job.md); None without reward jobs."""

    @property
    def problems(self) -> int:
        return sum(len(c.problems) for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.name, "path": str(self.path), "ok": self.problems == 0,
                "problems": self.problems, "checks": [c.to_json() for c in self.checks],
                "trainer": self.trainer, "explorers": self.explorers, "records": self.records,
                "reward_jobs": self.reward_jobs,
                "unconsumed": self.records.get("unconsumed")}


@dataclass
class AuditReport:
    """The audit of a run: one `StageAudit` per stage, in stage order."""

    path: Path
    stages: list[StageAudit]

    @property
    def problems(self) -> int:
        return sum(s.problems for s in self.stages)

    @property
    def ok(self) -> bool:
        return self.problems == 0

    def to_json(self) -> dict[str, Any]:
        return {"run": str(self.path), "ok": self.ok, "problems": self.problems,
                "stages": [s.to_json() for s in self.stages]}


def audit_run(path: Path) -> AuditReport:
    """Audit every stage of the run directory `path` (or the single stage directory `path`).

    Raises `UserError` when `path` is no run or stage directory, and `LedgerError` (a
    `UserError`) naming the file and line of a ledger that cannot be read.
    """
    root = open_run_dir(path).root
    stages_dir = RunDir(root).stages
    if stages_dir.is_dir():
        stages = sorted((d for d in stages_dir.iterdir() if (d / "config.yaml").is_file()),
                        key=_stage_order)
    elif RunDir(root).ledger.is_dir() or RunDir(root).buffer.is_dir():
        stages = [root]
    else:
        raise UserError(f"{path} has no stages (stages/<i>-<name>/) and is not a stage "
                        "directory (no buffer/ or ledger/)")
    if not stages:
        raise UserError(f"{stages_dir} holds no stage directory")
    return AuditReport(root, [audit_stage(stage) for stage in stages])


def _stage_order(stage: Path) -> tuple[int, str]:
    head = stage.name.split("-", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, stage.name)


def _load_config(stage: Path) -> ExperimentConfig:
    # The audit needs the buffer and trainer settings only: a model folder purged from
    # scratch since the run must not stop it.
    return load_config(RunDir(stage).config, overrides=["model.path=null"])


def audit_stage(stage: Path) -> StageAudit:
    """Audit one stage directory (`config.yaml`, `buffer/`, `ledger/`, `state/`)."""
    config = _load_config(stage)
    rewarded = any(RunDir(stage).ledger.glob("reward-*.jsonl"))
    scan = scan_buffer(RunDir(stage).buffer, infos=rewarded or config.reward_job.count > 0)
    audit = StageAudit(stage.name, stage)
    state_path = RunDir(stage).heartbeat("trainer")
    state = read_json(state_path) if state_path.is_file() else None
    ledger = RunDir(stage).ledger_file("trainer")
    if ledger.is_file():
        _audit_trainer(audit, replay(ledger, trainer=True), config, scan, state)
    elif state is not None:
        audit.checks.append(_check("trainer ledger", "missing", [
            f"the trainer ran (state/trainer.json) but {ledger} does not exist"]))
    else:
        audit.checks.append(Check("trainer ledger", INFO, "no trainer in this stage yet"))
    _audit_explorers(audit, stage, scan)
    _audit_reward_jobs(audit, stage, scan)
    return audit


def _audit_reward_jobs(audit: StageAudit, stage: Path, scan: BufferScan) -> None:
    found = audit_reward_jobs(RunDir(stage).ledger, scan)
    if not found.ran:
        return
    audit.reward_jobs = s = found.summary
    audit.checks.append(_check(
        "reward ledgers", f"{_n(s['requests'], 'request')} scored ({s['rescored']} again "
        f"after a restart); {_n(s['restarts'], 'restart')}", found.ledger_problems))
    audit.checks.append(_check(
        "reward requests", f"{_n(s['records'], 'record')} scored by a reward job, each in "
        "a request its ledger scored, each call once", found.record_problems))


def _audit_trainer(audit: StageAudit, history: History, config: ExperimentConfig,
                   scan: BufferScan, state: dict[str, Any] | None) -> None:
    tcfg, bcfg = config.trainer, config.buffer
    status = (state or {}).get("status", "unknown")
    audit.trainer = {**history.summary(), "status": status, "finished": status == "done"}
    detail = (f"{len(history.steps)} of {tcfg.steps} steps, trainer {status}; "
              f"{_restarts(history)}")
    audit.checks.append(_check("trainer steps", detail, sequence_problems(history, 1)))

    uses: dict[Ref, list[int]] = {}
    dropped = 0
    for entry in history.steps:
        dropped += int(entry.data.get("dropped_stale") or 0)
        for ref in _consumed(history, entry.line, entry.data.get("consumed") or []):
            uses.setdefault(ref, []).append(entry.step)
    over = [f"{_name(ref)} consumed {len(steps)} times (max_uses {bcfg.max_uses}): steps "
            f"{_few(steps)}" for ref, steps in sorted(uses.items())
            if len(steps) > bcfg.max_uses]
    total = sum(len(s) for s in uses.values())
    audit.checks.append(_check(
        "consumed at most max_uses",
        f"{len(uses)} records consumed {total} times, max_uses {bcfg.max_uses}; "
        f"{dropped} dropped as stale", over))

    lost, problems = _missing_records(uses, scan)
    detail = (f"all {len(uses)} in the buffer" if not lost else
              f"{len(uses) - len(lost)} in the buffer, {len(lost)} lost to quarantined or "
              f"unreadable segments: {_few(sorted(map(_name, lost)))}")
    audit.checks.append(_check("consumed records exist", detail, problems))

    fifo_exact = (bcfg.sampler.type == "fifo" and bcfg.max_uses == 1
                  and not (bcfg.max_staleness is not None and bcfg.stale == "drop"))
    unconsumed, skipped = _unconsumed(scan, set(uses), fifo=fifo_exact)
    in_buffer = scan.readable_records()
    needed = tcfg.steps * tcfg.batch_size
    audit.records = {"in_buffer": in_buffer, "consumed": len(uses), "unconsumed": unconsumed,
                     "lost": len(lost), "needed": needed}
    detail = (f"{unconsumed} of {in_buffer} records never consumed (the trainer's "
              f"{tcfg.steps} x {tcfg.batch_size} steps take {needed}); trainer {status}")
    by_segment: dict[tuple[str, int], list[int]] = {}
    for writer, start, index in skipped:
        by_segment.setdefault((writer, start), []).append(index)
    problems = [f"{scan.segment_path(w, s)} records {_few(idx)} skipped: later records of {w} "
                "were consumed (fifo)" for (w, s), idx in by_segment.items()]
    audit.checks.append(_check("unconsumed records", detail, problems))

    published = [(e.step, int(e.data["published"])) for e in history.steps
                 if e.data.get("published") is not None]
    problems = [f"version {v} published at step {s} after version {pv} at step {ps}"
                for (ps, pv), (s, v) in pairwise(published) if v <= pv]
    detail = (f"{len(published)} versions published, the last v{published[-1][1]}" if published
              else "no version published")
    audit.checks.append(_check("published versions increase", detail, problems))


def _consumed(history: History, line: int, consumed: object) -> list[Ref]:
    """The records of a step's `consumed` field, which must be [[writer, segment, [i...]]...]."""
    refs = []
    try:
        for writer, segment, indices in consumed:
            if not isinstance(writer, str):
                raise TypeError
            refs += [(writer, int(segment), int(i)) for i in indices]
    except (TypeError, ValueError):
        raise LedgerError(f"{history.path}:{line}: `consumed` is not "
                          "[[writer, segment, [index, ...]], ...]") from None
    return refs


def _missing_records(uses: dict[Ref, list[int]], scan: BufferScan) -> tuple[list[Ref], list[str]]:
    """(records lost to quarantine or damage, problems: consumed records that never existed).

    A missing segment is one problem naming its consumed records; an index beyond its
    segment's records is one problem per record."""
    lost: list[Ref] = []
    absent: dict[tuple[str, int], list[Ref]] = {}
    problems = []
    for ref in sorted(uses):
        writer, start, index = ref
        seg = scan.segments.get((writer, start))
        if seg is None:
            if (writer, start) in scan.quarantined:
                lost.append(ref)
            else:
                absent.setdefault((writer, start), []).append(ref)
        elif seg.error is not None:
            lost.append(ref)
        elif not 0 <= index < seg.num_records:
            problems.append(f"{_name(ref)} consumed at step {_few(uses[ref])} does not exist: "
                            f"the segment holds {seg.num_records} records")
    for (writer, start), refs in absent.items():
        steps = sorted({s for ref in refs for s in uses[ref]})
        problems.append(f"{len(refs)} consumed records ({_few([_name(r) for r in refs])}) "
                        f"at steps {_few(steps)} are not in the buffer: no segment "
                        f"{scan.segment_path(writer, start)}")
    return lost, problems


def _unconsumed(scan: BufferScan, consumed: set[Ref], *, fifo: bool) -> tuple[int, list[Ref]]:
    """(records of readable segments never consumed, those a FIFO reader skipped: followed
    by a consumed record of the same writer)."""
    count = 0
    skipped: list[Ref] = []
    for writer in scan.writers():
        behind: list[Ref] = []
        for start, seg in scan.writer_segments(writer):
            if seg.error is not None:
                continue
            for index in range(seg.num_records):
                ref = (writer, start, index)
                if ref in consumed:
                    skipped += behind
                    behind = []
                else:
                    count += 1
                    if fifo:
                        behind.append(ref)
    return count, skipped


def _audit_explorers(audit: StageAudit, stage: Path, scan: BufferScan) -> None:
    ledgers = {p.stem: p for p in RunDir(stage).ledger.glob("explorer-*.jsonl")}
    names = sorted(set(ledgers) | {w for w in scan.writers() if w.startswith("explorer-")},
                   key=_stage_order_name)
    if not names:
        return
    sequence: list[str] = []
    versions: list[str] = []
    segments: list[str] = []
    counts = Counter[str]()
    for name in names:
        if name not in ledgers:
            segments.append(f"{name} committed segments but has no ledger/{name}.jsonl")
            continue
        history = replay(ledgers[name], trainer=False)
        audit.explorers[name] = history.summary()
        sequence += sequence_problems(history, 0)
        counts["steps"] += len(history.steps)
        counts["restarts"] += len(history.restarts)
        counts["redone"] += history.redone_steps
        _explorer_versions(history, versions)
        counts["uncommitted"] += _explorer_segments(name, history, scan, versions, segments)
        counts["segments"] += len(scan.writer_segments(name))
    lost = sum(sum(e["seconds_lost"]) for e in audit.explorers.values())
    audit.checks.append(_check(
        "explorer steps",
        f"{_n(len(names), 'explorer')}, {_n(counts['steps'], 'step')}; "
        f"{_n(counts['restarts'], 'restart')}, {counts['redone']} redone, {lost:.1f} s lost",
        sequence))
    audit.checks.append(_check(
        "explorer versions", "within a process never lower; the buffer's equal the ledgers'",
        versions))
    audit.checks.append(_check(
        "explorer segments",
        f"{_n(counts['segments'], 'segment')} against the ledgers; "
        f"{counts['uncommitted']} ledger steps not (yet) committed", segments))


def _stage_order_name(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, name)


def _explorer_versions(history: History, problems: list[str]) -> None:
    last: dict[int, tuple[int, int]] = {}  # life -> (step, version) of its latest step
    for entry in history.steps:
        version = entry.data.get("version")
        if version is None:
            continue
        before = last.get(entry.life)
        if before is not None and int(version) < before[1]:
            problems.append(f"{history.role} step {entry.step} sampled with version {version} "
                            f"after version {before[1]} at step {before[0]} (same process)")
        last[entry.life] = (entry.step, int(version))


def _explorer_segments(name: str, history: History, scan: BufferScan, versions: list[str],
                       problems: list[str]) -> int:
    """Check `name`'s committed segments against its ledger; return how many ledger steps
    are not (yet) in a committed segment."""
    ledger = {e.step: e.data for e in history.steps}
    committed: set[int] = set()
    for start, seg in scan.writer_segments(name):
        steps = range(start, seg.step_end)
        committed.update(steps)
        absent = [s for s in steps if s not in ledger]
        if absent:
            problems.append(f"{name} steps {_few(absent)} are in the committed segment "
                            f"{scan.segment_path(name, start)} but not in the ledger")
        if seg.error is not None or seg.steps is None:
            continue
        step_counts = Counter(seg.steps.tolist())
        for step, n in sorted(step_counts.items()):
            if step not in steps:
                problems.append(f"{scan.segment_path(name, start)} holds records of step {step}"
                                f", outside its steps {start}..{seg.step_end - 1}")
                continue
            written = ledger.get(step, {}).get("records")
            if written is not None and int(written) != n:
                problems.append(f"{name} step {step}: the ledger says {written} records, "
                                f"the buffer holds {n}")
        if seg.versions is None:
            continue
        for step in sorted(step_counts):
            entry = ledger.get(step, {})
            said = entry.get("version")
            if said is None:
                continue
            found = sorted(set(seg.versions[seg.steps == step].tolist()))
            last = int(entry.get("last_version", said))  # a streamed step may span versions
            if found[0] != int(said) or found[-1] > last:
                span = f"{said}" if last == int(said) else f"{said}..{last}"
                versions.append(f"{name} step {step}: buffer records have policy_version "
                                f"{', '.join(map(str, found))}, the ledger says {span}")
    return len(set(ledger) - committed)


def _restarts(history: History) -> str:
    if not history.restarts:
        return "no restart"
    lost = ", ".join(f"{r.seconds_lost:.1f}" for r in history.restarts)
    return (f"{_n(len(history.restarts), 'restart')} "
            f"({', '.join(r.cause for r in history.restarts)}), {history.redone_steps} steps "
            f"redone, seconds lost: {lost}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _name(ref: Ref) -> str:
    return f"{ref[0]}/{ref[1]}/{ref[2]}"


def _few(items: list[Any]) -> str:
    shown = ", ".join(map(str, items[:SHOWN]))
    return shown + (f", ... ({len(items)} in all)" if len(items) > SHOWN else "")

