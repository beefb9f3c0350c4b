"""A tiny LLM judge built locally: a two-layer Mistral chat model of `rft-hpc model init`,
fine-tuned here with plain-torch SFT steps to answer `Score: <c>` to the rubric
`Rate: <response>`, where `<c>` is the response's last character (its template's `Rate: `
space for an empty response). Mistral's template is the shortest: 400 steps, the learning
rate decaying linearly to 0, teach it this in ~12 s on one core (60 answers of 60 right,
and as right at 320 and 480 steps, with 1 or 2 threads, on an AVX-512 machine). At a
constant rate the answers depended on the CPU: 320 steps were 60 of 60 on one machine and
56 of 60 on another, 480 steps 26 of 60 (2026-12-08). Responses from the arithmetic
alphabet then give answers the `number` parser reads (`Score: 7`) and answers it cannot
(`Score: +`), a deterministic mix that a test can recompute with a plain greedy
`generate`."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from rft_hpc.models.tiny import ARITHMETIC_ALPHABET

JUDGE_TEMPLATE = "Rate: {response}"
"""The rubric the judge is trained on."""

SFT_STEPS = 400
SFT_BATCH = 24


def judge_rubric_answer(response: str) -> str:
    """What the trained judge answers to `JUDGE_TEMPLATE` filled in with `response`."""
    return f"Score: {(JUDGE_TEMPLATE.format(response=response))[-1]}"


def tiny_judge(folder: Path, *, seed: int = 0) -> Path:
    """The trained tiny judge: a Hugging Face causal LM folder with its chat tokenizer. It
    is trained once per seed, this file and the library versions, for every test worker of
    every module (a file lock; about 14 s of a core each time otherwise), in the temporary
    folder's shared cache; `folder` is where it goes when that cache cannot be written."""
    import fcntl
    import hashlib
    import tempfile

    import transformers

    key = hashlib.sha256(Path(__file__).read_bytes() + transformers.__version__.encode()
                         ).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "rft-hpc-test-cache" / f"judge-{seed}-{key}"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache.parent / f"{cache.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker trains, the others wait for it
            return _trained_judge(cache, seed)
    except OSError:
        return _trained_judge(folder, seed)


def _trained_judge(folder: Path, seed: int) -> Path:
    """Train the judge into `folder` unless it holds one already; `folder`."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

    base = folder.with_name(folder.name + "-base")
    init_tiny_model(base, TinyModelSpec(arch="mistral", num_layers=2, seed=seed))
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / SFT_STEPS)
    model.train()
    for _ in range(SFT_STEPS):
        rows = []
        for _ in range(SFT_BATCH):
            response = "".join(rng.choice(ARITHMETIC_ALPHABET)
                               for _ in range(rng.randint(0, 4)))
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": JUDGE_TEMPLATE.format(response=response)}],
                tokenize=False, add_generation_prompt=True)
            rows.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(judge_rubric_answer(response) + tokenizer.eos_token,
                                   add_special_tokens=False)["input_ids"]))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (prompt, answer) in enumerate(rows):
            n = len(prompt) + len(answer)
            ids[i, :n] = torch.tensor(prompt + answer)
            labels[i, len(prompt):n] = torch.tensor(answer)
            mask[i, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    staging = folder.with_name(folder.name + ".tmp")  # whole or not at all
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    shutil.rmtree(base, ignore_errors=True)
    staging.rename(folder)
    return folder
