"""The audit of a stage's reward jobs (docs/ledger.md, docs/reward-job.md): their ledgers
are well-formed, every buffer record scored by a reward job names a request that a reward
job's ledger says it scored (for that record's explorer, with that many calls), and no
scored call is in the buffer twice."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rft_hpc.ledger.buffer_scan import BufferScan
from rft_hpc.ledger.replay import read_events


@dataclass
class RewardAudit:
    """What the reward jobs of a stage did, and the problems found (per check)."""

    summary: dict[str, Any] = field(default_factory=dict)
    ledger_problems: list[str] = field(default_factory=list)
    record_problems: list[str] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        """Whether the stage had reward jobs, or records that say they were scored by one."""
        return bool(self.summary)


def audit_reward_jobs(ledger_dir: Path, scan: BufferScan) -> RewardAudit:
    """Check the reward ledgers of `ledger_dir` against the buffer's records (`scan` read
    with `infos`). Raises `LedgerError` for a ledger line that is no event."""
    audit = RewardAudit()
    scored: dict[str, tuple[int, int]] = {}  # request -> (explorer, calls)
    events = restarts = 0
    for path in sorted(ledger_dir.glob("reward-*.jsonl")):
        starts = 0
        for event in read_events(path):
            data = event.data
            if event.kind == "start":
                starts += 1
            if event.kind != "scored":
                continue
            events += 1
            request, explorer, calls = data["request"], data["explorer"], data["calls"]
            if not (isinstance(request, str) and isinstance(explorer, int)
                    and isinstance(calls, int) and calls >= 1
                    and request.startswith(f"explorer-{explorer}.")):
                audit.ledger_problems.append(
                    f"{path}:{event.line}: `scored` needs a request id of its explorer and "
                    "calls >= 1")
                continue
            before = scored.setdefault(request, (explorer, calls))
            if before != (explorer, calls):
                audit.ledger_problems.append(
                    f"{path}:{event.line}: request {request} scored before with "
                    f"{before[1]} calls, now {calls}")
        restarts += max(0, starts - 1)
    named: dict[str, str] = {}  # "<request>/<index>" -> the record that names it
    records = 0
    for writer in scan.writers():
        for start, seg in scan.writer_segments(writer):
            for index, text in enumerate(seg.infos or ()):
                if "reward_request" not in text:
                    continue
                place = str(json.loads(text)["reward_request"])
                records += 1
                where = f"{scan.segment_path(writer, start)} record {index}"
                _check_record(audit, place, where, writer, scored, named)
    if events or records:
        audit.summary = {"requests": len(scored), "scored_events": events,
                         "rescored": events - len(scored), "restarts": restarts,
                         "records": records}
    return audit


def _check_record(audit: RewardAudit, place: str, where: str, writer: str,
                  scored: dict[str, tuple[int, int]], named: dict[str, str]) -> None:
    problems = audit.record_problems
    request, _, index = place.rpartition("/")
    if place in named:
        problems.append(f"{where} and {named[place]} both hold call {place}: a scored "
                        "rollout is in the buffer twice")
        return
    named[place] = where
    if request not in scored:
        problems.append(f"{where} names reward request {request}, which no reward job's "
                        "ledger scored")
        return
    explorer, calls = scored[request]
    if writer != f"explorer-{explorer}":
        problems.append(f"{where} of {writer} names request {request} of explorer {explorer}")
    if not index.isdigit() or int(index) >= calls:
        problems.append(f"{where} names call {index} of request {request}, which had "
                        f"{calls} calls")

