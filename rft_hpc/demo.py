"""The demo that `rft-hpc demo` runs: for now, a round trip through the experience buffer.

It builds a tokenizer locally, generates two-digit addition data, writes rollouts from two
explorer writers and imports SFT and DPO data, reads everything back with the trainer's
reader, and checks that import -> export -> import reproduces every record.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from rft_hpc.buffer.check import summarize_buffer, verify_buffer
from rft_hpc.buffer.jsonl import export_jsonl, import_jsonl, iter_segments
from rft_hpc.buffer.reader import BufferReader
from rft_hpc.buffer.records import Experience
from rft_hpc.buffer.segment import read_segment
from rft_hpc.buffer.writer import SegmentWriter
from rft_hpc.models.tokenizer import build_char_tokenizer
from rft_hpc.rundir import RunDir


@dataclass
class DemoResult:
    """What the demo measured."""

    run_dir: Path
    records_read: int
    records_written: int
    round_trip_records: int
    round_trip_identical: bool
    corrupt_segments: int

    @property
    def ok(self) -> bool:
        return (self.round_trip_identical and self.corrupt_segments == 0
                and self.records_read == self.records_written)


def addition_lines(n: int, seed: int) -> list[dict[str, object]]:
    """`n` SFT lines `{"prompt": "a+b=", "response": "c"}` with two-digit a and b."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        lines.append({"prompt": f"{a}+{b}=", "response": str(a + b), "task_id": f"add-{i}",
                      "taskset": "add2"})
    return lines


def _write_jsonl(path: Path, lines: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _buffer_records(buffer: Path) -> list[tuple[str, object]]:
    return [(r.kind, r) for _, p in iter_segments(buffer) for r in read_segment(p).records()]


def buffer_round_trip(run_dir: Path, *, explorers: int = 2, steps: int = 5,
                      seed: int = 0) -> DemoResult:
    """Run the buffer demo in `run_dir` (created if needed) and report what it found."""
    run = RunDir(run_dir).create()
    tokenizer = build_char_tokenizer(run.root / "tokenizer")
    data = run.root / "data"
    sft = _write_jsonl(data / "sft.jsonl", addition_lines(256, seed))
    dpo = _write_jsonl(data / "dpo.jsonl", [
        {"prompt": x["prompt"], "chosen": x["response"], "rejected": str(int(x["response"]) + 1)}
        for x in addition_lines(64, seed + 1)])

    written = 0
    rng = random.Random(seed)
    for e in range(explorers):
        writer = SegmentWriter(run.buffer, f"explorer-{e}", "rl")
        for step in range(writer.next_step, steps):
            group = [Experience(tokens=[rng.randrange(4, 100) for _ in range(12)],
                                prompt_length=6, reward=float(rng.random() < 0.5),
                                group_id=step, task_id=f"e{e}-s{step}", policy_version=step,
                                step=step) for _ in range(8)]
            writer.write_step(step, group)
        written += 8 * writer.next_step
    for src, kind in ((sft, "sft"), (dpo, "dpo")):
        if not (run.buffer / f"import-{src.stem}").exists():
            import_jsonl(src, kind, run.buffer, tokenizer=tokenizer)
    written += 256 + 64

    reader = BufferReader(run.buffer)
    reader.poll()
    read = len(reader.take(10**9))

    exported = export_jsonl(run.buffer, data / "export.jsonl")
    again = run.root / "roundtrip-buffer"
    if not again.exists():
        for kind in ("rl", "sft", "dpo"):
            lines = [line for line in (data / "export.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == kind]
            part = _write_jsonl(data / f"export-{kind}.jsonl", [json.loads(x) for x in lines])
            import_jsonl(part, kind, again, writer=f"roundtrip-{kind}")
    identical = (sorted(_buffer_records(run.buffer), key=_key)
                 == sorted(_buffer_records(again), key=_key))
    corrupt = len(verify_buffer(run.buffer).problems)
    return DemoResult(run.root, read, written, exported, identical, corrupt)


def _key(item: tuple[str, object]) -> tuple[str, str, float]:
    kind, r = item
    return kind, r.task_id, r.created  # type: ignore[attr-defined]


__all__ = ["DemoResult", "addition_lines", "buffer_round_trip", "summarize_buffer"]
