"""The `mpi` weight-sync method (mpi4py + PyPI MPICH): one world, and connect/accept.

Every participant is a real MPI program (`tests/helpers/sync_workers.py`) started with mpiexec; it
writes what it sent or received as JSON lines. MPI is installed by `tools/install.sh --test`
(extra `mpi`): these tests never skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import HELPERS
from helpers.sync_workers import digests, state_for

WORKER = str(HELPERS / "sync_workers.py")
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def start(n: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, WORKER, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, ok: set[int] = frozenset({0})) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode in ok, out


def reports(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_world_versions_arrive_intact(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    finish(start(3, "world", str(out), "3", "0.25"))
    got = reports(out)
    for rank in (1, 2):
        mine = [g for g in got if g[0] == rank]
        assert [(g[1], g[2]) for g in mine] == [("got", 1), ("got", 2), ("got", 3)]
        for _, _, v, dig in mine:
            assert dig == digests(state_for(v))
    assert [g[1] for g in got if g[0] == "sent"] == [1, 2, 3]


def test_connect_accept_survives_a_killed_receiver(tmp_path: Path):
    out, folder = tmp_path / "out.jsonl", str(tmp_path / "sync")
    # v1 to both; receiver 1 dies inside v2; v3 to whoever is there; v4 once it is back.
    sender = start(1, "port-sender", str(out), folder, "2,1,1,2")
    survivor = start(1, "port-receiver", str(out), folder, "0", "4")
    doomed = start(1, "port-receiver", str(out), folder, "1", "4", "2")
    finish(doomed, ok={9, 137, -9})  # mpiexec reports the SIGKILL
    deadline = time.monotonic() + 120
    while not any(g[:2] == ["sent", 3] for g in reports(out)):
        assert time.monotonic() < deadline, reports(out)  # a failed v3 must fail, not hang
        time.sleep(0.1)
    restarted = start(1, "port-receiver", str(out), folder, "1", "4")
    for proc in (sender, survivor, restarted):
        finish(proc)
    got = reports(out)
    sent = [g for g in got if g[0] in ("sent", "failed")]
    assert sent[0] == ["sent", 1, ["0", "1"]]
    assert sent[1][:2] == ["failed", 2] and "1: " in sent[1][2] and "0: " not in sent[1][2]
    assert sent[2] == ["sent", 3, ["0"]]
    assert sent[3] == ["sent", 4, ["0", "1"]]
    assert [(g[1], g[2]) for g in got if g[0] == 0] == [("got", v) for v in (1, 2, 3, 4)]
    assert [(g[1], g[2]) for g in got if g[0] == 1] == [("got", 1), ("got", 4)]
    for g in got:
        if g[0] in (0, 1):
            assert g[3] == digests(state_for(g[2]))
