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


@app.command("preferences")
def preferences(
    out: Path = typer.Option(..., "--out", help="File to write: .jsonl, or .parquet."),
    rows: int = typer.Option(6000, "--rows", min=1, help="Comparisons (about one in six a "
                             "tie, which a reward-model stage skips)."),
    seed: int = typer.Option(0, "--seed", help="Seed: the same seed writes the same file."),
) -> None:
    """Write generated preference data in WebGPT's comparisons layout (`question`,
    `answer_0`, `answer_1`, `score_0`, `score_1`), scored by a hidden gold rule
    (docs/reward-models.md), for `data: {source: file, kind: dpo, layout: webgpt}`."""
    from rft_hpc.tasks.preferences import write_preference_file

    if out.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"--out {out}: write a .jsonl or a .parquet file")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_preference_file(out, rows, seed=seed)
    console.print(f"{rows} comparisons written to {out}")
