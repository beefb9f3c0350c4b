"""Generated lookups (`What is the code of account 2628?` -> `Z`): answers held in a tool
(`rft_hpc.envs.codebook:lookup`), which a model cannot know for accounts it never saw but can
ask for. Each task carries the call that solves it in `info.tool_calls`, from which an SFT
stage builds its demonstrations of tool use (`rft_hpc.envs.tool_demos`, docs/agents.md)."""

from __future__ import annotations

import hashlib
import random

from rft_hpc.tasks.task import Task

LETTERS = "DFGHJKPQXYZ"
"""The codes' letters: capitals that the prompts of the tool recipe (Mistral's template, the
tool's schema, the question) do not write, so that a code's letters are found nowhere else
in a trajectory: a tiny model learns to copy them sooner. The first, `D`, is the default
code."""

WEIGHTS = (5,) + (1,) * (len(LETTERS) - 1)
"""How often each letter is a code: the default `D` a third of the time (5 in 15), each
other letter one time in 15. A model that answers without the tool can do no better than
`D`, right one time in three; the tool is right every time."""

TOOL = "lookup"
"""The tool the tasks' demonstrations call (`rft_hpc.envs.codebook:lookup`)."""


def account_code(account: int) -> str:
    """The code of `account`: one of `LETTERS`, drawn by a hash of the number with
    `WEIGHTS` (the same number always has the same code)."""
    digest = hashlib.sha256(f"rft-hpc codebook {account}".encode()).digest()
    draw = int.from_bytes(digest[:8], "big") % sum(WEIGHTS)
    for letter, weight in zip(LETTERS, WEIGHTS, strict=True):
        if draw < weight:
            return letter
        draw -= weight
    raise AssertionError("unreachable: draw < sum(WEIGHTS)")


def lookup_tasks(digits: int = 4, train_size: int = 5000, eval_size: int = 500,
                 seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, eval): `train_size` and `eval_size` distinct accounts of `digits` digits,
    drawn by a seeded RNG; no account is in both lists, and the same arguments always give
    the same lists. The answer is the account's code; `info.tool_calls` is
    `[{"name": "lookup", "arguments": {"account": n}}]`."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
    if train_size + eval_size > hi - lo:
        raise ValueError(f"{train_size} + {eval_size} accounts asked of {hi - lo} "
                         f"{digits}-digit numbers")
    rng = random.Random(seed)
    accounts = rng.sample(range(lo, hi), train_size + eval_size)
    tasks = [Task(task_id=f"account-{n}", prompt=f"What is the code of account {n}?",
                  answer=account_code(n), taskset=f"lookup{digits}",
                  info={"tool_calls": [{"name": TOOL, "arguments": {"account": n}}]})
             for n in accounts]
    return tasks[eval_size:], tasks[:eval_size]
