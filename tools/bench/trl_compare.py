#!/usr/bin/env python
"""Benchmark: rft-hpc against TRL's GRPOTrainer, from the same checkpoint, in one session.

    pip install 'rft-hpc[compare]'        # TRL: a dependency of this script alone
    python tools/bench/trl_compare.py [--steps 100] [--runs 1] [--json OUT]

Both train the demo's task (two-digit addition, exact-match reward) from the same SFT
checkpoint (the demo's warm-up stage, run here once and exported) with the demo's batch
shape: 8 prompts x 8 completions of up to 5 tokens a step, GRPO, strictly on-policy, the
same learning rate (constant), the same number of steps, no KL term:

- TRL: `GRPOTrainer` on the CPU, generation with transformers (no vLLM), the prompts as
  text, the reward an exact-match function; its defaults otherwise, but gradient
  checkpointing off (a tiny model needs none, and it would slow TRL down);
- rft-hpc: `rft-hpc run` of the same stage with the default placement, colocated.

It prints each one's completions/s (steps 3..N: the start-up and the first steps left out,
as tools/bench/pipeline.py does) and held-out accuracy (greedy, the same 500 held-out
problems, the same scorer, each final model loaded the same way), the rate ratio (target:
rft-hpc >= 1.05 x TRL) and whether the accuracies differ beyond noise (McNemar's exact test
on the paired answers, two-sided p < 0.05 counts as a difference). Each takes the machine's
cores, one after the other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TASKS, REPEAT, TOKENS, LR = 8, 8, 5, 1.0e-5
WARM = 2  # steps left out of a rate
HELD_OUT = 500


def stage_text(root: Path, model: Path, name: str, steps: int, *, sft: bool) -> str:
    """A one-stage config: the demo's SFT warm-up, or GRPO from `model` at the demo's
    batch shape (one explorer, 8 x 8)."""
    head = f"""
run: {{name: {name}, root: {root}, seed: 0}}
model: {{path: {model}{", init: tiny" if sft else ""}}}
tasks: {{type: arithmetic, digits: 2, ops: "+", eval_size: {HELD_OUT}}}
"""
    if sft:
        return head + """
mode: train
data: {source: tasks}
algorithm: {algorithm_type: sft}
trainer: {lr: 3.0e-4, batch_size: 64, steps: 350, warmup_steps: 20, save_interval: 350}
buffer: {max_uses: 4}
eval: {interval: 0}
"""
    return head + f"""
explorer: {{count: 1, tasks_per_step: {TASKS}, repeat: {REPEAT}, temperature: 1.0,
           max_new_tokens: {TOKENS}}}
algorithm: {{algorithm_type: grpo}}
trainer: {{lr: {LR}, batch_size: {TASKS * REPEAT}, steps: {steps}, save_interval: 100000}}
sync: {{interval: 1, offset: 0}}
eval: {{interval: 0}}
"""


def rft(*args: object) -> None:
    """The rft-hpc CLI from this checkout; fails loudly."""
    proc = subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"rft-hpc {args[0]} failed:\n{proc.stderr[-3000:]}")


def warm_start(work: Path) -> Path:
    """The demo's SFT warm-up of the tiny model, exported as a model folder."""
    config = work / "sft.yaml"
    config.write_text(stage_text(work / "runs", work / "tiny", "sft", 350, sft=True))
    rft("run", config)
    rft("export", work / "runs" / "sft", "--out", work / "sft-model")
    return work / "sft-model"


def run_rft(work: Path, start: Path, steps: int, name: str) -> dict[str, Any]:
    """`rft-hpc run` of the GRPO stage from `start` (its default placement); its rate and
    final model folder."""
    from rft_hpc.monitor.metrics import read_metrics

    config = work / f"{name}.yaml"
    config.write_text(stage_text(work / "runs", start, name, steps, sft=False))
    rft("run", config)
    run = work / "runs" / name
    stage = next(run.glob("stages/*"))
    rows = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
            if "train_seconds" in r][WARM:]
    out = work / f"{name}-model"
    rft("export", run, "--out", out)
    logs = sorted(p.name for p in (stage / "jobs").glob("*.log"))
    return {"completions_per_s": (len(rows) - 1) * TASKS * REPEAT
            / (rows[-1]["time"] - rows[0]["time"]), "model": str(out), "logs": logs}


def run_trl(work: Path, start: Path, steps: int, name: str) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same task, batch and steps from `start`, in a process of
    its own; its rate and final model folder."""
    out = work / f"{name}-model"
    cmd = [sys.executable, __file__, "--trl-child", str(start), "--out", str(out),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"TRL failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "model": str(out)}


def trl_child(start: Path, out: Path, steps: int) -> None:
    """Train with TRL (in this process) and print its rate as JSON."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rft_hpc.engines.hf import HFEngine

    tasks = train_tasks(steps, start)
    engine = HFEngine(start)
    tokenizer = AutoTokenizer.from_pretrained(start)
    # the prompt text that tokenizes to rft-hpc's prompt ids (its special tokens included)
    prompts = [tokenizer.decode(engine.prompt_ids(t)) for t in tasks]
    assert tokenizer(prompts[0], add_special_tokens=False)["input_ids"] == \
        engine.prompt_ids(tasks[0]), "the TRL prompt text does not give rft-hpc's prompt ids"
    data = Dataset.from_dict({"prompt": prompts, "answer": [t.answer for t in tasks]})

    def exact_match(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    times: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *_: Any, **__: Any) -> None:
            times.append(time.time())

    args = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=TASKS * REPEAT,
        num_generations=REPEAT, max_completion_length=TOKENS, temperature=1.0,
        learning_rate=LR, lr_scheduler_type="constant", max_steps=steps, beta=0.0,
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=10 ** 6, shuffle_dataset=False, seed=0,
        dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(start)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args,
                          train_dataset=data, processing_class=tokenizer,
                          callbacks=[Clock()])
    trainer.train()
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    rows = times[WARM:]
    rate = (len(rows) - 1) * TASKS * REPEAT / (rows[-1] - rows[0])
    print(json.dumps({"completions_per_s": rate, "steps": len(times)}))


def train_tasks(steps: int, model: Path) -> list[Any]:
    """Training tasks of the same split rft-hpc samples from, enough for `steps` steps of
    `TASKS` prompts."""
    from rft_hpc.tasks.source import build_tasks

    config = load_config_text(stage_text(Path("/tmp"), model, "x", steps, sft=False))
    train, _ = build_tasks(config.tasks, config.run.seed)
    return [train[i % len(train)] for i in range(steps * TASKS)]


def load_config_text(text: str) -> Any:
    """A config from text (through a temporary file: the loader reads files)."""
    from rft_hpc.config import load_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_config(Path(f.name))
    finally:
        os.unlink(f.name)


def held_out(model: Path, steps: int) -> list[float]:
    """Greedy exact-match of the held-out problems by the model folder `model`."""
    from rft_hpc.engines.hf import HFEngine
    from rft_hpc.eval.scoring import score_tasks
    from rft_hpc.tasks.source import build_tasks

    config = load_config_text(stage_text(Path("/tmp"), model, "x", steps, sft=False))
    _, tasks = build_tasks(config.tasks, config.run.seed)
    answers: list[dict[str, Any]] = []
    score_tasks(HFEngine(model), tasks[:HELD_OUT], k=0, n=0, temperature=0.0,
                max_new_tokens=TOKENS, batch_size=100, seed=0, answers=answers)
    return [float(a["reward"]) for a in answers]


def mcnemar(a: list[float], b: list[float]) -> float:
    """Two-sided exact McNemar p of paired right/wrong answers."""
    only_a = sum(x > y for x, y in zip(a, b, strict=True))
    only_b = sum(y > x for x, y in zip(a, b, strict=True))
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(work: Path, steps: int) -> dict[str, Any]:
    """One paired run of both from the same warm start."""
    start = warm_start(work)
    before = held_out(start, steps)
    trl = run_trl(work, start, steps, "trl")
    ours = run_rft(work, start, steps, "rft")
    acc_trl, acc_rft = held_out(Path(trl["model"]), steps), held_out(Path(ours["model"]), steps)
    return {"steps": steps, "start_accuracy": sum(before) / len(before),
            "trl": {**trl, "accuracy": sum(acc_trl) / len(acc_trl)},
            "rft": {**ours, "accuracy": sum(acc_rft) / len(acc_rft)},
            "ratio": ours["completions_per_s"] / trl["completions_per_s"],
            "accuracy_p": mcnemar(acc_rft, acc_trl)}


def report(r: dict[str, Any]) -> None:
    """Print one comparison."""
    placement = "colocated" if "colocated.log" in r["rft"]["logs"] else "split"
    print(f"from the same SFT checkpoint (held-out accuracy {r['start_accuracy']:.3f}), "
          f"{r['steps']} GRPO steps of {TASKS} x {REPEAT} x {TOKENS} tokens:")
    print(f"  TRL GRPOTrainer    {r['trl']['completions_per_s']:7.1f} completions/s, held-out "
          f"accuracy {r['trl']['accuracy']:.3f}")
    print(f"  rft-hpc ({placement}) {r['rft']['completions_per_s']:7.1f} completions/s, "
          f"held-out accuracy {r['rft']['accuracy']:.3f}")
    same = r["accuracy_p"] >= 0.05 or r["rft"]["accuracy"] > r["trl"]["accuracy"]
    print(f"  rate rft-hpc / TRL {r['ratio']:.3f} (target >= 1.05) "
          f"{'ok' if r['ratio'] >= 1.05 else 'MISSED'}; accuracies paired, McNemar p "
          f"{r['accuracy_p']:.3g}: {'equal within noise' if same else 'rft-hpc lower'}")


def main() -> int:
    """Run the comparison (or, with --trl-child, TRL's side of it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps of each [100]")
    ap.add_argument("--runs", type=int, default=1, help="paired comparisons, one after another")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        trl_child(args.trl_child, args.out, args.steps)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("TRL is not installed: pip install 'rft-hpc[compare]'") from None
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="rft-bench-trl-") as tmp:
            r = compare(Path(tmp), args.steps)
        if args.runs > 1:
            print(f"--- run {i + 1} of {args.runs}")
        report(r)
        results.append(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
