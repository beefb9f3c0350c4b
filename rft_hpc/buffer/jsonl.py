"""JSONL import and export of buffer records (docs/buffer-format.md, "JSONL").

Import reads a whole file and checks every line before writing anything: a malformed line
is reported with its line number and nothing is half-written (segments are staged under a
temporary folder and the writer folder appears by one rename). Export writes every record in
token form, which import reads back without a tokenizer: import -> export -> import gives
the same records.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rft_hpc.buffer.archive import list_writer
from rft_hpc.buffer.layout import ensure_buffer_dir, open_buffer_dir, writer_names
from rft_hpc.buffer.records import DPOPair, Experience, Record, SFTSample
from rft_hpc.buffer.segment import CorruptSegment, read_segment
from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.core.errors import UserError
from rft_hpc.core.rundir import TEMP_PREFIX, fsync_dir

KINDS = ("sft", "dpo", "rl")
MAX_REPORTED_ERRORS = 10

_COMMON = {"kind", "task_id", "taskset", "info", "created"}
_TEXT_FIELDS = {
    "sft": ({"prompt", "response"}, set()),
    "rl": ({"prompt", "response", "reward"}, {"group_id", "policy_version", "step", "priority"}),
    "dpo": ({"prompt", "chosen", "rejected"}, set()),
}
_TOKEN_FIELDS = {
    "sft": ({"tokens", "prompt_length"}, {"response_mask"}),
    "rl": ({"tokens", "prompt_length", "reward"},
           {"response_mask", "logprobs", "group_id", "policy_version", "step", "priority",
            "teacher_logprobs"}),
    "dpo": ({"chosen_tokens", "rejected_tokens", "prompt_length"}, set()),
}


class LineError(ValueError):
    """What is wrong with one JSONL line (the caller adds file and line number)."""


@dataclass
class ImportResult:
    """What `import_jsonl` wrote."""

    writer_dir: Path
    records: int
    segments: int


class _Encoder:
    """Turns text into token ids with a local Hugging Face tokenizer."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise UserError(f"cannot load a tokenizer from {path}: {exc}") from exc
        self.eos = self.tok.eos_token_id

    def prompt(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def response(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return ids + ([self.eos] if self.eos is not None else [])


def _check_keys(obj: Mapping[str, object], kind: str, tokenized: bool) -> None:
    required, optional = (_TOKEN_FIELDS if tokenized else _TEXT_FIELDS)[kind]
    missing = sorted(required - obj.keys())
    if missing:
        form = "token" if tokenized else "text"
        raise LineError(f"missing field(s) {', '.join(missing)} for a {kind} record in "
                        f"{form} form")
    unknown = sorted(obj.keys() - required - optional - _COMMON)
    if unknown:
        raise LineError(f"unknown field(s) {', '.join(unknown)} for a {kind} record")
    if obj.get("kind", kind) != kind:
        raise LineError(f"line is a {obj['kind']!r} record, importing --kind {kind}")


# -> Any: the value's type is checked against `typ` at run time, which a checker cannot follow
def _get(obj: Mapping[str, object], key: str, typ: type | tuple[type, ...],
         default: object = None) -> Any:
    if key not in obj:
        return default
    value = obj[key]
    ok = isinstance(value, typ) and not (isinstance(value, bool) and bool not in _tuple(typ))
    if not ok:
        names = " or ".join(t.__name__ for t in _tuple(typ))
        raise LineError(f"field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def _int_list(obj: Mapping[str, object], key: str) -> list[int] | None:
    value = _get(obj, key, list)
    if value is not None and not all(isinstance(v, int) and not isinstance(v, bool)
                                     for v in value):
        raise LineError(f"field {key!r} must be a list of integers")
    return value


def _float_list(obj: Mapping[str, object], key: str) -> list[float] | None:
    value = _get(obj, key, list)
    if value is not None and not all(isinstance(v, int | float) and not isinstance(v, bool)
                                     for v in value):
        raise LineError(f"field {key!r} must be a list of numbers")
    return value


_NUM = (int, float)


def _common(obj: Mapping[str, object]) -> dict[str, Any]:
    out = {"task_id": _get(obj, "task_id", str, ""), "taskset": _get(obj, "taskset", str,
                                                                        "default"),
           "info": _get(obj, "info", dict, {})}
    if "created" in obj:
        out["created"] = float(_get(obj, "created", _NUM))
    return out


def line_to_record(kind: str, obj: object, encoder: Callable[[], _Encoder | None]) -> Record:
    """One parsed JSONL object as a record of `kind`; raises `LineError` if it is malformed."""
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    tokenized = "tokens" in obj or "chosen_tokens" in obj
    _check_keys(obj, kind, tokenized)
    common = _common(obj)
    try:
        if kind == "dpo":
            if tokenized:
                return DPOPair(_int_list(obj, "chosen_tokens"), _int_list(obj, "rejected_tokens"),
                               _get(obj, "prompt_length", int), **common)
            enc = _need(encoder)
            prompt = enc.prompt(_get(obj, "prompt", str))
            return DPOPair(prompt + enc.response(_get(obj, "chosen", str)),
                           prompt + enc.response(_get(obj, "rejected", str)), len(prompt),
                           **common)
        if tokenized:
            tokens, plen = _int_list(obj, "tokens"), _get(obj, "prompt_length", int)
            mask = _int_list(obj, "response_mask")
        else:
            enc = _need(encoder)
            prompt = enc.prompt(_get(obj, "prompt", str))
            tokens = prompt + enc.response(_get(obj, "response", str))
            plen, mask = len(prompt), None
        if kind == "sft":
            return SFTSample(tokens, plen, mask, **common)
        return Experience(tokens, plen, mask, logprobs=_float_list(obj, "logprobs"),
                          reward=float(_get(obj, "reward", _NUM)),
                          group_id=_get(obj, "group_id", int, 0),
                          policy_version=_get(obj, "policy_version", int, 0),
                          step=_get(obj, "step", int, 0),
                          priority=float(_get(obj, "priority", _NUM, 0.0)),
                          teacher_logprobs=_float_list(obj, "teacher_logprobs"), **common)
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, LineError):
            raise
        raise LineError(str(exc)) from exc


def _need(encoder: Callable[[], _Encoder | None]) -> _Encoder:
    enc = encoder()
    if enc is None:
        raise LineError("text fields need a tokenizer: pass --tokenizer PATH "
                        "(or give token ids)")
    return enc


def read_jsonl_records(src: Path, kind: str, tokenizer: Path | None = None) -> list[Record]:
    """Parse and check every line of `src`; raise one `UserError` listing the bad lines."""
    if kind not in KINDS:
        raise UserError(f"unknown kind {kind!r}: use one of {', '.join(KINDS)}")
    if not src.is_file():
        raise UserError(f"{src} does not exist or is not a file")
    cache: list[_Encoder | None] = []

    def encoder() -> _Encoder | None:
        if not cache:
            cache.append(_Encoder(tokenizer) if tokenizer is not None else None)
        return cache[0]

    records: list[Record] = []
    errors: list[str] = []
    with src.open(encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(_lines(src, f), start=1):
            if not line.strip():
                continue
            try:
                records.append(line_to_record(kind, json.loads(line), encoder))
            except json.JSONDecodeError as exc:
                errors.append(f"{src}, line {lineno}: not valid JSON: {exc.msg} "
                              f"(column {exc.colno})")
            except LineError as exc:
                errors.append(f"{src}, line {lineno}: {exc}")
    if errors:
        more = len(errors) - MAX_REPORTED_ERRORS
        shown = errors[:MAX_REPORTED_ERRORS] + ([f"... and {more} more"] if more > 0 else [])
        raise UserError(f"{len(errors)} bad line(s), nothing imported:\n" + "\n".join(shown))
    if not records:
        raise UserError(f"{src} holds no records")
    return records


def _lines(src: Path, f: Iterable[str]) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError as exc:
        raise UserError(f"{src} is not UTF-8 text: {exc}") from exc


def import_jsonl(src: Path, kind: str, out: Path, *, tokenizer: Path | None = None,
                 writer: str | None = None, records_per_segment: int = 4096) -> ImportResult:
    """Import a JSONL file as a new writer folder of the buffer `out`, all or nothing."""
    records = read_jsonl_records(src, kind, tokenizer)
    return write_new_writer(records, kind, out, writer or f"import-{src.stem}",
                            records_per_segment=records_per_segment)


def write_new_writer(records: Sequence[Record], kind: str, out: Path, writer: str, *,
                     records_per_segment: int = 4096) -> ImportResult:
    """Write `records` as the new writer folder `out/<writer>`, which appears whole or not
    at all (segments are staged in a temporary folder, then moved by one rename)."""
    ensure_buffer_dir(out)
    final = out / writer
    if final.exists():
        raise UserError(f"{final} already exists: import into another buffer or pass --writer")
    stage = out / f"{TEMP_PREFIX}{writer}.{os.getpid()}"
    try:
        w = SegmentWriter(stage, writer, kind)
        for step, i in enumerate(range(0, len(records), records_per_segment)):
            w.write_step(step, records[i:i + records_per_segment])
        os.rename(stage / writer, final)
        fsync_dir(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ImportResult(final, len(records), w.committed_step)


def record_to_json(record: Record) -> dict[str, Any]:
    """A record in token form: the line `export_jsonl` writes and `import_jsonl` reads."""
    out: dict[str, Any] = {"kind": record.kind}
    if isinstance(record, DPOPair):
        out.update(chosen_tokens=record.chosen_tokens.tolist(),
                   rejected_tokens=record.rejected_tokens.tolist())
    else:
        out.update(tokens=record.tokens.tolist(), response_mask=record.response_mask.tolist())
    out["prompt_length"] = record.prompt_length
    if isinstance(record, Experience):
        if np.all(np.isfinite(record.logprobs)):
            out["logprobs"] = record.logprobs.tolist()
        if record.teacher_logprobs is not None:
            out["teacher_logprobs"] = record.teacher_logprobs.tolist()
        out.update(reward=record.reward, group_id=record.group_id,
                   policy_version=record.policy_version, step=record.step,
                   priority=record.priority)
    out.update(task_id=record.task_id, taskset=record.taskset, created=record.created,
               info=record.info)
    for key, value in out.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} is {value}, which JSON cannot hold")
    return out


def iter_segments(buffer: Path) -> Iterator[tuple[str, Path]]:
    """(writer, path) of every file to read: archives and the committed segments no archive
    holds, writers sorted, files by step. `read_segment` reads an archive as one segment
    (all its records); `archive.read_archive` splits it into the segments it holds."""
    for writer in writer_names(buffer):
        for _, name in list_writer(buffer / writer).files():
            yield writer, buffer / writer / name


def export_jsonl(buffer: Path, out: Path, *, warn: Callable[[str], None] = print) -> int:
    """Write every readable record of `buffer` to `out` (one JSON object per line).

    Corrupt segments are skipped with a warning. Returns the number of records written.
    The file appears complete or not at all.
    """
    open_buffer_dir(buffer)
    tmp = out.with_name(f"{TEMP_PREFIX}{out.name}.{os.getpid()}")
    count = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for _, path in iter_segments(buffer):
                try:
                    seg = read_segment(path)
                except CorruptSegment as exc:
                    warn(f"skipping {exc}")
                    continue
                for record in seg.records():
                    f.write(json.dumps(record_to_json(record), separators=(",", ":")) + "\n")
                    count += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return count
