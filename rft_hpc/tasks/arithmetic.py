"""Generated arithmetic tasks (`a+b=` -> `c`) with a held-out evaluation split."""

from __future__ import annotations

import random

from rft_hpc.tasks.task import Task


def arithmetic_tasks(digits: int = 2, ops: str = "+", eval_size: int = 500,
                     seed: int = 0) -> tuple[list[Task], list[Task]]:
    """All `digits`-digit problems for each operator in `ops`, split into (train, eval);
    each task's `info.difficulty` is `difficulty(a, op, b)`.

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
                                  answer=str(answer), taskset=f"arith{digits}",
                                  info={"difficulty": difficulty(a, op, b)}))
    if eval_size >= len(tasks):
        raise ValueError(f"eval_size {eval_size} leaves no training tasks of {len(tasks)}")
    random.Random(seed).shuffle(tasks)
    return tasks[eval_size:], tasks[:eval_size]


def difficulty(a: int, op: str, b: int) -> int:
    """How hard `a<op>b` is: carries of `+`, borrows of `-`, digits of the product for `*`."""
    if op == "*":
        return len(str(a * b))
    steps, carry = 0, 0
    while a or b:
        da, db = a % 10, b % 10
        carry = int(da + db + carry >= 10) if op == "+" else int(da - db - carry < 0)
        steps += carry
        a, b = a // 10, b // 10
    return steps
