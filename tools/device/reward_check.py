"""Device check of reward-model scoring: tokens/s of the explorer's scorer on the GPU against
a bare batched forward of the same model on the same batch.

    python3 tools/device/reward_check.py [--shape auto|qwen2.5-0.5b|tiny] [--batch 32]
        [--words 120] [--reps 10] [--judge]

Self-contained, nothing from a hub: builds a randomly initialised Qwen2 model of
Qwen2.5-0.5B's shape (tools/device/grpo_check.py's `build_model`; `--shape tiny`, what
`auto` picks without a GPU, for CPUs), gives it a one-label sequence-classification head
(random) and saves it as a reward-model folder. The batch: `--batch` calls of the RLHF
recipe's prompts ("Describe the <topic>.") with responses of `--words` words from its
vocabulary. It times, median of `--reps` after a warm-up, on the device a role's reward
models run on (`engine_device`: the GPU when there is one, in bf16):
- bare: the tokenizer and one forward of the padded batch;
- scorer: `ModelScorer.score`, what an explorer (and a reward job) runs model terms through;
and prints `RESULT {"ok": ..., "tokens_per_s": ..., "bare_tokens_per_s": ...,
"ratio": ..., ...}`. ok: every score finite, the scorer's scores equal the bare forward's
(to bf16's precision) and the ratio is >= 0.8.

`--judge`: instead, the same random model as an LLM judge on vLLM (`engine: vllm`, the
judge scorer the explorer runs judge terms through): `--batch` rubrics with the same
responses, answered greedily (16 tokens each), timed as above; `RESULT {"ok": ...,
"judge_answers_per_s": ..., "unparseable": ...}`. ok: every call got an outcome and none
failed but as unparseable (a random judge's answers mostly are).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from grpo_check import build_model  # noqa: E402  (this folder's)

RATIO_MIN = 0.8


def reward_folder(tmp: Path, shape: str, device: str) -> tuple[Path, dict]:
    """A random one-label classifier of `shape` at `tmp/rm` and the base model's figures."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = tmp / "base"
    figures = build_model(base, shape, device)
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=1, local_files_only=True, pad_token_id=tokenizer.pad_token_id,
        dtype=torch.bfloat16)
    folder = tmp / "rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, figures


def calls(folder: Path, n: int, words: int) -> list:
    """`n` (task, response) calls scored by the reward model at `folder`."""
    from rft_hpc.config.rewards import RewardModelSpec
    from rft_hpc.tasks.preferences import (
        BAD_WORDS,
        GOOD_WORDS,
        NEUTRAL_WORDS,
        describe_tasks,
    )

    train, _ = describe_tasks(train_size=n, eval_size=0)
    term = RewardModelSpec(model=folder, batch_size=n)
    rng = random.Random(0)
    vocab = GOOD_WORDS + BAD_WORDS + NEUTRAL_WORDS
    return [(replace(t, reward=f"model:{folder}", reward_terms=(term,)),
             " ".join(rng.choice(vocab) for _ in range(words)) + ".") for t in train]


def timed(fns: list, reps: int) -> list[float]:
    """Median seconds of each of `fns` over `reps` rounds, after one warm-up each; the
    rounds interleave them, so that a passing load on the machine weighs on all alike."""
    import torch

    def once(fn) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for fn in fns:
        fn()
    times = [[once(fn) for fn in fns] for _ in range(reps)]
    return [statistics.median(row[i] for row in times) for i in range(len(fns))]


def reward_check(args: argparse.Namespace) -> dict:
    import torch

    from rft_hpc.tasks.model_reward import ModelScorer, RewardModel, engine_device

    device = engine_device()
    shape = args.shape if args.shape != "auto" else (
        "qwen2.5-0.5b" if device == "cuda" else "tiny")
    with tempfile.TemporaryDirectory(prefix="reward-check-") as tmp:
        folder, figures = reward_folder(Path(tmp), shape, device)
        batch = calls(folder, args.batch, args.words)
        rm = RewardModel(folder, device)
        texts = rm.texts(batch)
        templated = bool(rm.tokenizer.chat_template)
        scores: dict[str, list[float]] = {}

        def bare() -> None:
            ids = rm.tokenizer(texts, padding=True, return_tensors="pt",
                               add_special_tokens=not templated).to(device)
            with torch.inference_mode():
                scores["bare"] = rm.model(**ids).logits[:, 0].float().cpu().tolist()

        scorer = ModelScorer(device)

        def scored() -> None:
            scores["scorer"] = [o.score for o in scorer.score(batch)]

        tokens = sum(len(rm.tokenizer(t, add_special_tokens=not templated)["input_ids"])
                     for t in texts)
        t_bare, t_scorer = timed([bare, scored], args.reps)
    finite = all(math.isfinite(x) for x in scores["bare"] + scores["scorer"])
    spread = max(abs(x) for x in scores["bare"]) or 1.0
    agree = max(abs(a - b) for a, b in zip(scores["bare"], scores["scorer"], strict=True))
    ratio = t_bare / t_scorer
    return {"ok": finite and agree <= 0.02 * spread and ratio >= RATIO_MIN,
            "device": device, "shape": shape, "batch": args.batch, "tokens": tokens,
            "tokens_per_s": round(tokens / t_scorer), "bare_tokens_per_s": round(tokens / t_bare),
            "ratio": round(ratio, 3), "max_score_difference": agree, **figures}


def judge_check(args: argparse.Namespace) -> dict:
    from rft_hpc.config.rewards import JudgeSpec
    from rft_hpc.config.vllm import VLLMConfig
    from rft_hpc.engines.judge import judge_loaders
    from rft_hpc.tasks.judge_reward import JudgeScorer
    from rft_hpc.tasks.model_reward import engine_device

    device = engine_device()
    shape = args.shape if args.shape != "auto" else (
        "qwen2.5-0.5b" if device == "cuda" else "tiny")
    with tempfile.TemporaryDirectory(prefix="judge-check-") as tmp:
        base = Path(tmp) / "judge"
        figures = build_model(base, shape, device)
        spec = JudgeSpec(judge=base, template="Rate from 0 to 9: {response}\nScore:",
                         engine="vllm", batch_size=args.batch,
                         vllm=VLLMConfig(gpu_memory_utilization=0.5, enforce_eager=True,
                                         kv_cache_gb=None if device == "cuda" else 0.25))
        batch = [(replace(task, reward_terms=(spec,)), response)
                 for task, response in calls(base, args.batch, args.words)]
        scorer = JudgeScorer(device, loaders=judge_loaders())
        outcomes: list = []
        try:
            t0 = time.perf_counter()
            scorer.score(batch)  # loads the engine
            load_s = time.perf_counter() - t0
            (seconds,) = timed([lambda: outcomes.extend(scorer.score(batch))], args.reps)
        finally:
            scorer.close()
    other = [o.error for o in outcomes if o.failed and not o.unparseable]
    return {"ok": not other and len(outcomes) == args.batch * (args.reps + 1),
            "device": device, "shape": shape, "batch": args.batch,
            "judge_answers_per_s": round(args.batch / seconds, 1),
            "unparseable": sum(o.unparseable for o in outcomes), "load_s": round(load_s, 1),
            "errors": other[:3], **figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="auto", choices=("auto", "qwen2.5-0.5b", "tiny"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--judge", action="store_true", help="an LLM judge on vLLM instead")
    args = parser.parse_args()
    result = judge_check(args) if args.judge else reward_check(args)
    print("RESULT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
