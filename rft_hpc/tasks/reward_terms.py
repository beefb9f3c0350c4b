"""The terms of a task's reward: each function, reward model or LLM judge of a weighted
sum, as a call of its own, and a short label of the whole for messages.

A task whose config `reward` is one function with weight 1 has no terms (`Task.reward`
names the function, as it always did); any other reward (a reward model, a judge, a
weighted function, a list) is carried as `Task.reward_terms`. A term is scored by the
scorer of its kind (`term.kind`): a function by the reward function pool, a model by the
model scorer, a judge by the judge scorer; their weighted sum is the reward
(`tasks.reward_mix`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from rft_hpc.config.rewards import AnyRewardSpec, JudgeSpec, RewardModelSpec, RewardSpec
from rft_hpc.tasks.task import Task

Term = TypeVar("Term", RewardModelSpec, JudgeSpec)


def term_label(term: AnyRewardSpec) -> str:
    """`exact_match`, `model:/path/to/rm`, `model:stage rm` or `judge:/path/to/chat`: what
    a message calls the term."""
    if isinstance(term, RewardSpec):
        return term.name
    if isinstance(term, JudgeSpec):
        return f"judge:{term.judge}"
    return f"model:{term.model if term.model is not None else f'stage {term.stage}'}"


def reward_label(terms: tuple[AnyRewardSpec, ...]) -> str:
    """The terms as one label, `0.5*exact_match + model:/rm` (weights of 1 left out)."""
    return " + ".join(term_label(t) if t.weight == 1.0 else f"{t.weight:g}*{term_label(t)}"
                      for t in terms)


def term_task(task: Task, term: AnyRewardSpec) -> Task:
    """`task` scored by `term` alone, unweighted: a function term as a plain function
    reward (what a reward worker calls), a model or judge term as the task's only term."""
    if isinstance(term, RewardSpec):
        return replace(task, reward=term.name, reward_args=dict(term.args), reward_terms=())
    return replace(task, reward=term_label(term), reward_args={}, reward_terms=(term,))


def sole_term(task: Task, kind: type[Term]) -> Term:
    """The term of class `kind` (`RewardModelSpec`, `JudgeSpec`) that scores `task` (a task
    of `term_task`); a `ValueError` when it has none, or more than one term."""
    found = [t for t in task.reward_terms if isinstance(t, kind)]
    if len(found) != 1 or len(task.reward_terms) != 1:
        what = "reward model" if kind is RewardModelSpec else "judge"
        raise ValueError(f"task {task.task_id} is not scored by one {what} alone "
                         f"(its reward: {task.reward})")
    return found[0]


def model_term(task: Task) -> RewardModelSpec:
    """The reward model that scores `task` (`sole_term`)."""
    return sole_term(task, RewardModelSpec)


def uses_models(task: Task) -> bool:
    """Whether a model (a reward model or an LLM judge) scores (part of) `task`'s reward."""
    return any(t.kind != "function" for t in task.reward_terms)
