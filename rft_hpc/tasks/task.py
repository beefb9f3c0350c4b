"""A task (a prompt string or chat messages, reference answer, reward function) and task
files in JSONL."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rft_hpc.config.rewards import AnyRewardSpec
from rft_hpc.core.errors import UserError


@dataclass(frozen=True)
class Task:
    """One unit of work for an explorer: a prompt to answer, scored by `reward`.

    A task has a raw `prompt` string or a chat `messages` list (`{"role", "content"}`
    dicts, the prompt format turns them into text); a task with messages has `prompt` "".
    """

    task_id: str
    prompt: str = ""
    answer: str = ""
    reward: str = "exact_match"
    """Name of a built-in reward function, or `package.module:function`."""
    taskset: str = "default"
    info: dict[str, Any] = field(default_factory=dict)
    """The source row's other columns, for rewards and workflows."""
    messages: list[dict[str, str]] | None = None
    """Chat messages to answer (in place of `prompt`), or None for a raw-text task."""
    reward_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward function (the config's `reward: {name, args}`)."""
    reward_terms: tuple[AnyRewardSpec, ...] = ()
    """The weighted terms of the reward when it is more than one function with weight 1:
    a reward model, or a list of rewards (the config's `reward`; then `reward` is only a
    label for messages); empty: the function `reward` with `reward_args`."""

    def __post_init__(self) -> None:
        if self.messages is not None and self.prompt:
            raise ValueError(f"task {self.task_id}: has both a prompt and messages")

    def to_json(self) -> dict[str, Any]:
        """The task as a JSON-ready dict (every field, `messages` None for raw text)."""
        return {**asdict(self),
                "reward_terms": [t.model_dump(mode="json") for t in self.reward_terms]}


_REQUIRED = ("prompt", "answer")
_ALLOWED = {"task_id", "prompt", "answer", "reward", "taskset", "info"}


def load_task_file(path: Path, taskset: str | None = None) -> list[Task]:
    """Tasks from a JSONL file (`prompt`, `answer`, optional `task_id`, `reward`, `taskset`,
    `info`). Any bad line raises one `UserError` with its line number."""
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    tasks, errors = [], []
    name = taskset or path.stem
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("expected a JSON object")
            missing = [k for k in _REQUIRED if not isinstance(obj.get(k), str)]
            if missing:
                raise ValueError(f"needs string field(s) {', '.join(missing)}")
            unknown = sorted(obj.keys() - _ALLOWED)
            if unknown:
                raise ValueError(f"unknown field(s) {', '.join(unknown)}")
            tasks.append(Task(task_id=str(obj.get("task_id", f"{name}-{lineno}")),
                              prompt=obj["prompt"], answer=obj["answer"],
                              reward=obj.get("reward", "exact_match"),
                              taskset=obj.get("taskset", name), info=obj.get("info", {})))
        except ValueError as exc:
            errors.append(f"{path}, line {lineno}: {exc}")
    if errors:
        raise UserError("bad task file:\n" + "\n".join(errors[:10]))
    if not tasks:
        raise UserError(f"task file {path} holds no tasks")
    return tasks
