"""The train and eval task lists that a config's task source describes."""

from __future__ import annotations

from rft_hpc.config.tasks import ArithmeticTasks, JsonlTasks
from rft_hpc.tasks.arithmetic import arithmetic_tasks
from rft_hpc.tasks.task import Task, load_task_file


def build_tasks(source: ArithmeticTasks | JsonlTasks, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, eval) tasks; the same config and seed always give the same lists."""
    if isinstance(source, ArithmeticTasks):
        train, held_out = arithmetic_tasks(source.digits, source.ops, source.eval_size, seed)
        return _with_reward(train, source.reward), _with_reward(held_out, source.reward)
    train = load_task_file(source.path)
    held_out = load_task_file(source.eval_path) if source.eval_path else []
    if source.reward:
        train, held_out = _with_reward(train, source.reward), _with_reward(held_out,
                                                                          source.reward)
    return train, held_out


def _with_reward(tasks: list[Task], reward: str) -> list[Task]:
    from dataclasses import replace

    return [t if t.reward == reward else replace(t, reward=reward) for t in tasks]
