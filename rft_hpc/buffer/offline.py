"""Offline records made from tasks: SFT samples (prompt -> answer) and DPO pairs (the
answer chosen over a wrong one), for `data: {source: tasks}` stages and for tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from rft_hpc.buffer.records import DPOPair, Record, SFTSample
from rft_hpc.tasks.task import Task


def wrong_answer(task: Task, rng: random.Random) -> str:
    """A plausible wrong answer: a numeric answer off by 1..10 either way, else the answer
    with its last character changed."""
    try:
        value = int(task.answer)
    except ValueError:
        last = task.answer[-1:] or "a"
        return task.answer[:-1] + ("b" if last == "a" else "a")
    return str(value + rng.choice([-1, 1]) * rng.randint(1, 10))


def task_records(tasks: Sequence[Task], tokenizer: Any, kind: str, seed: int = 0) -> list[Record]:
    """One record per task: an `sft` sample (prompt, answer, EOS) or a `dpo` pair (answer
    chosen, `wrong_answer` rejected, each ending with EOS); the prompt is not trained."""
    rng = random.Random(seed)
    eos = [tokenizer.eos_token_id]
    out: list[Record] = []
    for task in tasks:
        prompt = list(tokenizer(task.prompt, add_special_tokens=True)["input_ids"])

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos
        if kind == "dpo":
            out.append(DPOPair(prompt + encode(task.answer),
                               prompt + encode(wrong_answer(task, rng)), len(prompt),
                               task_id=task.task_id, taskset=task.taskset))
        else:
            out.append(SFTSample(prompt + encode(task.answer), len(prompt),
                                 task_id=task.task_id, taskset=task.taskset))
    return out
