"""Device check of the torch trainer in bf16 (trainer.backend: torch, trainer.dtype: bfloat16).

    python3 tools/device/trainer_check.py [--steps 4] [--tolerance 5e-2]
    python3 tools/device/trainer_check.py --role-device

Self-contained: builds the tiny Llama locally (rft_hpc.models.tiny; no hub access) and runs
`Trainer.step` of the real trainer (GRPO, one rollout group of the fixed sequences, rewards
0/1) on the GPU (on CPUs with no GPU), its weights float32 and its forward under bf16
autocast. It checks that every step's loss and gradient norm are finite, that the weights
stay finite, on the device, and all change, and that the first step's loss and gradient norm
are those of a float32 trainer on the same batch within the (relative) tolerance, and not
bit-equal to them (then bf16 autocast would not have been in force). It also takes one bf16
step on a group whose rows share their prompt with `trainer.share_prompts` on (the packed
sequence's 4D mask under sdpa on the GPU) and off: the losses and gradient norms must agree
within the tolerance.

`--role-device` checks instead which device the trainer role picks in one process
(`init_distributed()` with no launch variables): with a GPU present it should be that GPU.

Prints `RESULT {json}` with the figures (seconds per step, peak GPU memory, differences).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [f"{10 + i}+{20 + 3 * i}={30 + 4 * i}" for i in range(8)]
SHARED = [f"12+34={40 + i}" for i in range(8)]
"""A group whose rows share their prompt (`12+34=`: the first 6 tokens)."""


def fixed_batch(model_dir: Path, prompts: list[str] = PROMPTS, prompt_length: int = 4):
    """One GRPO group: the fixed sequences, rewards 0/1, rollout log-probs -2."""
    import numpy as np
    from transformers import AutoTokenizer

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import Experience

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    records = [Experience(tok(p)["input_ids"], prompt_length=prompt_length,
                          reward=float(i % 2),
                          group_id=0, logprobs=np.full(len(tok(p)["input_ids"]), -2.0,
                                                       dtype=np.float32))
               for i, p in enumerate(prompts)]
    return Batch(records=records, weights=[1.0] * len(records), uses=[0] * len(records))


def train(model_dir: Path, tmp: Path, dtype: str, device: torch.device, steps: int,
          share: bool | None = None) -> dict:
    """`steps` trainer steps on the fixed batch; the metrics and the weights' state. With
    `share` set: on the SHARED group, with `trainer.share_prompts` set to it."""
    import yaml

    from rft_hpc.config import load_config
    from rft_hpc.trainer.distributed import DistContext
    from rft_hpc.trainer.trainer import Trainer

    path = tmp / f"{dtype}-{share}.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"root": str(tmp / "runs"), "seed": 0}, "model": {"path": str(model_dir)},
        "trainer": {"lr": 1e-3, "batch_size": 8, "backend": "torch", "dtype": dtype,
                    "share_prompts": bool(share)}}))
    batch = (fixed_batch(model_dir) if share is None
             else fixed_batch(model_dir, SHARED, prompt_length=6))
    torch.manual_seed(0)
    trainer = Trainer(load_config(path), DistContext(device=device))
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    losses, norms, seconds = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        values = trainer.step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(values["loss"])
        norms.append(values["grad_norm"])
    state = trainer.model.state_dict()
    return {
        "compute_dtype": str(trainer.compute_dtype).removeprefix("torch."),
        "param_devices": sorted({str(p.device) for p in trainer.model.parameters()}),
        "weights_dtype": sorted({str(p.dtype).removeprefix("torch.")
                                 for p in trainer.model.parameters()}),
        "losses": losses, "grad_norms": norms,
        "finite": all(map(math.isfinite, losses + norms))
                  and all(bool(torch.isfinite(v).all()) for v in state.values()),
        "changed": sum(not torch.equal(v, start[k]) for k, v in state.items()
                       if v.is_floating_point()),
        "tensors": sum(v.is_floating_point() for v in start.values()),
        "step_s": [round(s, 4) for s in seconds],
    }


def trainer_check(steps: int, tol: float) -> dict:
    """The bf16 run against the float32 run's first step; the verdict and figures."""
    from rft_hpc.models.tiny import init_tiny_model

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "tiny")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        bf16 = train(model_dir, Path(tmp), "bfloat16", device, steps)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        fp32 = train(model_dir, Path(tmp), "float32", device, 1)
        shared = train(model_dir, Path(tmp), "bfloat16", device, 1, share=True)
        padded = train(model_dir, Path(tmp), "bfloat16", device, 1, share=False)
    rel = {key: abs(bf16[key][0] - fp32[key][0]) / max(abs(fp32[key][0]), 1e-12)
           for key in ("losses", "grad_norms")}
    result = {"device": str(device), **bf16, "float32_first_loss": fp32["losses"][0],
              "bf16_vs_fp32_loss_rel": rel["losses"],
              "bf16_vs_fp32_grad_norm_rel": rel["grad_norms"], "tolerance": tol,
              "shared_vs_padded_rel": {key: abs(shared[key][0] - padded[key][0])
                                       / max(abs(padded[key][0]), 1e-12)
                                       for key in ("losses", "grad_norms")},
              "peak_gpu_mib": None if peak is None else round(peak, 1)}
    result["ok"] = (bf16["finite"] and bf16["changed"] == bf16["tensors"]
                    and bf16["compute_dtype"] == "bfloat16"
                    and bf16["param_devices"] == [str(device)]
                    and all(v <= tol for v in rel.values())
                    and rel["grad_norms"] > 0  # equal to float32's: autocast did nothing
                    and shared["finite"] and padded["finite"]
                    and all(v <= tol for v in result["shared_vs_padded_rel"].values()))
    return result


def role_device() -> dict:
    """Which device `init_distributed()` gives a one-process trainer role."""
    from rft_hpc.trainer.distributed import init_distributed, shutdown

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID", "MASTER_ADDR"):
        os.environ.pop(var, None)
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU: a one-process trainer runs on the CPU"}
    ctx = init_distributed()
    shutdown()
    ok = ctx.device.type == "cuda"
    return {"ok": ok, "device": str(ctx.device), "world_size": ctx.world_size,
            "note": "" if ok else "a one-rank trainer role trains on the CPU although a GPU "
                    "is present (init_distributed: a world of one gets DistContext() = cpu)"}


def main() -> int:
    """Run the check chosen by the options; print its verdict and RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=5e-2,
                    help="largest relative bf16 - float32 difference of the first step's "
                    "loss and gradient norm [5e-2]")
    ap.add_argument("--role-device", action="store_true",
                    help="check the device a one-process trainer role picks instead")
    args = ap.parse_args()
    result = role_device() if args.role_device else trainer_check(args.steps, args.tolerance)
    if "skipped" not in result:
        print(("ok   " if result["ok"] else "FAIL ") + ", ".join(
            f"{k} {v}" for k, v in result.items() if k != "ok"), flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
