"""Tasks from the rows of a data source (JSONL, Parquet, a `datasets` folder) through a
key mapping: the prompt (or chat messages) and answer columns it names, every other column
into the task's `info` (docs/data.md)."""

from __future__ import annotations

from rft_hpc.config.tasks import DataSourceFields
from rft_hpc.core.errors import UserError
from rft_hpc.tasks import columns as col
from rft_hpc.tasks.rows import raise_errors, read_rows
from rft_hpc.tasks.task import Task

SPECIAL = ("reward", "taskset")
"""Columns a task row may carry besides the mapped ones: its reward name and task set."""


def load_tasks(source: DataSourceFields, taskset: str | None = None) -> list[Task]:
    """Every task of `source` (its split and rows). A task's id is its `task_id` column or
    `<file stem>[-<split>]-<row number>`, its task set the `taskset` column, or `taskset`,
    or the file stem. A column the source lacks, or any row whose value is missing or of the
    wrong type, raises one `UserError` naming the file and row (line, for JSONL) of each."""
    rows = read_rows(source.path, source.split, source.rows)
    keys = source.keys
    messages_col = keys.messages or "messages"
    prompt_col = col.pick_column(rows, keys.prompt, messages_col, keys.messages is not None)
    col.require_columns(rows, "prompt", prompt_col,
                        *([messages_col] if prompt_col == keys.prompt else []))
    col.require_columns(rows, "answer", keys.answer)
    chat = prompt_col == messages_col
    name = taskset or source.path.stem
    prefix = f"{source.path.stem}-{source.split}" if source.split else source.path.stem
    used = (prompt_col, keys.answer, keys.task_id, *SPECIAL)
    tasks, errors = [], []
    for i, row in enumerate(rows.rows):
        number = rows.lines[i] if rows.lines is not None else rows.start + i
        try:
            ident = row.get(keys.task_id)
            if ident is not None and not isinstance(ident, str | int):
                raise col.RowError(f"column {keys.task_id!r} holds {col.type_name(ident)}, "
                                   "expected a string or an integer")
            extra = {k: col.text(row, k) for k in SPECIAL if row.get(k) is not None}
            tasks.append(Task(
                task_id=str(ident) if ident is not None else f"{prefix}-{number}",
                prompt="" if chat else col.text(row, prompt_col),
                messages=col.messages(row, prompt_col) if chat else None,
                answer=col.answer_text(row, keys.answer),
                reward=extra.get("reward", "exact_match"),
                taskset=extra.get("taskset", name), info=col.info(row, used)))
        except col.RowError as exc:
            errors.append(f"{rows.place(i)}: {exc}")
    raise_errors(errors, "bad task row(s)")
    if not tasks:
        raise UserError(f"{rows.where} holds no tasks")
    return tasks
