"""The train and eval task lists that a config's task source describes."""

from __future__ import annotations

import random
from dataclasses import replace

from rft_hpc.config.rewards import AnyRewardSpec, RewardSpec, reward_terms
from rft_hpc.config.tasks import (
    ArithmeticTasks,
    DescribeTasks,
    FileTasks,
    LookupTasks,
    ProductsTasks,
)
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.arithmetic import arithmetic_tasks
from rft_hpc.tasks.files import load_tasks
from rft_hpc.tasks.lookup import lookup_tasks
from rft_hpc.tasks.preferences import describe_tasks
from rft_hpc.tasks.products import product_tasks
from rft_hpc.tasks.reward_terms import reward_label
from rft_hpc.tasks.task import Task


def build_tasks(source: ArithmeticTasks | ProductsTasks | LookupTasks | DescribeTasks
                | FileTasks, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, eval) tasks; the same config and seed always give the same lists. A bad
    data source or row raises one `UserError` naming the file and row."""
    if isinstance(source, ProductsTasks | LookupTasks):
        try:
            train, held_out = (
                product_tasks(source.digits, source.train_size, source.eval_size, seed)
                if isinstance(source, ProductsTasks) else
                lookup_tasks(source.digits, source.train_size, source.eval_size, seed))
        except ValueError as exc:
            raise UserError(f"tasks.train_size / tasks.eval_size: {exc}") from exc
        train = _without_calls(train, 1.0 - source.call_share, seed)
        return _with_reward(train, source.reward), _with_reward(held_out, source.reward)
    if isinstance(source, DescribeTasks):
        train, held_out = describe_tasks(source.train_size, source.eval_size, seed)
        return _with_reward(train, source.reward), _with_reward(held_out, source.reward)
    if isinstance(source, ArithmeticTasks):
        train, held_out = arithmetic_tasks(source.digits, source.ops, source.eval_size, seed)
        return _with_reward(train, source.reward), _with_reward(held_out, source.reward)
    train = load_tasks(source)
    eval_source = source.eval_source()
    held_out = load_tasks(eval_source, source.path.stem) if eval_source is not None else []
    if source.reward:
        train, held_out = _with_reward(train, source.reward), _with_reward(held_out,
                                                                          source.reward)
    return train, held_out


def _with_reward(tasks: list[Task], reward: str | AnyRewardSpec | list[AnyRewardSpec],
                 ) -> list[Task]:
    """`tasks` scored by `reward`: a name, a function spec with `name` and `args`, or (a
    reward model, a weighted function, a list) the terms of a weighted sum."""
    if isinstance(reward, str):
        reward = RewardSpec(name=reward)
    if isinstance(reward, RewardSpec) and reward.weight == 1.0:
        given = {"reward_args": dict(reward.args)} if reward.args else {}
        return [replace(t, reward=reward.name, **given) for t in tasks]
    terms = tuple(reward_terms(reward))
    return [replace(t, reward=reward_label(terms), reward_args={}, reward_terms=terms)
            for t in tasks]


def _without_calls(tasks: list[Task], share: float, seed: int) -> list[Task]:
    """`tasks` with `share` of them (a seeded draw) demonstrating an answer without a call:
    their `info.tool_calls` emptied."""
    drop = set(random.Random(f"{seed} answers without calls").sample(
        range(len(tasks)), round(share * len(tasks))))
    return [replace(t, info={**t.info, "tool_calls": []}) if i in drop else t
            for i, t in enumerate(tasks)]
