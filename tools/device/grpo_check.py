"""Device check of a short GRPO run (`rft-hpc run`) on a Qwen2.5-0.5B-shaped model, in bf16.

    python3 tools/device/grpo_check.py [--shape auto|qwen2.5-0.5b|tiny] [--engine auto|hf|vllm]
        [--steps 3] [--tasks 4] [--repeat 4] [--max-new-tokens 64] [--timeout 110]

Self-contained, nothing from a hub: builds a randomly initialised Qwen2 model of
Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, head_dim 64, intermediate
4864, vocab 151936, tied embeddings, rope_theta 1e6, 32768 positions; `--shape tiny`: the
same family shrunk for CPUs, what `auto` picks without a GPU) with the byte-level tokenizer
and qwen2 chat template of rft-hpc's tiny Qwen2 (rft_hpc.models.families), then runs
`rft-hpc run` on a one-stage GRPO config: one explorer (`explorer.engine` vllm when vllm is
importable, else the HF engine, which generates on the CPUs even beside a GPU), one trainer
(torch backend; on a GPU `model.dtype` and `trainer.dtype` auto mean bf16 weights and bf16
autocast), weights synced through files after every step.

The tokenizer is filled to Qwen2.5's size (`build_byte_tokenizer(filler=...)`: 151643 ids
of one to three bytes, then the special tokens at Qwen2.5's ids 151643-151645), so a random
model samples ids it decodes; the model's 151936 rows are more than the tokenizer's 151646
ids, as Qwen2.5's are (151665). The reward is `distinct_share` below (distinct characters
per character of the response): random text scores differently within a group, so GRPO's
advantages and gradients are not zero.

From the run's metrics it prints the rollout tokens/s (the explorer's `generated_tokens` /
`generate_seconds`) and the trainer tokens/s (the trainer's `tokens` / `train_seconds`) over
all steps and over those after the first (which warms up), and ends with `RESULT {"ok": ...,
"rollout_tokens_per_s": ..., "trainer_tokens_per_s": ..., "engine": ..., ...}` (with
`"vllm": "missing"` when vLLM is not importable: then the HF engine ran). It also says which
placement `rft-hpc run` chose (`"placement": "colocated"`, the default on one machine:
docs/colocated.md) and, with `--alone-steps N` (3 by default), times the engine and the
trainer each alone afterwards, in this process, on the same devices and batch shape:
`rollout_tokens_per_s_alone`, `trainer_tokens_per_s_alone`, and the run's rates over them
(`rollout_run_over_alone`, `trainer_run_over_alone`: what sharing the device cost). ok: the run
exited 0, the trainer ran every step with finite losses and gradient norms, some gradient
not zero, the published weights are finite and in the trainer's dtype, and both rates are
positive. A run past `--timeout` is stopped (its roles too) and fails with the figures it
got so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAGE = "0-main"  # a config without `stages` runs one (docs/run-directory.md)

SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864,
                     "vocab_size": 151936, "max_position_embeddings": 32768},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1088,
             "max_position_embeddings": 32768},
}
"""transformers' Qwen2Config keywords of each shape (head_dim = hidden / heads: 64 and 32)."""

TOKENIZER_IDS = {"qwen2.5-0.5b": 151643, "tiny": 1021}
"""Ids of each shape's tokenizer before its special tokens (Qwen2.5's: 151643)."""


def distinct_share(task: Any, response: str) -> float:
    """The GRPO check's reward: distinct characters per character of the response (0 for an
    empty one); it varies between random responses of one prompt."""
    return len(set(response)) / len(response) if response else 0.0


def importable(module: str) -> bool:
    """Whether `module` can be found here (nothing is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def build_model(out: Path, shape: str, device: str) -> dict[str, Any]:
    """Write a randomly initialised Qwen2 model of `shape` (SHAPES) with the tiny Qwen2's
    tokenizer and chat template to `out` in bfloat16; its figures (parameters, seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from rft_hpc.models.families import FAMILIES
    from rft_hpc.models.tokenizer import build_byte_tokenizer

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    family = FAMILIES["qwen2"]
    build_byte_tokenizer(out, special=family.special, plain=family.plain, bos=family.bos,
                         eos=family.eos, pad=family.pad, chat_template=family.template,
                         filler=TOKENIZER_IDS[shape] - 256)
    vocab = AutoTokenizer.from_pretrained(str(out), local_files_only=True).get_vocab()
    dims = dict(SHAPES[shape])
    vocab_size = dims.pop("vocab_size")
    config = family.config(vocab, **dims)
    config.vocab_size = vocab_size  # the model's rows: more than the tokenizer's ids
    config.dtype = "bfloat16"  # as Qwen2.5's checkpoints are saved
    torch.manual_seed(0)
    with torch.device(device):  # on a GPU: initialising 0.5 B parameters takes no time
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(**family.generation_ids(vocab))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"params": params, "tokenizer_ids": len(vocab), "vocab_size": vocab_size,
            "build_s": round(time.perf_counter() - t0, 1)}


def run_config(tmp: Path, model: Path, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """The one-stage GRPO experiment: one explorer step is one trainer batch."""
    batch = args.tasks * args.repeat
    vllm = {"enforce_eager": True, "max_model_len": 1024, "kv_cache_gb": 2.0,
            "gpu_memory_utilization": 0.3}  # the trainer shares the GPU
    threads = max(1, (os.cpu_count() or 2) // 2)  # the HF engine generates on the CPUs
    return {
        "run": {"name": "grpo", "root": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(model), "dtype": "auto",
                  **({"lora": {"rank": args.lora, "alpha": 2 * args.lora}} if args.lora else {})},
        "prompt": {"format": "chat", "system_prompt": "Add the numbers."},
        "tasks": {"type": "arithmetic", "digits": 2, "ops": "+", "eval_size": 2,
                  "reward": "grpo_check:distinct_share"},
        "explorer": {"count": 1, "engine": engine, "tasks_per_step": args.tasks,
                     "repeat": args.repeat, "temperature": 1.0,
                     "max_new_tokens": args.max_new_tokens, "threads": threads,
                     **({"vllm": vllm} if engine == "vllm" else {})},
        "algorithm": {"algorithm_type": "grpo"},
        "trainer": {"backend": "torch", "dtype": "auto", "lr": 1e-5 if args.lora else 1e-6,
                    "batch_size": batch,
                    "steps": args.steps, "save_interval": args.steps, "keep_checkpoints": 1},
        "sync": {"method": "checkpoint", "interval": 1, "offset": 1},
        "eval": {"interval": 0, "max_new_tokens": 4},
        "buffer": {"poll_interval": 0.05},
    }


def run_experiment(config: Path, cwd: Path, env: dict[str, str],
                   timeout: float) -> subprocess.CompletedProcess[str]:
    """`rft-hpc run CONFIG` in `cwd`; past `timeout` it is interrupted (Ctrl-C: the roles
    stop), and the role processes still alive after 20 s are killed, each with its process
    group (they run in sessions of their own, which check_all's kill would not reach).
    returncode None: it timed out."""
    proc = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli", "run", str(config)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    from rft_hpc.core.rundir import RunDir
    from rft_hpc.run.processes import alive, read_processes

    record = read_processes(RunDir(cwd / "runs" / "grpo")) or {}
    for role in record.get("roles", {}).values():
        if alive(role["pid"], role.get("token")):
            os.killpg(role["pid"], signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, None, out, err)  # type: ignore[arg-type]


def rate(rows: list[dict], tokens: str, seconds: str) -> float:
    """sum(tokens) / sum(seconds) over `rows` (0 without time)."""
    total = sum(r[seconds] for r in rows)
    return round(sum(r[tokens] for r in rows) / total, 1) if total > 0 else 0.0


def published_weights(stage: Path) -> dict[str, Any]:
    """The last published version's dtypes and whether every tensor is finite."""
    import torch
    from safetensors.torch import load_file

    versions = sorted((p for p in (stage / "weights").glob("v*") if p.name[1:].isdigit()),
                      key=lambda p: int(p.name[1:]))
    if not versions:
        return {"version": None}
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(versions[-1].glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    manifest = json.loads((versions[-1] / "manifest.json").read_text())
    return {"version": int(versions[-1].name[1:]), "kind": manifest.get("kind", "full"),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
            "finite": all(bool(torch.isfinite(t).all()) for t in tensors.values())}


def alone_rates(config_path: Path, steps: int) -> dict[str, float]:
    """Rollout and trainer tokens/s of the run's engine and trainer each alone, in this
    process, on the devices and the batch shape the run used: `steps` explorer steps'
    generation, then a train step on each step's rollouts (after one unmeasured of each)."""
    sys.path.insert(0, str(REPO))
    from rft_hpc.config import load_config
    from rft_hpc.explorer.role import engine_starter
    from rft_hpc.tasks.source import build_tasks
    from rft_hpc.trainer.trainer import Trainer
    from tools.bench.pipeline_timings import batch_of

    config = load_config(config_path)
    cfg = config.explorer
    tasks, _ = build_tasks(config.tasks, 0)
    engine, trainer = engine_starter(config)(), Trainer(config)
    figures = {"generated": 0.0, "generate_s": 0.0, "trained": 0.0, "train_s": 0.0}
    try:
        for i in range(steps + 1):
            part = tasks[i * cfg.tasks_per_step:][:cfg.tasks_per_step]
            prompts = [engine.prompt_ids(t) for t in part]
            t0 = time.perf_counter()
            groups = engine.generate(prompts, n=cfg.repeat, max_new_tokens=cfg.max_new_tokens,
                                     temperature=cfg.temperature, seed=i)
            t1 = time.perf_counter()
            values = trainer.step(batch_of(part, prompts, groups), version=i)
            t2 = time.perf_counter()
            if i:  # the first of each warms up
                figures["generated"] += sum(len(c.tokens) for g in groups for c in g)
                figures["generate_s"] += t1 - t0
                figures["trained"] += values["tokens"]
                figures["train_s"] += t2 - t1
    finally:
        engine.close()
    return {"rollout_tokens_per_s_alone": round(figures["generated"] / figures["generate_s"], 1),
            "trainer_tokens_per_s_alone": round(figures["trained"] / figures["train_s"], 1)}


def grpo_check(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, run the experiment, read its metrics; the verdict and figures."""
    import torch
    import yaml

    from rft_hpc.monitor.metrics import read_metrics

    cuda = torch.cuda.is_available()
    shape = args.shape if args.shape != "auto" else ("qwen2.5-0.5b" if cuda else "tiny")
    has_vllm = importable("vllm")
    engine = args.engine if args.engine != "auto" else ("vllm" if has_vllm else "hf")
    result: dict[str, Any] = {
        "shape": shape, "engine": engine,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        # both engines generate on the job's GPU when it has one (rft_hpc.engines)
        "explorer_device": "cuda" if cuda else "cpu",
        "trainer_device": "cuda" if cuda else "cpu"}
    if not has_vllm:
        result["vllm"] = "missing"
    with tempfile.TemporaryDirectory(prefix="grpo-check-") as name:
        tmp = Path(name)
        result.update(build_model(tmp / "model", shape, "cuda" if cuda else "cpu"))
        if cuda:
            torch.cuda.empty_cache()  # the roles get the whole GPU
        config = tmp / "grpo.yaml"
        config.write_text(yaml.safe_dump(run_config(tmp, tmp / "model", engine, args)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        t0 = time.perf_counter()
        proc = run_experiment(config, tmp, env, args.timeout)
        result["run_s"] = round(time.perf_counter() - t0, 1)
        result["run_exit"] = proc.returncode
        if proc.returncode is None:
            result["error"] = f"rft-hpc run took more than --timeout {args.timeout:g} s: stopped"
        stage = tmp / "runs" / "grpo" / "stages" / STAGE
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
            for log in sorted(stage.glob("jobs/*.log")):
                print(f"--- {log.name}\n" + log.read_text()[-3000:], flush=True)
        explorer = [r for r in read_metrics(stage / "metrics" / "explorer-0.jsonl")
                    if "generate_seconds" in r] if (stage / "metrics").is_dir() else []
        trainer = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
                   if "train_seconds" in r] if (stage / "metrics").is_dir() else []
        weights = published_weights(stage) if (stage / "weights").is_dir() else {}
        # the same config runs both placements: which one `rft-hpc run` chose
        result["placement"] = "colocated" if (stage / "jobs/colocated.log").exists() \
            else "split"
        alone = alone_rates(config, args.alone_steps) \
            if proc.returncode == 0 and args.alone_steps else {}
    rollout = rate(explorer, "generated_tokens", "generate_seconds")
    train = rate(trainer, "tokens", "train_seconds")
    numbers = [r[k] for r in trainer for k in ("loss", "grad_norm")]
    want_dtype = "bfloat16" if cuda else "float32"  # model.dtype auto
    result.update({
        "rollout_tokens_per_s": rollout, "trainer_tokens_per_s": train,
        # the first step of each warms up (vLLM's and CUDA's kernels, the allocator)
        "rollout_tokens_per_s_after_first": rate(explorer[1:], "generated_tokens",
                                                 "generate_seconds"),
        "trainer_tokens_per_s_after_first": rate(trainer[1:], "tokens", "train_seconds"),
        "explorer_steps": len(explorer), "trainer_steps": len(trainer),
        "generated_tokens": sum(r["generated_tokens"] for r in explorer),
        "trained_tokens": sum(r["tokens"] for r in trainer),
        "reward_mean": [round(r["reward_mean"], 4) for r in explorer],
        "losses": [r["loss"] for r in trainer],
        "grad_norms": [r["grad_norm"] for r in trainer],
        "weights": weights,
        **alone,
    })
    for part in ("rollout", "trainer") if alone else ():
        # the run's rate (warmed up; all steps' when the later ones were generated together
        # with the first) against the same part alone: what sharing the device costs it
        run = result[f"{part}_tokens_per_s_after_first"] or result[f"{part}_tokens_per_s"]
        result[f"{part}_run_over_alone"] = round(run / alone[f"{part}_tokens_per_s_alone"], 3)
    result["ok"] = bool(
        proc.returncode == 0 and len(trainer) == args.steps
        and all(math.isfinite(v) for v in numbers)
        and any(r["grad_norm"] > 0 for r in trainer)
        and weights.get("finite") and weights.get("dtypes") == [want_dtype]
        and weights.get("kind") == ("lora-adapter" if args.lora else "full")
        and rollout > 0 and train > 0
        and all(v > 0 for k, v in alone.items()))
    return result


def main() -> int:
    """Parse the options, run the check, print the figures and the RESULT line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="auto", choices=["auto", *SHAPES],
                    help="model shape; auto: qwen2.5-0.5b with a GPU, else tiny [auto]")
    ap.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"],
                    help="explorer.engine; auto: vllm when importable, else hf [auto]")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps [3]")
    ap.add_argument("--tasks", type=int, default=4, help="prompts per step [4]")
    ap.add_argument("--repeat", type=int, default=4, help="rollouts per prompt [4]")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="[64]")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train a LoRA adapter of this rank (model.lora); 0: the whole model")
    ap.add_argument("--alone-steps", type=int, default=3,
                    help="after the run, time this many explorer steps' generation and train "
                         "steps with the engine and the trainer each alone [3]; 0: skip")
    ap.add_argument("--timeout", type=float, default=110,
                    help="seconds rft-hpc run may take before it is stopped [110]")
    args = ap.parse_args()
    result = grpo_check(args)
    print(("ok   " if result["ok"] else "FAIL ") + ", ".join(
        f"{k} {v}" for k, v in result.items() if k != "ok"), flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
