"""The audit of reward jobs finds what it promises: a call in the buffer twice, a request no
reward ledger scored, another explorer's request, a call index beyond its request; and a
request scored again after a restart is no problem."""

from __future__ import annotations

import json

from rft_hpc.ledger.buffer_scan import BufferScan, SegmentInfo
from rft_hpc.ledger.log import LedgerWriter
from rft_hpc.ledger.reward_audit import audit_reward_jobs


def test_reward_audit_names_doubled_unscored_foreign_and_out_of_range_calls(tmp_path):
    ledger = LedgerWriter(tmp_path / "ledger", "reward-0")
    for _ in range(2):  # the second process scores the first one's request again
        ledger.append("start", resume_step=0, first_redone=0)
        ledger.append("scored", request="explorer-0.a.000000", explorer=0, calls=2)
    ledger.append("scored", request="explorer-1.b.000000", explorer=1, calls=2)
    ledger.close()
    infos = [json.dumps({"reward_request": r}) for r in (
        "explorer-0.a.000000/0", "explorer-0.a.000000/1", "explorer-0.a.000000/1",
        "explorer-0.z.000000/0", "explorer-1.b.000000/0", "explorer-0.a.000000/2")]
    scan = BufferScan(tmp_path / "buffer", {("explorer-0", 0): SegmentInfo(
        1, len(infos) + 1, infos=[*infos, "{}"])})
    found = audit_reward_jobs(tmp_path / "ledger", scan)
    assert found.ledger_problems == []
    assert found.summary == {"requests": 2, "scored_events": 3, "rescored": 1, "restarts": 1,
                             "records": 6}
    problems = found.record_problems
    assert len(problems) == 4, problems
    assert "record 1 both hold call explorer-0.a.000000/1" in problems[0]
    assert "explorer-0.z.000000, which no reward job's ledger scored" in problems[1]
    assert "of explorer-0 names request explorer-1.b.000000 of explorer 1" in problems[2]
    assert "names call 2 of request explorer-0.a.000000, which had 2 calls" in problems[3]
