"""The generated word-problem task set: GSM8K's layout, seeded, no held-out question in
the training file, every answer right by the math verifier, and the command that writes it."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from helpers.paths import ROOT

from rft_hpc.tasks.math_reward import math_verify
from rft_hpc.tasks.task import Task
from rft_hpc.tasks.wordproblems import word_problems


def test_problems_are_seeded_distinct_and_their_answers_verify() -> None:
    train, test = word_problems(300, 100, seed=3)
    assert (train, test) == word_problems(300, 100, seed=3)
    assert word_problems(300, 100, seed=4) != (train, test)
    questions = [p.question for p in train + test]
    assert len(train) == 300 and len(test) == 100 and len(set(questions)) == 400
    for p in train + test:
        a, op, b, value = re.fullmatch(r"(\d+)([+-])(\d+)=(\d+)\n#### \4", p.answer).groups()
        assert int(value) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert f" {a} " in p.question and f" {b}" in p.question
        task = Task(task_id="t", prompt=p.question, answer=p.answer)
        assert math_verify(task, p.answer) == 1.0
        assert math_verify(task, p.answer.split("\n")[0] + f"\n#### {int(value) + 1}") == 0.0


def test_too_many_problems_for_the_templates_is_an_error() -> None:
    with pytest.raises(ValueError, match="distinct problems"):
        word_problems(5000, 0, max_value=1, ops="+")


def test_the_command_writes_gsm8k_layout_parquet(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "data", "wordproblems",
                           "--out", str(tmp_path), "--train", "50", "--test", "20"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    train = pq.read_table(tmp_path / "train.parquet")
    test = pq.read_table(tmp_path / "test.parquet")
    assert train.column_names == test.column_names == ["question", "answer"]
    assert (train.num_rows, test.num_rows) == (50, 20)
    assert all(re.fullmatch(r"\d+[+-]\d+=(\d+)\n#### \1", a)
               for a in train.column("answer").to_pylist())
    bad = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "data", "wordproblems",
                          "--out", str(tmp_path / "x"), "--ops", "*"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "ops must be made of" in bad.stderr
    assert "Traceback" not in bad.stderr
