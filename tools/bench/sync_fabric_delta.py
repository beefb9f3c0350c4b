"""Fabric delta rows of tools/bench/sync.py (`--fabric-delta`): delta versions over gloo.

For the demo's tiny model, in bfloat16 and in float32 (`model.dtype`), a `Trainer` (AdamW,
lr 1e-5, GRPO on a fixed batch of 4 rollouts) takes `steps` steps; the state dict after each
is one version. The versions are sent by `CollectiveSender` over gloo to one receiver process
twice: whole (`full_every` 1), then with `full_every` = `steps` (all but the first as
deltas). Per version it measures the bytes broadcast (`wire_bytes`) and the sender's seconds
(until the receiver agreed); each figure is the median over versions 2..steps, each ratio
the median of the versions' own ratios (delta / whole). Every received version is checked
bit-identical (SHA-256 of each tensor's bytes) to the sent one.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the repository's rft_hpc, also in the spawned receiver (which does not run __main__)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _sha(state: dict) -> list[str]:
    """SHA-256 of each tensor's raw bytes, in order."""
    import torch

    return [hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest() for t in state.values()]


def _receive(folder: str, count: int, queue) -> None:
    from rft_hpc.sync.collective import CollectiveReceiver

    r = CollectiveReceiver(folder, 0, backend="gloo", timeout=600)
    for _ in range(count):
        got = r.receive(wait=600)
        assert got is not None
        queue.put([got[0], _sha(got[1])])
        r.give_back(got[1])
    r.close()


def _worker(model: Path, dtype: str, steps: int, folder: Path) -> dict:
    """One (model, dtype) row, in a process of its own."""
    from sync_delta import trained_versions

    from rft_hpc.sync.collective import CollectiveSender

    parameters, versions = trained_versions(model, dtype, folder)
    states = [next(versions) for _ in range(steps)]
    ctx = multiprocessing.get_context("spawn")
    figures = {}
    for form, k in (("whole", 1), ("delta", steps)):
        sync, q = folder / f"sync-{form}", ctx.Queue()
        proc = ctx.Process(target=_receive, args=(str(sync), steps, q))
        proc.start()
        sender = CollectiveSender(sync, 1, timeout=600, join_timeout=600, full_every=k)
        wire, seconds = [], []
        for version, state in enumerate(states, start=1):
            t0 = time.perf_counter()
            sender.send(state, version)
            seconds.append(time.perf_counter() - t0)
            wire.append(sender.wire_bytes)
        for version, state in enumerate(states, start=1):
            got = q.get(timeout=600)
            if got != [version, _sha(state)]:
                raise SystemExit(f"{form} v{version}: received weights differ from sent")
        sender.close()
        proc.join(60)
        figures[form] = (wire[1:], seconds[1:])
    (wb, ws), (db, ds) = figures["whole"], figures["delta"]
    return {"parameters": parameters,
            "whole_bytes": statistics.median(wb), "delta_bytes": statistics.median(db),
            "bytes_ratio": statistics.median(d / w for d, w in zip(db, wb, strict=True)),
            "whole_s": statistics.median(ws), "delta_s": statistics.median(ds),
            "seconds_ratio": statistics.median(d / w for d, w in zip(ds, ws, strict=True))}


def run(steps: int) -> list[dict]:
    """Build the demo model, bench each dtype in its own process, print the rows."""
    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="rft-bench-sync-fabric-delta-"))
    results = []
    try:
        model = init_tiny_model(folder / "model-demo", TinyModelSpec())
        for dtype in ("bfloat16", "float32"):
            work = folder / dtype
            work.mkdir()
            out = subprocess.run([sys.executable, __file__, str(model), dtype, str(steps),
                                  str(work)], text=True, capture_output=True, check=False)
            if out.returncode:
                sys.exit(f"fabric delta bench {dtype} failed:\n{out.stderr[-3000:]}")
            results.append({"dtype": dtype, **json.loads(out.stdout.strip().splitlines()[-1])})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nfabric delta versions over gloo, 1 receiver (demo model, AdamW lr 1e-5, median "
          f"of versions 2..{steps}; ratios delta/whole)")
    print(f"{'params':>7} {'dtype':>9} {'wire MB whole':>13} {'delta':>7} {'ratio':>6} "
          f"{'send s whole':>12} {'delta':>7} {'ratio':>6}")
    for r in results:
        print(f"{r['parameters'] / 1e6:>6.1f}M {r['dtype']:>9} {r['whole_bytes'] / 1e6:>13.3f} "
              f"{r['delta_bytes'] / 1e6:>7.3f} {r['bytes_ratio']:>6.3f} {r['whole_s']:>12.4f} "
              f"{r['delta_s']:>7.4f} {r['seconds_ratio']:>6.2f}")
    return results


if __name__ == "__main__":
    model_arg, dtype_arg, steps_arg, folder_arg = sys.argv[1:5]
    print(json.dumps(_worker(Path(model_arg), dtype_arg, int(steps_arg), Path(folder_arg))))
