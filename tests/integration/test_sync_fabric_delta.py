"""Delta versions over the fabric (`sync.full_every` with nccl/gloo and mpi): real ranks, a
sequence of AdamW steps, a receiver whose held base is spoiled; and the protocol check."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import HELPERS
from helpers.sync_workers import adamw_states, delta_receiver, sha, state_for

from rft_hpc.sync.collective import CollectiveSender
from rft_hpc.sync.fabric import PROTOCOL_VERSION, Layout, SyncFailed

CTX = multiprocessing.get_context("forkserver")
N, K = 6, 3  # versions, sync.full_every
# Receiver 1 flips a bit of its copy after v2 and forgets it after v4: v3 and v5 cannot be
# applied there, so they follow whole (to both); the others go as deltas but every K-th.
FORMS = ["whole", "delta", "delta+whole", "whole", "delta+whole", "delta"]


def tensor(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape)


def test_gloo_delta_versions_are_bit_identical_and_spoiled_bases_get_them_whole(
        tmp_path: Path):
    states = adamw_states(N)
    q = CTX.Queue()
    procs = [CTX.Process(target=delta_receiver, args=(str(tmp_path), 0, N, q)),
             CTX.Process(target=delta_receiver,
                         args=(str(tmp_path), 1, N, q, {2: "flip", 4: "forget"}))]
    for p in procs:
        p.start()
    sender = CollectiveSender(tmp_path, 2, timeout=20, join_timeout=60, bucket_mb=0.25,
                              full_every=K)
    forms, wire = [], []
    for v, state in enumerate(states, start=1):
        assert sender.send(state, v) == [0, 1]
        forms.append(sender.last_form)
        wire.append(sender.wire_bytes)
    got = [q.get(timeout=60) for _ in range(2 * N)]
    sender.close()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert forms == FORMS
    whole = Layout.of(states[0], 1).total_bytes
    assert wire[0] == whole and wire[1] < whole / 2  # AdamW steps compress
    for rid in (0, 1):
        mine = [g for g in got if g[0] == rid]
        assert [g[1] for g in mine] == list(range(1, N + 1))
        for _, v, received in mine:
            expected = states[v - 1]
            assert list(received) == list(expected)
            for name, t in expected.items():
                r = tensor(*received[name])
                assert r.dtype == t.dtype and torch.equal(r, t), (rid, v, name)


def test_a_layout_of_another_protocol_is_refused_clearly():
    layout = json.loads(Layout.of(state_for(1), 1024).to_json())
    assert layout["protocol"] == PROTOCOL_VERSION
    Layout.from_json(json.dumps(layout).encode())
    for other in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1):
        layout["protocol"] = other
        with pytest.raises(SyncFailed, match=f"protocol {other}, this rft-hpc "
                                             f"{PROTOCOL_VERSION}: run the same rft-hpc"):
            Layout.from_json(json.dumps(layout).encode())


def test_mpi_world_delta_versions_and_an_old_sender_refused(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, str(HELPERS / "sync_workers.py"),
                           "world-delta", str(out), str(N), str(K)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g[2] for g in got if g[0] == "sent"] == FORMS
    expected = [sha(s) for s in adamw_states(N)]
    for rank in (1, 2):
        mine = [g for g in got if g[0] == rank]
        assert [g[1] for g in mine[:N]] == list(range(1, N + 1))
        for _, v, digest in mine[:N]:
            assert digest == expected[v - 1], (rank, v)
        assert mine[N][1] == "refused" and "protocol 1, this rft-hpc" in mine[N][2]
