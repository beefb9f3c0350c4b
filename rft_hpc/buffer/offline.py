"""Offline records: SFT samples (prompt -> answer) and DPO pairs (the answer chosen over a
wrong one) made from tasks, for `data: {source: tasks}` stages and for tests; and those of
the user's data files (`data: {source: file}`, read by `tasks.offline_rows`). Prompts are
always the explorers' ids, responses end with the stop token."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft_hpc.buffer.records import DPOPair, Record, SFTSample
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.tasks.offline_rows import OfflineExample
from rft_hpc.tasks.prompts import prompt_ids, response_ids, stop_token_ids
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def wrong_answer(task: Task, rng: random.Random) -> str:
    """A plausible wrong answer: a numeric answer off by 1..10 either way, else the answer
    with its last character changed."""
    try:
        value = int(task.answer)
    except ValueError:
        last = task.answer[-1:] or "a"
        return task.answer[:-1] + ("b" if last == "a" else "a")
    return str(value + rng.choice([-1, 1]) * rng.randint(1, 10))


def task_records(tasks: Sequence[Task], tokenizer: PreTrainedTokenizerBase, kind: str,
                 seed: int = 0, *, prompt_format: PromptConfig | None = None,
                 stop_ids: list[int] | None = None) -> list[Record]:
    """One record per task: an `sft` sample (prompt, answer, stop token) or a `dpo` pair
    (answer chosen, `wrong_answer` rejected, each ending with the stop token); the prompt is
    not trained. Prompts are the explorers' (`tasks.prompts.prompt_ids` in `prompt_format`),
    the stop token the first of `stop_ids` (default: the tokenizer's EOS)."""
    rng = random.Random(seed)
    fmt = prompt_format if prompt_format is not None else PromptConfig()
    stops = stop_ids if stop_ids is not None else stop_token_ids(tokenizer, None, fmt)
    out: list[Record] = []
    for task in tasks:
        prompt = prompt_ids(tokenizer, task, fmt)

        def encode(text: str) -> list[int]:
            return response_ids(tokenizer, text, stops)
        if kind == "dpo":
            out.append(DPOPair(prompt + encode(task.answer),
                               prompt + encode(wrong_answer(task, rng)), len(prompt),
                               task_id=task.task_id, taskset=task.taskset))
        else:
            out.append(SFTSample(prompt + encode(task.answer), len(prompt),
                                 task_id=task.task_id, taskset=task.taskset))
    return out


def example_records(examples: Sequence[OfflineExample], tokenizer: PreTrainedTokenizerBase, *,
                    prompt_format: PromptConfig | None = None,
                    stop_ids: list[int] | None = None) -> list[Record]:
    """One record per example: an `sft` sample (prompt, response, stop token) or a `dpo`
    pair (prompt + chosen, prompt + rejected, each ending with the stop token), carrying the
    example's id, task set and `info`; the prompt is not trained. Prompts and stop tokens
    are those of `task_records`."""
    fmt = prompt_format if prompt_format is not None else PromptConfig()
    stops = stop_ids if stop_ids is not None else stop_token_ids(tokenizer, None, fmt)
    out: list[Record] = []
    for example in examples:
        task = example.prompt
        prompt = prompt_ids(tokenizer, task, fmt)
        seqs = [prompt + response_ids(tokenizer, text, stops) for text in example.responses]
        common = {"task_id": task.task_id, "taskset": task.taskset, "info": dict(task.info)}
        out.append(DPOPair(seqs[0], seqs[1], len(prompt), **common) if example.kind == "dpo"
                   else SFTSample(seqs[0], len(prompt), **common))
    return out
