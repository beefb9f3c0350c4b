"""Generated products of `digits`-digit numbers (`What is 123*456?` -> `56088`): a task a
tiny model cannot do alone but can with a `multiply` tool (`rft_hpc.envs.calculator`). Each
task carries the call that solves it in `info.tool_calls`, from which an SFT stage builds
its demonstrations of tool use (`rft_hpc.envs.tool_demos`, docs/agents.md)."""

from __future__ import annotations

import random

from rft_hpc.tasks.task import Task

TOOL = "multiply"
"""The tool the tasks' demonstrations call (`rft_hpc.envs.calculator:multiply`)."""


def product_tasks(digits: int = 3, train_size: int = 5000, eval_size: int = 500,
                  seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, eval): `train_size` and `eval_size` distinct problems `a*b` with
    `digits`-digit a and b, drawn by a seeded RNG; no problem is in both lists, and the same
    arguments always give the same lists. The answer is the product; `info.tool_calls` is
    `[{"name": "multiply", "arguments": {"a": a, "b": b}}]`."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    space = (hi - lo + 1) ** 2
    if train_size + eval_size > space:
        raise ValueError(f"{train_size} + {eval_size} problems asked of {space} "
                         f"{digits}-digit products")
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < train_size + eval_size:
        pairs[(rng.randint(lo, hi), rng.randint(lo, hi))] = None
    tasks = [Task(task_id=f"{a}*{b}", prompt=f"What is {a}*{b}?", answer=str(a * b),
                  taskset=f"products{digits}",
                  info={"tool_calls": [{"name": TOOL, "arguments": {"a": a, "b": b}}]})
             for a, b in pairs]
    return tasks[eval_size:], tasks[:eval_size]
