"""The reward job's protocol on the run directory (docs/reward-job.md, version 1): explorers
send batches of reward-model calls as request files, reward jobs answer each with a
response file.

Reward job `j` of a stage has one folder, `<stage>/reward/job-<j>/`, shared by the
explorers it serves (explorer `i` is served by job `i % count`):

- `<id>.req`: a request, written by its explorer (temporary name, rename; not fsynced: see
  `write_request`): JSON
  `{"version", "id", "explorer", "calls"}`, each call what a reward model or an LLM judge
  reads and which model reads it: `{"task_id", "prompt", "messages", "answer", "reward",
  "kind", "term", "response"}` (`kind` `model` or `judge`, `term` that term as in the
  config; `reward` its label for messages);
- `<id>.resp`: its response, written by the reward job the same way (after its ledger line
  is synced): JSON
  `{"version", "id", "outcomes": [{"score", "error", "timed_out", "unparseable"}, ...]}`,
  in call order.

A request id is `explorer-<i>.<incarnation>.<n>`: the explorer, a random token of its
process (a restarted explorer regenerates its rollouts, so it starts a new incarnation and
removes every file of its old ones) and a counter. The explorer reads its response, then
deletes the request and the response, in that order; a request without a response is work
to do, whatever happened before (a reward job restarted scores it again, harmlessly: the
explorer writes each step to the buffer once).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft_hpc.config.rewards import JudgeSpec, RewardModelSpec
from rft_hpc.core.rundir import atomic_write_json, is_temporary, read_json
from rft_hpc.tasks.reward_pool import MESSAGE_CHARS, RewardCall, RewardOutcome
from rft_hpc.tasks.task import Task

PROTOCOL_VERSION = 1
"""The version of the request and response files (docs/reward-job.md)."""

REQUEST, RESPONSE = ".req", ".resp"


def reward_role(job: int) -> str:
    """The role name of reward job `job` (its heartbeat, ledger, log and metrics)."""
    return f"reward-{job}"


def serving_job(explorer: int, count: int) -> int:
    """The reward job that serves explorer `explorer` among `count`: `explorer % count`
    (fixed, so requests of a restarted explorer go where the old ones went; even)."""
    return explorer % count


def served_explorers(job: int, count: int, explorers: int) -> list[int]:
    """The explorers (of `explorers`) whose requests reward job `job` of `count` scores."""
    return [i for i in range(explorers) if serving_job(i, count) == job]


def job_folder(stage: Path, job: int) -> Path:
    """`<stage>/reward/job-<j>/`: the requests to reward job `job` and their responses."""
    return stage / "reward" / f"job-{job}"


def new_incarnation() -> str:
    """A token that tells this explorer process's requests from any other's."""
    return uuid.uuid4().hex[:12]


def request_id(explorer: int, incarnation: str, number: int) -> str:
    """The id of request `number` of an explorer process."""
    return f"explorer-{explorer}.{incarnation}.{number:06d}"


def request_explorer(rid: str) -> int | None:
    """The explorer index a request id names (None: not a request id)."""
    head = rid.split(".", 1)[0]
    index = head.removeprefix("explorer-")
    return int(index) if head.startswith("explorer-") and index.isdigit() else None


@dataclass(frozen=True)
class Request:
    """One batch of calls an explorer sent."""

    id: str
    explorer: int
    calls: list[RewardCall]


TERM_CLASSES: dict[str, type[RewardModelSpec] | type[JudgeSpec]] = {
    "model": RewardModelSpec, "judge": JudgeSpec}
"""The term kinds a reward job scores, by the `kind` a request's call names."""


def call_json(call: RewardCall) -> dict[str, Any]:
    """A call as a request carries it: what the model reads, and which model (the task's
    one reward-model or judge term, `reward_terms.term_task`, and its `kind`). Raises
    `ValueError` for a task without one."""
    task, response = call
    terms = [t for t in task.reward_terms if t.kind in TERM_CLASSES]
    if len(terms) != 1 or len(task.reward_terms) != 1:
        raise ValueError(f"task {task.task_id} is not scored by one reward model or judge "
                         f"alone (its reward: {task.reward})")
    return {"task_id": task.task_id, "prompt": task.prompt, "messages": task.messages,
            "answer": task.answer, "reward": task.reward, "kind": terms[0].kind,
            "term": terms[0].model_dump(mode="json"), "response": response}


def call_from_json(data: dict[str, Any]) -> RewardCall:
    """The call a request's entry describes (`call_json`'s inverse, for the model's use)."""
    term = TERM_CLASSES[data.get("kind", "model")].model_validate(data["term"])
    return (Task(task_id=str(data["task_id"]), prompt=data["prompt"], messages=data["messages"],
                 answer=str(data.get("answer", "")), reward=str(data["reward"]),
                 reward_terms=(term,)), str(data["response"]))


def write_request(folder: Path, rid: str, explorer: int, calls: Sequence[RewardCall]) -> None:
    """Send a request: `<rid>.req` in `folder`, written atomically (whole or not at all).
    Not fsynced: a crash that could lose it takes its explorer process down as well, and a
    restarted explorer withdraws its earlier process's requests and sends new ones."""
    atomic_write_json(folder / f"{rid}{REQUEST}", durable=False, obj={
        "version": PROTOCOL_VERSION, "id": rid, "explorer": explorer,
        "calls": [call_json(c) for c in calls]})


def read_request(path: Path) -> Request | None:
    """The request at `path`; None when it is gone (its explorer took its answer or
    restarted). Raises `ValueError` for a file of another protocol version."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    if data.get("version") != PROTOCOL_VERSION:
        raise ValueError(f"{path}: reward request version {data.get('version')}, this "
                         f"rft-hpc reads version {PROTOCOL_VERSION}")
    return Request(data["id"], int(data["explorer"]),
                   [call_from_json(c) for c in data["calls"]])


def unanswered(folder: Path) -> list[Path]:
    """The requests in `folder` without a response, oldest id first (one listing)."""
    try:
        names = set(os.listdir(folder))
    except FileNotFoundError:
        return []
    return sorted(folder / n for n in names if n.endswith(REQUEST) and not is_temporary(n)
                  and n.removesuffix(REQUEST) + RESPONSE not in names)


def write_response(folder: Path, rid: str, outcomes: Sequence[RewardOutcome]) -> None:
    """Answer request `rid`: `<rid>.resp`, written atomically (whole or not at all). Not
    fsynced: a response lost with its file server's cache leaves its request unanswered,
    which the next reward job process scores again, and the ledger (synced before it)
    already holds the request."""
    atomic_write_json(folder / f"{rid}{RESPONSE}", durable=False, obj={
        "version": PROTOCOL_VERSION, "id": rid,
        "outcomes": [{"score": o.score, "error": o.error, "timed_out": o.timed_out,
                      "unparseable": o.unparseable} for o in outcomes]})


def read_response(folder: Path, rid: str) -> list[RewardOutcome] | None:
    """The outcomes of request `rid`, in call order; None while it has no response."""
    try:
        data = read_json(folder / f"{rid}{RESPONSE}")
    except FileNotFoundError:
        return None
    if data.get("version") != PROTOCOL_VERSION:
        raise ValueError(f"{folder / rid}{RESPONSE}: reward response version "
                         f"{data.get('version')}, this rft-hpc reads {PROTOCOL_VERSION}")
    return [RewardOutcome(float(o["score"]), o["error"] and str(o["error"])[:MESSAGE_CHARS],
                          timed_out=bool(o["timed_out"]),
                          unparseable=bool(o.get("unparseable", False)))
            for o in data["outcomes"]]


def remove_request(folder: Path, rid: str) -> None:
    """Delete a request, then its response (a response alone is never work to do)."""
    for suffix in (REQUEST, RESPONSE):
        with contextlib.suppress(FileNotFoundError):
            (folder / f"{rid}{suffix}").unlink()


def remove_explorer_files(folder: Path, explorer: int) -> int:
    """Delete every request and response of explorer `explorer`'s earlier processes (at
    its start, before it sends any); how many files."""
    prefix = f"explorer-{explorer}."
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            if name.startswith(prefix) and name.endswith((REQUEST, RESPONSE)):
                with contextlib.suppress(FileNotFoundError):
                    (folder / name).unlink()
                    removed += 1
    return removed


def remove_orphan_responses(folder: Path) -> int:
    """Delete the responses whose request is gone (answered just as its explorer restarted);
    how many. Only once no explorer can be reading them (the reward job's end)."""
    try:
        names = set(os.listdir(folder))
    except FileNotFoundError:
        return 0
    orphans = [n for n in names if n.endswith(RESPONSE) and not is_temporary(n)
               and n.removesuffix(RESPONSE) + REQUEST not in names]
    for name in orphans:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    return len(orphans)
