"""Typed values out of the rows of a data source, by the columns a key mapping names.

Each getter raises `RowError` saying the column and what is wrong with its value; the
caller adds the file and row. A column the whole source lacks is reported once for the
source (`require_columns`), naming the columns there are.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence

from rft_hpc.core.errors import UserError
from rft_hpc.core.json_types import JSONObject, JSONValue
from rft_hpc.tasks.rows import Rows, type_name


class RowError(ValueError):
    """What is wrong with one row (the caller adds file and row)."""


def require_columns(rows: Rows, what: str, *columns: str) -> None:
    """A `UserError` when the source has none of its rows with column `columns[0]`
    (alternatives after it: the first that is there wins, checked by `pick_column`)."""
    if not any(c in rows.columns for c in columns):
        alt = "".join(f" (or {c!r})" for c in columns[1:])
        raise UserError(f"{rows.where}: no column {columns[0]!r}{alt} for the {what}; the "
                        f"columns there are: {', '.join(rows.columns) or 'none'} (map yours "
                        "with keys, docs/data.md)")


def pick_column(rows: Rows, first: str, second: str, second_forced: bool) -> str:
    """The column to read: `first` if the source has it, else `second` if it has that;
    always `second` when `second_forced` (the user named it)."""
    if second_forced or (first not in rows.columns and second in rows.columns):
        return second
    return first


def _value(row: Mapping[str, object], column: str) -> object:
    if column not in row:
        raise RowError(f"no column {column!r} (the row has: {', '.join(row) or 'none'})")
    return row[column]


def text(row: Mapping[str, object], column: str) -> str:
    """The string in `column`."""
    value = _value(row, column)
    if not isinstance(value, str):
        raise RowError(f"column {column!r} holds {type_name(value)}, expected a string")
    return value


def answer_text(row: Mapping[str, object], column: str) -> str:
    """The reference answer in `column`: a string, or an integer as its decimal text."""
    value = _value(row, column)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise RowError(f"column {column!r} holds {type_name(value)}, expected a string "
                       "(or an integer)")
    return value


def number(row: Mapping[str, object], column: str) -> float:
    """The finite number in `column` (an integer or a float, not a boolean), as a float."""
    value = _value(row, column)
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        shown = f" {value}" if isinstance(value, float) else ""
        raise RowError(f"column {column!r} holds {type_name(value)}{shown}, expected a "
                       "finite number")
    return float(value)


def messages(row: Mapping[str, object], column: str) -> list[dict[str, str]]:
    """The chat messages in `column`: a non-empty list of `{role, content}` strings."""
    value = _value(row, column)
    if not isinstance(value, list | tuple) or not value:
        raise RowError(f"column {column!r} holds {type_name(value)}, expected a non-empty "
                       "list of {role, content} messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise RowError(f"column {column!r}, message {i}: expected a mapping with string "
                           f"role and content, got {_shape(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _shape(m: object) -> str:
    if not isinstance(m, dict):
        return type_name(m)
    return "{" + ", ".join(f"{k}: {type_name(v)}" for k, v in m.items()) + "}"


def info(row: Mapping[str, object], used: Sequence[str]) -> JSONObject:
    """The row's other columns (all but `used`), as JSON values; a column named `info`
    holding a mapping is merged in."""
    out: JSONObject = {}
    nested = row.get("info")
    if isinstance(nested, dict) and "info" not in used:
        out.update({str(k): jsonable(v) for k, v in nested.items()})
    for key, value in row.items():
        if key not in used and not (key == "info" and isinstance(value, dict)):
            out[str(key)] = jsonable(value)
    return out


def jsonable(value: object) -> JSONValue:
    """`value` as JSON can hold it: dates as ISO text, bytes as text, NaN as None, other
    unknown types as their text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
