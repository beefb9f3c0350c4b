"""`rft-hpc data ...`: write task data sets locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import typer

from rft_hpc.core.console import console
from rft_hpc.core.errors import UserError

app = typer.Typer(help="Write task data sets locally.", no_args_is_help=True)


@app.command("wordproblems")
def wordproblems(
    out: Path = typer.Option(..., "--out", help="Folder to write train.parquet and "
                             "test.parquet to."),
    train: int = typer.Option(4000, "--train", min=1, help="Training problems."),
    test: int = typer.Option(500, "--test", min=1, help="Held-out problems (no question "
                             "of them is in the training file)."),
    seed: int = typer.Option(0, "--seed", help="Seed: the same seed writes the same files."),
    max_value: int = typer.Option(9, "--max-value", min=1, help="Largest operand (and, for "
                                  "subtraction, result)."),
    ops: str = typer.Option("+-", "--ops", help="Operations to draw from: + and/or -."),
) -> None:
    """Write a word-problem task set in the GSM8K layout: Parquet files with the columns
    `question` and `answer` (a worked line, then `#### N`), for `tasks: {type: file, keys:
    {prompt: question, answer: answer}, reward: math_verify}`."""
    from rft_hpc.tasks.wordproblems import write_word_problems

    try:
        paths = write_word_problems(out, train=train, test=test, seed=seed,
                                    max_value=max_value, ops=ops)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    console.print(f"{train} training and {test} held-out word problems written to "
                  f"{paths[0]} and {paths[1]}")
