"""Generated arithmetic tasks (`a+b=` -> `c`) with a held-out evaluation split."""

from __future__ import annotations

import random

from rft_hpc.tasks.task import Task


def arithmetic_tasks(digits: int = 2, ops: str = "+", eval_size: int = 500,
                     seed: int = 0) -> tuple[list[Task], list[Task]]:
    """All `digits`-digit problems for each operator in `ops`, split into (train, eval).

    The split is a seeded shuffle: the same arguments always give the same two lists, and no
    problem is in both.
    """
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
    tasks = []
    for op in ops:
        for a in range(lo, hi):
            for b in range(lo, hi):
                if op == "-" and b > a:
                    continue
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                tasks.append(Task(task_id=f"{a}{op}{b}", prompt=f"{a}{op}{b}=",
                                  answer=str(answer), taskset=f"arith{digits}"))
    if eval_size >= len(tasks):
        raise ValueError(f"eval_size {eval_size} leaves no training tasks of {len(tasks)}")
    random.Random(seed).shuffle(tasks)
    return tasks[eval_size:], tasks[:eval_size]
