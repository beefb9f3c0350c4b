"""Device check: NCCL on this machine's GPU(s), as the `nccl` weight sync uses it.

    python3 tools/device/nccl_check.py [--size-mb 256]

1. a 1-rank NCCL group on cuda:0: broadcast and all_reduce of CUDA tensors give the values
   sent (the collectives run on the GPU; with one rank nothing crosses a link), timed;
2. 2 ranks on the same GPU (two processes, both cuda:0): NCCL refuses that ("Duplicate GPU
   detected"), so a trainer and an explorer sharing one GPU cannot sync over NCCL; what
   happened is reported (refused / ran / hung), it does not decide the verdict;
3. with 2 or more GPUs, 2 ranks on cuda:0 and cuda:1 broadcast 1 MiB and must agree.

Prints `RESULT {json}`; {"skipped": ...} without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

PAIR_TIMEOUT_S = 45


def nccl_version() -> str:
    """The NCCL version torch was built with ("2.27.3")."""
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def one_rank(size_mb: int, init: str) -> dict:
    """Part 1 in this process."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    n = size_mb * 2**20 // 4
    x = torch.arange(n, device="cuda", dtype=torch.float32)
    dist.broadcast(x, src=0)
    y = torch.ones(1024, device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / 5
    values_ok = bool(torch.equal(x[:10].cpu(), torch.arange(10, dtype=torch.float32))
                     and float(y.sum()) == 1024.0 and x.is_cuda)
    dist.destroy_process_group()
    return {"one_rank_values_ok": values_ok, "one_rank_broadcast_mb": size_mb,
            "one_rank_broadcast_s": round(seconds, 5)}


def pair_rank(rank: int, init: str, device: int) -> None:
    """One rank of a 2-rank group on cuda:`device` (a child process)."""
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2,
                            device_id=torch.device("cuda", device))
    x = torch.full((2**18,), float(rank + 1), device="cuda")
    dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    print(f"PAIR {rank} {float(x[0])}", flush=True)
    dist.destroy_process_group()


def pair(devices: tuple[int, int], tmp: Path) -> dict:
    """Two child ranks on the given GPUs: 'ran' (both got rank 0's values), 'refused'
    (with NCCL's message) or 'hung'."""
    init = f"file://{tmp / f'pair-{devices[0]}-{devices[1]}'}"
    procs = [subprocess.Popen([sys.executable, __file__, "--pair-rank", str(r), init,
                               str(devices[r])], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs, hung = [], False
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            outs.append(p.communicate()[0])
    text = "\n".join(outs)
    if all(p.returncode == 0 for p in procs) and text.count("PAIR") == 2:
        got = [ln.split()[2] for ln in text.splitlines() if ln.startswith("PAIR")]
        return {"outcome": "ran", "values_equal": got == ["1.0", "1.0"]}
    lines = [ln for ln in text.splitlines()
             if "duplicate gpu" in ln.lower() or "error" in ln.lower()]
    return {"outcome": f"hung (killed after {PAIR_TIMEOUT_S} s)" if hung else "refused",
            "message": (lines or text.splitlines()[-3:] or [""])[-1][-300:]}


def main() -> int:
    """Run the parts; the verdict is part 1 (and part 3 where there are 2 GPUs)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--pair-rank", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pair_rank:
        rank, init, device = args.pair_rank
        pair_rank(int(rank), init, int(device))
        return 0
    if not torch.cuda.is_available():
        print("RESULT " + json.dumps({"skipped": "no CUDA GPU"}))
        return 0
    result: dict = {"gpus": torch.cuda.device_count(),
                    "nccl": nccl_version()}
    with tempfile.TemporaryDirectory() as tmp:
        result.update(one_rank(args.size_mb, f"file://{Path(tmp) / 'one'}"))
        result["two_ranks_one_gpu"] = pair((0, 0), Path(tmp))
        ok = result["one_rank_values_ok"]
        if result["gpus"] >= 2:
            result["two_ranks_two_gpus"] = pair((0, 1), Path(tmp))
            ok = ok and result["two_ranks_two_gpus"] == {"outcome": "ran", "values_equal": True}
    result["ok"] = ok
    print(f"nccl {result['nccl']}: 1 rank {'ok' if result['one_rank_values_ok'] else 'FAIL'}; "
          f"2 ranks on one GPU: {result['two_ranks_one_gpu']['outcome']}", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())
