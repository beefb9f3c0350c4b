"""A generated word-problem task set in the GSM8K layout, small enough that a ~1M-parameter
byte-level chat model learns it on a CPU in minutes.

Each row has a `question` (one sentence or two: a name, a count of objects and one addition
or subtraction of small numbers, in a handful of templates) and an `answer` written as GSM8K
writes its solutions: a short worked line, then `#### N` (`3+4=7\\n#### 7`). The files are
Parquet with exactly those two columns (not rft-hpc's default `prompt`), so a config reads
them with `keys: {prompt: question, answer: answer}` and scores them with `math_verify`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NAMES = ("Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo")
OBJECTS = ("apples", "pens", "books", "cards", "shells", "coins", "eggs", "hats")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": ("{n} has {a} {o}. {n} gets {b} more. How many {o} now?",
          "{n} had {a} {o} and found {b} more. How many {o}?",
          "{n} buys {a} {o}, then {b} more. How many {o} in all?"),
    "-": ("{n} has {a} {o}. {n} gives away {b}. How many {o} now?",
          "{n} had {a} {o} and lost {b}. How many {o} are left?",
          "{n} buys {a} {o}, then sells {b}. How many {o} are left?"),
}
"""Questions per operation: the verb says which one it is, the numbers come in order."""


@dataclass(frozen=True)
class WordProblem:
    """One problem: its question and its GSM8K-style answer."""

    question: str
    answer: str


def word_problem(rng: random.Random, max_value: int = 9, ops: str = "+-") -> WordProblem:
    """One problem drawn with `rng`: an operation of `ops`, a name, an object, a template
    and numbers: `a+b` with a, b in 1..`max_value`, or `a-b` with b and the result in
    1..`max_value` (the sums' facts backwards)."""
    op = rng.choice(ops)
    a, b = rng.randint(1, max_value), rng.randint(1, max_value)
    if op == "-":
        a = a + b
    value = a + b if op == "+" else a - b
    question = rng.choice(TEMPLATES[op]).format(n=rng.choice(NAMES), o=rng.choice(OBJECTS),
                                                a=a, b=b)
    return WordProblem(question, f"{a}{op}{b}={value}\n#### {value}")


def word_problems(train: int, test: int, seed: int = 0, max_value: int = 9,
                  ops: str = "+-") -> tuple[list[WordProblem], list[WordProblem]]:
    """(train, test): `train` and `test` distinct problems, no question in both; the same
    arguments always give the same lists. Raises ValueError when the templates cannot make
    that many distinct questions."""
    unknown = set(ops) - set(TEMPLATES)
    if not ops or unknown:
        raise ValueError(f"ops must be made of {''.join(TEMPLATES)}, got {ops!r}")
    rng = random.Random(seed)
    seen: dict[str, WordProblem] = {}
    attempts = 0
    while len(seen) < train + test:
        attempts += 1
        if attempts > 50 * (train + test) + 1000:
            raise ValueError(f"only {len(seen)} distinct problems found, "
                             f"{train + test} asked for: lower --train/--test")
        problem = word_problem(rng, max_value, ops)
        seen.setdefault(problem.question, problem)
    problems = list(seen.values())
    return problems[test:], problems[:test]


def write_parquet(problems: Sequence[WordProblem], path: Path) -> Path:
    """`problems` as a Parquet file with the columns `question` and `answer`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": [p.question for p in problems],
                      "answer": [p.answer for p in problems]})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path


def write_word_problems(out: Path, train: int = 4000, test: int = 500, seed: int = 0,
                        max_value: int = 9, ops: str = "+-") -> tuple[Path, Path]:
    """Write `out/train.parquet` and `out/test.parquet` (`word_problems` of these arguments);
    returns their paths."""
    train_set, test_set = word_problems(train, test, seed, max_value, ops)
    return (write_parquet(train_set, out / "train.parquet"),
            write_parquet(test_set, out / "test.parquet"))
