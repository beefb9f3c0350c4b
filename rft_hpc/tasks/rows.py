"""Rows of a data source: a JSONL file, a Parquet file or a Hugging Face `datasets` folder
written by `save_to_disk`, optionally one split of it and a range of its rows.

Sources are read locally only: a `datasets` folder is opened with `load_from_disk` on a
local path, with the library's offline mode on, so that nothing reaches a hub.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rft_hpc.core.errors import UserError

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAX_REPORTED_ERRORS = 10


@dataclass
class Rows:
    """The rows read from one source, and where each came from (for messages)."""

    where: str
    """The source as messages name it: its path, and its split if one was chosen."""

    columns: list[str]
    """Column names of the source (JSONL: every key of any row, in order of appearance)."""

    rows: list[dict[str, object]]
    start: int
    """Index in the source of `rows[0]`."""

    lines: list[int] | None = None
    """JSONL only: the file line of each row."""

    def place(self, i: int) -> str:
        """Where row `i` of `rows` is: `FILE, line N` (JSONL) or `FILE, row N` (0-based)."""
        if self.lines is not None:
            return f"{self.where}, line {self.lines[i]}"
        return f"{self.where}, row {self.start + i}"


def read_rows(path: Path, split: str | None = None,
              rows: tuple[int, int] | None = None) -> Rows:
    """Read the rows `[start, stop)` of `rows` (all when None; a stop past the end takes
    the rows there are) of the source at `path`, its split `split` for a `datasets` folder.
    Raises one `UserError` naming the file for a missing or unreadable source, an unknown
    format, a split that is not there, or a range past the end."""
    if not path.exists():
        raise UserError(f"data source {path} does not exist")
    if path.is_dir():
        out = _read_datasets_folder(path, split, rows)
    elif split is not None:
        raise UserError(f"{path}: split {split!r} given, but only a datasets folder "
                        "(save_to_disk) has splits")
    elif path.suffix.lower() in PARQUET_SUFFIXES:
        out = _read_parquet(path, rows)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        out = _read_jsonl(path, rows)
    else:
        raise UserError(f"{path}: unknown data format; expected a .jsonl or .parquet file "
                        "or a folder written by datasets' save_to_disk")
    if not out.rows:
        raise UserError(f"{out.where} holds no rows" + (
            f" in rows [{rows[0]}, {rows[1]})" if rows is not None else ""))
    return out


def _span(rows: tuple[int, int] | None, total: int) -> tuple[int, int]:
    start, stop = rows if rows is not None else (0, total)
    return min(start, total), min(stop, total)


def _read_jsonl(path: Path, rows: tuple[int, int] | None) -> Rows:
    objs: list[dict[str, object]] = []
    lines: list[int] = []
    errors: list[str] = []
    start, stop = rows if rows is not None else (0, None)
    index = 0
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text: {exc}") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        index += 1
        if index - 1 < start or (stop is not None and index - 1 >= stop):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{path}, line {lineno}: not valid JSON: {exc.msg} "
                          f"(column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            errors.append(f"{path}, line {lineno}: expected a JSON object, got "
                          f"{type_name(obj)}")
            continue
        objs.append(obj)
        lines.append(lineno)
    raise_errors(errors)
    columns = list(dict.fromkeys(k for obj in objs for k in obj))
    return Rows(str(path), columns, objs, start, lines)


def _read_parquet(path: Path, rows: tuple[int, int] | None) -> Rows:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a file it cannot read
        raise UserError(f"{path}: cannot read it as Parquet: {exc}") from None
    start, stop = _span(rows, pf.metadata.num_rows)
    table = pf.read().slice(start, stop - start) if rows is not None else pf.read()
    return Rows(str(path), list(table.column_names), table.to_pylist(), start)


def _read_datasets_folder(path: Path, split: str | None, rows: tuple[int, int] | None) -> Rows:
    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        raise UserError(f"{path} is a folder, but not one written by datasets' save_to_disk "
                        "(no dataset_dict.json or state.json)")
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # a local folder only; never a hub
    import datasets

    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_from_disk(str(path.resolve()))
    except Exception as exc:  # the library raises several types for a folder it cannot read
        raise UserError(f"{path}: cannot read this datasets folder: {exc}") from None
    where = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None and len(splits) != 1:
            raise UserError(f"{path} holds the splits {', '.join(splits)}: choose one with "
                            "split")
        split = split if split is not None else splits[0]
        if split not in loaded:
            raise UserError(f"{path} has no split {split!r} (splits: {', '.join(splits)})")
        loaded, where = loaded[split], f"{path} [split {split}]"
    elif split is not None:
        raise UserError(f"{path} holds one dataset without splits; remove split {split!r}")
    start, stop = _span(rows, len(loaded))
    part = loaded.select(range(start, stop)) if rows is not None else loaded
    return Rows(where, list(loaded.column_names), part.to_list(), start)


def type_name(value: object) -> str:
    """How messages name the type of a value read from a source."""
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def raise_errors(errors: list[str], what: str = "bad row(s)") -> None:
    """Raise one `UserError` listing `errors` (the first few, and how many more)."""
    if not errors:
        return
    more = len(errors) - MAX_REPORTED_ERRORS
    shown = errors[:MAX_REPORTED_ERRORS] + ([f"... and {more} more"] if more > 0 else [])
    raise UserError(f"{len(errors)} {what}:\n" + "\n".join(shown))
