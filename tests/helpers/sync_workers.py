"""Processes of the fabric weight-sync tests: state dicts, digests, receiver loops.

Used in-process by the tests and as a program (`python tests/helpers/sync_workers.py ...`) for the
MPI tests, whose ranks are started by mpiexec.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

from rft_hpc.sync.fabric import SyncFailed

BIG_VERSIONS = {2}  # 40 MB: long enough to kill a receiver in the middle


PORT_TIMEOUT = 15.0
"""Seconds a port-sender or port-receiver version may take."""

def state_for(version: int) -> dict[str, torch.Tensor]:
    """A state dict of mixed dtypes and sizes, different for every version."""
    g = torch.Generator().manual_seed(version)
    rows = 20_000 if version in BIG_VERSIONS else 300
    return {
        "embed.weight": torch.randn(rows, 1000, generator=g).to(torch.bfloat16),  # > 1 bucket
        "layer.0.weight": torch.randn(64, 64, generator=g),
        "layer.0.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "layer.1.weight": torch.randn(96, 64, generator=g).t(),  # non-contiguous
        "norm.weight": torch.randn(64, generator=g).half(),
        "steps": torch.arange(version, version + 5, dtype=torch.int64),
        "flag": torch.tensor(version % 2 == 0),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(float(version)),
    }


def digests(state: dict[str, torch.Tensor]) -> dict[str, list]:
    """Name -> [dtype, shape, CRC-32 of the bytes]: what a receiver reports back."""
    out = {}
    for name, t in state.items():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = [str(t.dtype), list(t.shape), zlib.crc32(memoryview(data))]
    return out


def adamw_states(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` versions of `state_for(1)`'s model, each one AdamW step (lr 1e-3, random
    gradients) after the one before: float tensors from float32 master weights, rounded to
    their dtype; the int64 one counts up; the others stay. Deterministic."""
    first = state_for(1)
    params = {n: t.float().clone().requires_grad_() for n, t in first.items()
              if t.is_floating_point() and t.numel()}
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    states = []
    for v in range(count):
        states.append({n: params[n].detach().to(t.dtype, copy=True) if n in params else
                       t + v if t.dtype == torch.int64 else t.clone()
                       for n, t in first.items()})
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return states


def raw(state: dict[str, torch.Tensor]) -> dict[str, list]:
    """Name -> [dtype, shape, raw bytes]: a received state as it can cross a queue."""
    return {n: [str(t.dtype), list(t.shape), t.detach().contiguous().reshape(-1)
                .view(torch.uint8).numpy().tobytes()] for n, t in state.items()}


def sha(state: dict[str, torch.Tensor]) -> dict[str, list]:
    """Name -> [dtype, shape, SHA-256 of the raw bytes]: equal exactly when bit-identical."""
    return {n: [d, s, hashlib.sha256(b).hexdigest()] for n, (d, s, b) in raw(state).items()}


def spoil(receiver, how: str) -> None:
    """Make a receiver's held copy useless as a delta base: `flip` one bit of a tensor (the
    version number stays: only the checksums tell), or `forget` it (a restarted receiver)."""
    if how == "flip":
        data = receiver.held.tensors[0].reshape(-1).view(torch.uint8)
        data[7] ^= 1
    else:
        receiver.held.drop()


def delta_receiver(folder: str, rid: int, last: int, queue,
                   spoils: dict[int, str] | None = None) -> None:
    """A gloo receiver that reports each version's raw bytes, and spoils its held copy
    after the versions in `spoils` (see `spoil`)."""
    from rft_hpc.sync.collective import CollectiveReceiver

    r = CollectiveReceiver(folder, rid, backend="gloo", timeout=10, poll=0.01)
    while True:
        got = r.receive(wait=60)
        assert got is not None
        version, state = got
        queue.put([rid, version, raw(state)])
        r.give_back(state)
        if spoils and version in spoils:
            spoil(r, spoils[version])
        if version >= last:
            break
    r.close()


def receive_loop(receiver, last: int, report, wait: float = 60.0) -> None:
    """Receive until version `last` arrives; report each outcome as a JSON-able tuple."""
    while True:
        try:
            got = receiver.receive(wait=wait)
        except SyncFailed as e:
            report(["failed", e.version, str(e)])
            continue
        if got is None:
            report(["idle", None, ""])
            return
        version, state = got
        report(["got", version, digests(state)])
        if version >= last:
            return


def collective_receiver(folder: str, rid: int, last: int, queue, die_on: int | None = None,
                        timeout: float = 10.0) -> None:
    """A gloo receiver process; with `die_on`, SIGKILLs itself while receiving that seq."""
    from rft_hpc.sync.collective import CollectiveReceiver

    r = CollectiveReceiver(folder, rid, backend="gloo", timeout=timeout, poll=0.01)
    if die_on is not None:
        def killer() -> None:
            while True:
                group = r._group
                if group is not None and group.pg is not None and \
                        group.store.check([f"announce/{die_on}"]):
                    time.sleep(0.02)  # the broadcast is under way
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.005)
        threading.Thread(target=killer, daemon=True).start()
    receive_loop(r, last, lambda item: queue.put([rid, *item]))
    r.close()


def reusing_receiver(folder: str, queue) -> None:
    """Receives three versions over gloo, giving the first back and keeping the second;
    reports each one's digests and the address of its first tensor, then the second's
    digests once the third is in."""
    from rft_hpc.sync.collective import CollectiveReceiver

    r = CollectiveReceiver(folder, 0, backend="gloo", timeout=10, poll=0.01)
    kept: tuple[int, dict] | None = None
    for i in range(3):
        got = r.receive(wait=60)
        assert got is not None
        version, state = got
        queue.put(["got", version, digests(state), next(iter(state.values())).data_ptr()])
        if i == 0:
            r.give_back(state)
        elif i == 1:
            kept = got
    assert kept is not None
    queue.put(["kept", kept[0], digests(kept[1]), 0])
    r.close()


def _mpi_main(argv: list[str]) -> int:
    """`sync_workers.py <mode> <out.jsonl> [args]`: an MPI participant writing JSON lines."""
    import numpy as np
    from mpi4py import MPI

    from rft_hpc.sync import mpi as msync
    from rft_hpc.sync import mpi_port as mport

    mode, out = argv[0], Path(argv[1])

    def report(item: list) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(item) + "\n")

    if mode == "world":  # rank 0 sends versions 1..n, the others receive
        n, bucket_mb = int(argv[2]), float(argv[3])
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            s = msync.MpiSender(comm, timeout=20, bucket_mb=bucket_mb, checksum=True)
            for v in range(1, n + 1):
                s.send(state_for(v), v)
                report(["sent", v, digests(state_for(v))])
            s.close()
        else:
            r = msync.MpiReceiver(comm, timeout=20)
            receive_loop(r, n, lambda item: report([comm.rank, *item]))
        return 0
    if mode == "world-delta":  # `adamw_states(n)` with full_every k; rank 2 spoils its copy
        n, k = int(argv[2]), int(argv[3])  # after v2 (flip) and v4 (forget); then a v1 head
        comm, states = MPI.COMM_WORLD, adamw_states(n)
        if comm.rank == 0:
            s = msync.MpiSender(comm, timeout=20, bucket_mb=0.25, full_every=k)
            for v, state in enumerate(states, start=1):
                s.send(state, v)
                report(["sent", v, s.last_form])
            old = np.array([msync._MAGIC_V1, 1, n + 1, 0, 0, -1], np.int64)  # protocol 1
            comm.Ibcast(old, root=0).Wait()  # (a blocking Bcast never matches an Ibcast)
        else:
            r = msync.MpiReceiver(comm, timeout=20)
            for _ in range(n):
                got = r.receive(wait=60)
                assert got is not None
                report([comm.rank, got[0], sha(got[1])])
                r.give_back(got[1])
                if comm.rank == 2 and got[0] in (2, 4):
                    spoil(r, "flip" if got[0] == 2 else "forget")
            try:
                r.receive(wait=60)
            except SyncFailed as e:
                report([comm.rank, "refused", str(e)])
        return 0
    folder = argv[2]
    if mode == "port-sender":  # versions 1..n; before version v, wait for need[v-1] links
        need = [int(x) for x in argv[3].split(",")]
        # 15 s: long enough for a live receiver on a loaded CI machine (at 5 s, a survivor
        # once missed v3 late in the suite), short enough to give up on the killed one
        s = mport.MpiPortSender(folder, timeout=PORT_TIMEOUT, bucket_mb=0.25, checksum=True)
        for v, n in enumerate(need, start=1):
            s.wait_for_receivers(n, 60)
            try:
                report(["sent", v, sorted(s.send(state_for(v), v))])
            except SyncFailed as e:
                report(["failed", v, str(e)])
        s.close()
    elif mode == "port-receiver":  # receive up to version `last`; die while receiving `die`
        rid, last = int(argv[3]), int(argv[4])
        r = mport.MpiPortReceiver(folder, rid, timeout=PORT_TIMEOUT)
        if len(argv) > 5:
            die_on = int(argv[5])

            def killer() -> None:
                while True:
                    inner = r._inner
                    if inner is not None and inner._head[2] == die_on:
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(0.001)
            threading.Thread(target=killer, daemon=True).start()
        receive_loop(r, last, lambda item: report([rid, *item]))
        r.close()
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_main(sys.argv[1:]))
