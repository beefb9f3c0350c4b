"""Every reward a config uses, imported and called on paper before anything starts.

The config layer checks a reward's spelling only (`rft_hpc.config.rewards`); this check
imports each reward function (a built-in, or the user's `package.module:function`) and
binds its signature to `(task, response, **args)`, so that a typo, a module that fails to
import or an argument the function does not take is one message at the config's key and
line (`rft-hpc validate`, and `run`/`submit` before they start anything), never a crashed
explorer. Tasks of a data file that name their own reward are checked the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rft_hpc.config.explain import Key
from rft_hpc.config.rewards import RewardSpec
from rft_hpc.config.schema import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.rewards import resolve_reward, signature_problem
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def reward_problem(name: str, args: dict[str, Any]) -> tuple[str, str] | None:
    """Why reward `name` cannot be called with `args`, as (`"name"` or `"args"`: what is
    wrong, message), or None when it can."""
    try:
        fn = resolve_reward(name)
    except UserError as exc:
        return "name", str(exc)
    problem = signature_problem(fn, args)
    return ("args", f"reward {name!r} {problem}") if problem else None


def _task_sources(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """(key path, task source) of every task source in the config."""
    yield ("tasks",), config.tasks
    for i, ts in enumerate(config.pipeline.tasksets):
        yield ("pipeline", "tasksets", i, "tasks"), ts.tasks
    for s, stage in enumerate(config.stages):
        for i, ts in enumerate(stage.pipeline.tasksets if stage.pipeline else []):
            yield ("stages", s, "pipeline", "tasksets", i, "tasks"), ts.tasks


def reward_problems(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """(key path, problem) for each reward of `config` that cannot be imported or called
    with its arguments (a check for `load_config`)."""
    for keys, source in _task_sources(config):
        spec = getattr(source, "reward", None)
        if isinstance(spec, RewardSpec):
            found = reward_problem(spec.name, spec.args)
            if found:
                what, message = found
                yield (*keys, "reward", *(("args",) if what == "args" and spec.args
                                          else ())), message
            continue
        try:  # rows that name their own reward
            train, held_out = build_tasks(source, config.run.seed)
        except UserError:
            continue  # a bad file or row is the task sources' own check to report
        first: dict[tuple[str, str], Task] = {}
        for task in (*train, *held_out):
            first.setdefault((task.reward, repr(sorted(task.reward_args.items()))), task)
        for task in first.values():
            found = reward_problem(task.reward, task.reward_args)
            if found:
                yield (*keys, "path"), f"task {task.task_id} names a reward that fails: " \
                                       f"{found[1]}"
