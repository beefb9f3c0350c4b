"""The terms of a task's reward: each function or reward model of a weighted sum, as a call
of its own, and a short label of the whole for messages.

A task whose config `reward` is one function with weight 1 has no terms (`Task.reward`
names the function, as it always did); any other reward (a reward model, a weighted
function, a list) is carried as `Task.reward_terms`. A term is scored by the scorer of its
kind: a function by the reward function pool, a model by the model scorer; their weighted
sum is the reward (`tasks.reward_mix`).
"""

from __future__ import annotations

from dataclasses import replace

from rft_hpc.config.rewards import AnyRewardSpec, RewardModelSpec, RewardSpec
from rft_hpc.tasks.task import Task


def term_label(term: AnyRewardSpec) -> str:
    """`exact_match`, `model:/path/to/rm` or `model:stage rm`: what a message calls the
    term."""
    if isinstance(term, RewardSpec):
        return term.name
    return f"model:{term.model if term.model is not None else f'stage {term.stage}'}"


def reward_label(terms: tuple[AnyRewardSpec, ...]) -> str:
    """The terms as one label, `0.5*exact_match + model:/rm` (weights of 1 left out)."""
    return " + ".join(term_label(t) if t.weight == 1.0 else f"{t.weight:g}*{term_label(t)}"
                      for t in terms)


def term_task(task: Task, term: AnyRewardSpec) -> Task:
    """`task` scored by `term` alone, unweighted: a function term as a plain function
    reward (what a reward worker calls), a model term as the model's only term."""
    if isinstance(term, RewardSpec):
        return replace(task, reward=term.name, reward_args=dict(term.args), reward_terms=())
    return replace(task, reward=term_label(term), reward_args={}, reward_terms=(term,))


def model_term(task: Task) -> RewardModelSpec:
    """The reward model that scores `task` (a task of `term_task` for a model term); a
    `ValueError` when it has none, or more than one."""
    models = [t for t in task.reward_terms if isinstance(t, RewardModelSpec)]
    if len(models) != 1 or len(task.reward_terms) != 1:
        raise ValueError(f"task {task.task_id} is not scored by one reward model alone "
                         f"(its reward: {task.reward})")
    return models[0]


def uses_models(task: Task) -> bool:
    """Whether a reward model scores (part of) `task`'s reward."""
    return any(isinstance(t, RewardModelSpec) for t in task.reward_terms)
