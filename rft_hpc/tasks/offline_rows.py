"""Offline SFT and DPO examples from the rows of a data source (JSONL, Parquet, a `datasets`
folder) through a key mapping, as text: the prompt, to be rendered by the run's prompt
format, and the responses trained on (docs/data.md). `rft_hpc.buffer.offline` turns them
into buffer records.

- SFT: a prompt (or messages) column and a response column; or a messages column holding
  the whole conversation, whose last message, the assistant's, is the response.
- DPO, layout `pairs`: a prompt (or messages) column, a chosen and a rejected column, and
  optionally a margin column (kept in `info["margin"]`).
- DPO, layout `webgpt` (WebGPT's comparisons): a question, two answers and a score each;
  the higher-scored answer is chosen, the score difference is the margin, ties are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from rft_hpc.config.tasks import DataSourceFields
from rft_hpc.core.errors import UserError
from rft_hpc.core.json_types import JSONObject
from rft_hpc.tasks import columns as col
from rft_hpc.tasks.rows import Rows, raise_errors, read_rows
from rft_hpc.tasks.task import Task

KINDS = ("sft", "dpo")
LAYOUTS = ("pairs", "webgpt")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineExample:
    """One row of offline data, before tokenization."""

    kind: str
    """`sft` or `dpo`."""

    prompt: Task
    """The prompt (its text, or the chat messages before the response) with the row's id,
    task set and other columns (`info`), as `tasks.prompts.prompt_ids` renders it."""

    responses: tuple[str, ...]
    """SFT: `(response,)`; DPO: `(chosen, rejected)`."""


def load_offline_examples(source: DataSourceFields, kind: str, taskset: str | None = None,
                          layout: str = "pairs") -> list[OfflineExample]:
    """Every example of `source` (its split and rows) for records of `kind` (`sft`, `dpo`),
    its DPO rows in `layout` (`pairs`, or `webgpt`: see `webgpt_examples`). An example's id
    is its `task_id` column or `<file stem>[-<split>]-<row number>`, its task set the
    `taskset` column, or `taskset`, or the file stem; the other columns go into its `info`,
    and with `keys.margin` set a DPO pair's margin (a number) goes into `info["margin"]`. A
    column the source lacks, or any row with a value missing, of the wrong type or empty (a
    response), or a conversation that does not end with the assistant's message, raises one
    `UserError` naming the file and row (line, for JSONL) and column of each."""
    if kind not in KINDS:
        raise ValueError(f"offline data kind must be one of {KINDS}, got {kind!r}")
    if layout not in LAYOUTS or (layout == "webgpt" and kind != "dpo"):
        raise ValueError(f"layout must be one of {LAYOUTS} (webgpt with kind dpo), got "
                         f"{layout!r} with kind {kind!r}")
    rows = read_rows(source.path, source.split, source.rows)
    if layout == "webgpt":
        return webgpt_examples(rows, source, taskset)
    keys = source.keys
    messages_col = keys.messages or "messages"
    prompt_col = col.pick_column(rows, keys.prompt, messages_col, keys.messages is not None)
    chat = prompt_col == messages_col
    col.require_columns(rows, "conversation" if chat and kind == "sft" else "prompt",
                        prompt_col, *([messages_col] if not chat else []))
    answers = ((keys.chosen, keys.rejected) if kind == "dpo"
               else () if chat else (keys.response,))
    roles = ("chosen response", "rejected response") if kind == "dpo" else ("response",)
    for role, column in zip(roles, answers, strict=False):
        col.require_columns(rows, role, column)
    margin_col = keys.margin if kind == "dpo" else None
    if margin_col is not None:
        col.require_columns(rows, "margin", margin_col)
    name = taskset or source.path.stem
    used = (prompt_col, *answers, keys.task_id, "taskset", *([margin_col] if margin_col else []))
    examples, errors = [], []
    for i, row in enumerate(rows.rows):
        try:
            info = col.info(row, used)
            if margin_col is not None:
                info["margin"] = col.number(row, margin_col)
            examples.append(_example(row, kind, prompt_col, chat, answers, keys.task_id,
                                     _default_id(source, rows, i), name, info))
        except col.RowError as exc:
            errors.append(f"{rows.place(i)}: {exc}")
    raise_errors(errors, f"bad {kind.upper()} row(s)")
    if not examples:
        raise UserError(f"{rows.where} holds no {kind.upper()} rows")
    return examples


def webgpt_examples(rows: Rows, source: DataSourceFields,
                    taskset: str | None = None) -> list[OfflineExample]:
    """DPO examples of rows in WebGPT's comparisons layout, read through `source.keys`
    (`question`: text, or a mapping with the text in `full_text`; `answer_0`, `answer_1`:
    text; `score_0`, `score_1`: numbers). The higher-scored answer is chosen, and the score
    difference goes into `info["margin"]`; a tie (equal scores) has nothing to prefer and is
    skipped, the skipped rows counted in one log message. Ids, task sets and `info` as
    `load_offline_examples` gives them. A column the source lacks, or any row with a value
    missing or of the wrong type, raises one `UserError` naming the file, row and column of
    each; so does a source of ties only."""
    keys = source.keys
    answers, scores = (keys.answer_0, keys.answer_1), (keys.score_0, keys.score_1)
    for role, column in (("question", keys.question), ("first answer", answers[0]),
                         ("second answer", answers[1]), ("first answer's score", scores[0]),
                         ("second answer's score", scores[1])):
        col.require_columns(rows, role, column)
    name = taskset or source.path.stem
    used = (keys.question, *answers, *scores, keys.task_id, "taskset")
    examples, errors, ties = [], [], 0
    for i, row in enumerate(rows.rows):
        try:
            question = _question(row, keys.question)
            texts = (_response(row, answers[0]), _response(row, answers[1]))
            values = (col.number(row, scores[0]), col.number(row, scores[1]))
            if values[0] == values[1]:
                ties += 1
                continue
            if texts[0] == texts[1]:
                raise col.RowError(f"columns {answers[0]!r} and {answers[1]!r} hold the same "
                                   "answer with different scores")
            best = 0 if values[0] > values[1] else 1
            info = {**col.info(row, used), "margin": abs(values[0] - values[1])}
            # the row with the question as text and the answers in preference order
            pair = {**row, keys.question: question, "chosen": texts[best],
                    "rejected": texts[1 - best]}
            examples.append(_example(pair, "dpo", keys.question, False, ("chosen", "rejected"),
                                     keys.task_id, _default_id(source, rows, i), name, info))
        except col.RowError as exc:
            errors.append(f"{rows.place(i)}: {exc}")
    raise_errors(errors, "bad WebGPT comparison row(s)")
    if ties:
        log.info("%s: %d tied comparison(s) skipped (equal scores: nothing to prefer), %d "
                 "preference pair(s) read", rows.where, ties, len(examples))
    if not examples:
        raise UserError(f"{rows.where} holds no preference pairs" + (
            f": all {ties} comparison(s) are ties" if ties else ""))
    return examples


def _default_id(source: DataSourceFields, rows: Rows, i: int) -> str:
    """`<file stem>[-<split>]-<row number>` (JSONL: the line) of row `i`."""
    prefix = f"{source.path.stem}-{source.split}" if source.split else source.path.stem
    return f"{prefix}-{rows.lines[i] if rows.lines is not None else rows.start + i}"


def _question(row: Mapping[str, object], column: str) -> str:
    """The question in `column`: a string, or a mapping's `full_text` string (WebGPT)."""
    value = row.get(column)
    if isinstance(value, dict):
        text = value.get("full_text")
        if not isinstance(text, str):
            raise col.RowError(f"column {column!r} holds a mapping without a string "
                               f"'full_text' (keys: {', '.join(map(str, value)) or 'none'})")
        return text
    return col.text(row, column)


def _example(row: Mapping[str, object], kind: str, prompt_col: str, chat: bool,
             answers: tuple[str, ...], id_col: str, default_id: str, taskset: str,
             info: JSONObject) -> OfflineExample:
    ident = row.get(id_col)
    if ident is not None and not isinstance(ident, str | int):
        raise col.RowError(f"column {id_col!r} holds {col.type_name(ident)}, expected a "
                           "string or an integer")
    if row.get("taskset") is not None:
        taskset = col.text(row, "taskset")
    messages = col.messages(row, prompt_col) if chat else None
    responses = tuple(_response(row, column) for column in answers)
    if messages is not None and kind == "sft":
        messages, last = _conversation(messages, prompt_col)
        responses = (last,)
    if kind == "dpo" and responses[0] == responses[1]:
        raise col.RowError(f"columns {answers[0]!r} and {answers[1]!r} hold the same "
                           "response: a pair has nothing to prefer")
    prompt = Task(task_id=str(ident) if ident is not None else default_id,
                  prompt="" if chat else col.text(row, prompt_col), messages=messages,
                  taskset=taskset, info=info)
    return OfflineExample(kind, prompt, responses)


def _response(row: Mapping[str, object], column: str) -> str:
    value = col.text(row, column)
    if not value.strip():
        raise col.RowError(f"column {column!r} is empty: a response must have text to "
                           "train on")
    return value


def _conversation(messages: list[dict[str, str]],
                  column: str) -> tuple[list[dict[str, str]], str]:
    """The messages before the last one, and the last one's text, which must be the
    assistant's and not empty (the response trained on)."""
    last = messages[-1]
    where = f"column {column!r}, message {len(messages) - 1}"
    if last["role"] != "assistant":
        raise col.RowError(f"{where}: the conversation ends with a {last['role']!r} message; "
                           "for SFT it must end with the assistant's (the response trained on)")
    if not last["content"].strip():
        raise col.RowError(f"{where}: the assistant's response is empty")
    return messages[:-1], last["content"]
