"""The reader's cursor: saved, loaded by a new process, it continues exactly; policy order."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest
from helpers.buffer_workers import (
    READER_MAX_PENDING,
    check_record,
    drain,
    parse_id,
    resume_drain_main,
    write_steps,
)

from rft_hpc.buffer import BufferConfig, BufferReader

WRITERS = ("a", "b")
STEPS = 10
PER_STEP = 8
BATCH = 8
PRIORITIES = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Case:
    """One sampler set-up for the cursor test."""

    config: dict[str, Any]
    opts_of: Callable[[int, int], dict[str, Any]] | None = None
    versioned: bool = False
    saved_after: int = 3  # batches taken before the cursor is saved


def _priority(step: int, i: int) -> dict[str, Any]:
    """Priorities spread over PRIORITIES, mixed within each step."""
    return {"pr": PRIORITIES[(step * 7 + i * 3) % len(PRIORITIES)]}


def _taskset(step: int, i: int) -> dict[str, Any]:
    """Half the records of each step are math, half code."""
    return {"ts": "math" if i % 2 == 0 else "code"}


def _version(step: int, i: int) -> dict[str, Any]:
    """Policy versions that lag the batch number by various amounts."""
    return {"pv": step // 2 + i % 3}


CASES = {
    "fifo": Case({"sampler": {"type": "fifo"}}),
    "priority": Case({"sampler": {"type": "priority"}, "max_uses": 2}, _priority,
                     saved_after=7),
    "mixture": Case({"sampler": {"type": "mixture", "weights": {"math": 3, "code": 1}}},
                    _taskset),
    "stale-drop": Case({"max_staleness": 1, "stale": "drop"}, _version, versioned=True),
    "stale-downweight": Case({"max_staleness": 1, "stale": "downweight", "stale_weight": 0.5},
                             _version, versioned=True),
}


def fill(buffer_dir: Path, opts_of: Callable[[int, int], dict[str, Any]] | None) -> None:
    """STEPS segments of PER_STEP records from each of WRITERS."""
    for w in WRITERS:
        write_steps(buffer_dir, range(STEPS), PER_STEP, writer=w, opts_of=opts_of)


def flat(batches: list[dict[str, Any]], key: str) -> list[Any]:
    """One field of every record handed out, in order."""
    return [x for b in batches for x in b[key]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cursor_continues_in_a_new_process(name: str, buffer_dir: Path, tmp_path: Path,
                                           mp: BaseContext) -> None:
    case = CASES[name]
    config = BufferConfig.model_validate(case.config)
    fill(buffer_dir, case.opts_of)

    def reader(**kw: Any) -> BufferReader:
        """A reader with the case's config and the tests' small max_pending."""
        return BufferReader(buffer_dir, config, max_pending=READER_MAX_PENDING, **kw)

    full = drain(reader(), BATCH, versioned=case.versioned)
    first_reader = reader()
    first = drain(first_reader, BATCH, max_batches=case.saved_after, versioned=case.versioned)
    state_file, out_file = tmp_path / "cursor.json", tmp_path / "rest.json"
    state_file.write_text(json.dumps(first_reader.state_dict()))
    proc = mp.Process(target=resume_drain_main, args=(
        str(buffer_dir), config.model_dump(), str(state_file), str(out_file), BATCH,
        case.saved_after, case.versioned))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    rest = json.loads(out_file.read_text())
    assert len(first) == case.saved_after and rest
    # Same refs, ids, weights and use counts, in the same order, as without the restart.
    assert first + rest == full
    CHECKS[name](full)


def check_exactly_once(batches: list[dict[str, Any]]) -> None:
    """Every record written was handed out exactly once."""
    refs = flat(batches, "refs")
    assert len(refs) == len(set(refs)) == len(WRITERS) * STEPS * PER_STEP


def check_priority(batches: list[dict[str, Any]]) -> None:
    """max_uses=2: each record twice, never twice in a batch, by decayed priority."""
    refs = flat(batches, "refs")
    uses = flat(batches, "uses")
    assert Counter(refs) == dict.fromkeys(set(refs), 2)  # max_uses=2: each exactly twice
    assert len(set(refs)) == len(WRITERS) * STEPS * PER_STEP
    first_use = {}
    for ref, use in zip(refs, uses, strict=True):
        assert use == (1 if ref in first_use else 0)
        first_use.setdefault(ref, use)
    for b in batches:
        assert len(b["refs"]) == len(set(b["refs"]))  # never twice in one batch
        # Within a batch, highest (decayed: x0.5 per earlier use) priority first.
        prios = [float(parse_id(i)["pr"]) * 0.5 ** u
                 for i, u in zip(b["ids"], b["uses"], strict=True)]
        assert prios == sorted(prios, reverse=True)
    assert float(parse_id(batches[0]["ids"][0])["pr"]) == max(PRIORITIES)


def check_mixture(batches: list[dict[str, Any]]) -> None:
    """Task sets handed out 3:1 while both have records."""
    check_exactly_once(batches)
    sets = [parse_id(i)["ts"] for i in flat(batches, "ids")]
    # While both task sets have records at hand (the first four batches here: supply is
    # 1:1, demand 3:1), every group of four holds three "math" and one "code".
    for k in range(0, 32, 4):
        assert Counter(sets[k:k + 4]) == {"math": 3, "code": 1}, sets[:32]


def check_stale_drop(batches: list[dict[str, Any]]) -> None:
    """Nothing handed out lags more than max_staleness; the rest was dropped."""
    handed = flat(batches, "refs")
    assert len(handed) == len(set(handed))
    dropped = sum(b["dropped"] for b in batches)
    assert dropped > 0 and handed
    assert len(handed) + dropped == len(WRITERS) * STEPS * PER_STEP
    for b in batches:
        for i in b["ids"]:
            assert b["version"] - int(parse_id(i)["pv"]) <= 1
        assert b["weights"] == [1.0] * len(b["ids"])


def check_stale_downweight(batches: list[dict[str, Any]]) -> None:
    """Every record handed out once, weighted 0.5 per version past the bound."""
    check_exactly_once(batches)
    assert sum(b["dropped"] for b in batches) == 0
    weights = []
    for b in batches:
        for i, w in zip(b["ids"], b["weights"], strict=True):
            lag = b["version"] - int(parse_id(i)["pv"])
            assert w == 0.5 ** max(0, lag - 1)
            weights.append(w)
    assert min(weights) < 1.0 and max(weights) == 1.0


CHECKS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "fifo": check_exactly_once, "priority": check_priority, "mixture": check_mixture,
    "stale-drop": check_stale_drop, "stale-downweight": check_stale_downweight}


# -- each policy's order -------------------------------------------------------------------


def ids_of(reader: BufferReader, n: int, policy_version: int | None = None
           ) -> tuple[list[str], Any]:
    """Take up to `n` records (content checked): short ids "<writer><step>.<index>", batch."""
    batch = reader.take(n, policy_version)
    for r in batch.records:
        check_record(r)
    return [f"{p['writer']}{p['step']}.{p['index']}"
            for p in (parse_id(r.task_id) for r in batch.records)], batch


def test_fifo_order_and_replay(buffer_dir: Path) -> None:
    for w in ("b", "a"):
        write_steps(buffer_dir, range(2), 2, writer=w)
    reader = BufferReader(buffer_dir, BufferConfig(max_uses=2))
    reader.poll()
    order = ["a0.0", "a0.1", "a1.0", "a1.1", "b0.0", "b0.1", "b1.0", "b1.1"]
    got, batch = ids_of(reader, 100)
    assert got == order and batch.uses == [0] * 8
    got, batch = ids_of(reader, 100)  # replays go to the back, in the same order
    assert got == order and batch.uses == [1] * 8
    assert ids_of(reader, 100)[0] == []
    # New segments come after everything already discovered.
    write_steps(buffer_dir, range(2, 3), 2, writer="a")
    reader.poll()
    assert ids_of(reader, 1)[0] == ["a2.0"]


def test_priority_order_with_decay(buffer_dir: Path) -> None:
    prios = [1.0, 0.5, 0.25]
    write_steps(buffer_dir, range(1), 3, opts_of=lambda s, i: {"pr": prios[i]})
    reader = BufferReader(buffer_dir, BufferConfig.model_validate(
        {"sampler": {"type": "priority", "reuse_decay": 0.5}, "max_uses": 2}))
    reader.poll()
    order, uses = [], []
    for _ in range(7):
        got, batch = ids_of(reader, 1)
        order += got
        uses += batch.uses
    # r0 (1.0) -> requeued at 0.5, after r1 (0.5, older) -> r0 -> r2 (0.25, older than
    # r1's requeued 0.25) -> r1 -> r2 at 0.125; then nothing.
    assert order == ["w00.0", "w00.1", "w00.0", "w00.2", "w00.1", "w00.2"]
    assert uses == [0, 0, 1, 0, 1, 1]


def test_priority_ties_in_commit_order(buffer_dir: Path) -> None:
    write_steps(buffer_dir, range(3), 2, opts_of=lambda s, i: {"pr": 1.0 if s == 1 else 0.0})
    reader = BufferReader(buffer_dir, BufferConfig.model_validate(
        {"sampler": {"type": "priority"}}))
    reader.poll()
    assert ids_of(reader, 6)[0] == ["w01.0", "w01.1", "w00.0", "w00.1", "w02.0", "w02.1"]


def test_mixture_proportions(buffer_dir: Path) -> None:
    sets = ["math", "code", "other", "math"]
    write_steps(buffer_dir, range(10), 4, opts_of=lambda s, i: {"ts": sets[i]})
    reader = BufferReader(buffer_dir, BufferConfig.model_validate(
        {"sampler": {"type": "mixture", "weights": {"math": 3, "code": 1}}}))
    reader.poll()
    assert reader.counters["not_in_mixture"] == 10  # "other" is never handed out
    got = ids_of(reader, 100)[0]
    taken = [sets[int(g.split(".")[1])] for g in got]
    assert len(taken) == 30 and "other" not in taken
    # 20 math and 10 code records at hand, drawn 3:1 while both last: math runs out
    # after ceil(20 * 4 / 3) = 27 draws; the rest is code (a dry set stalls nothing).
    for k in range(0, 24, 4):
        assert Counter(taken[k:k + 4]) == {"math": 3, "code": 1}
    assert Counter(taken[:27]) == {"math": 20, "code": 7}
    assert taken[27:] == ["code"] * 3


@pytest.mark.parametrize("mode", ["drop", "downweight"])
def test_staleness(buffer_dir: Path, mode: str) -> None:
    write_steps(buffer_dir, range(4), 4)  # policy_version = step
    reader = BufferReader(buffer_dir, BufferConfig(max_staleness=1, stale=mode,
                                                   stale_weight=0.5))
    reader.poll()
    if mode == "drop":
        got, batch = ids_of(reader, 4, policy_version=3)
        assert got == [f"w02.{i}" for i in range(4)]  # steps 0, 1 are > 1 version behind
        assert batch.dropped_stale == 8 and batch.weights == [1.0] * 4
        got, batch = ids_of(reader, 8, policy_version=3)
        assert got == [f"w03.{i}" for i in range(4)] and batch.dropped_stale == 0
        assert reader.counters["dropped_stale"] == 8
    else:
        got, batch = ids_of(reader, 16, policy_version=3)
        assert got == [f"w0{s}.{i}" for s in range(4) for i in range(4)]
        assert batch.weights == [0.25] * 4 + [0.5] * 4 + [1.0] * 8
        assert batch.dropped_stale == 0


def test_no_policy_version_means_no_staleness(buffer_dir: Path) -> None:
    write_steps(buffer_dir, range(3), 2)
    reader = BufferReader(buffer_dir, BufferConfig(max_staleness=0))
    reader.poll()
    got, batch = ids_of(reader, 10)
    assert len(got) == 6 and batch.dropped_stale == 0 and batch.weights == [1.0] * 6


def test_cursor_of_another_sampler_is_refused(buffer_dir: Path) -> None:
    write_steps(buffer_dir, range(1), 2)
    reader = BufferReader(buffer_dir)
    reader.poll()
    state = reader.state_dict()
    with pytest.raises(ValueError, match="sampler"):
        BufferReader(buffer_dir, BufferConfig.model_validate(
            {"sampler": {"type": "priority"}}), state=state)
