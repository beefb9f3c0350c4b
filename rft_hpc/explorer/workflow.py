"""Task -> Workflow -> Experiences: sample a group of responses per task and score them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.engines.hf import Completion, HFEngine
from rft_hpc.tasks.rewards import resolve_reward
from rft_hpc.tasks.task import Task


@dataclass(frozen=True)
class SamplingSettings:
    """How many responses per task, how long, how random."""

    repeat: int
    max_new_tokens: int
    temperature: float


def completion_to_experience(task: Task, prompt: Sequence[int], completion: Completion, *,
                             reward: float, group_id: int, version: int,
                             step: int) -> Experience:
    """One rollout as a buffer record: mask and log-probs cover the response tokens only."""
    n_prompt, n_resp = len(prompt), len(completion.tokens)
    return Experience(
        tokens=np.asarray([*prompt, *completion.tokens], dtype=np.int32),
        prompt_length=n_prompt,
        response_mask=np.r_[np.zeros(n_prompt, np.uint8), np.ones(n_resp, np.uint8)],
        logprobs=np.r_[np.zeros(n_prompt, np.float32),
                       np.asarray(completion.logprobs, np.float32)],
        reward=reward, task_id=task.task_id, group_id=group_id, taskset=task.taskset,
        policy_version=version, step=step,
        info={"response": completion.text, "finished": completion.finished})


def explore_tasks(engine: HFEngine, tasks: Sequence[Task], settings: SamplingSettings, *,
                  first_group_id: int, step: int, seed: int) -> tuple[list[Experience],
                                                                       dict[str, float]]:
    """Generate `repeat` rollouts per task, score them, and return them with step metrics.

    Group ids are `first_group_id + task index`, unique across explorers and steps when the
    caller passes the task's position in the task stream.
    """
    prompts = [engine.prompt_ids(t) for t in tasks]
    groups = engine.generate(prompts, n=settings.repeat, max_new_tokens=settings.max_new_tokens,
                             temperature=settings.temperature, seed=seed)
    experiences: list[Experience] = []
    for j, (task, prompt, completions) in enumerate(zip(tasks, prompts, groups, strict=True)):
        score = resolve_reward(task.reward)
        for completion in completions:
            experiences.append(completion_to_experience(
                task, prompt, completion, reward=float(score(task, completion.text)),
                group_id=first_group_id + j, version=engine.version, step=step))
    rewards = np.array([e.reward for e in experiences], dtype=np.float64)
    group_std = rewards.reshape(len(tasks), settings.repeat).std(axis=1)
    lengths = [len(e.tokens) - e.prompt_length for e in experiences]
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
               "groups_all_equal": float(np.mean(group_std == 0)),
               "response_length": float(np.mean(lengths)),
               "finished": float(np.mean([e.info["finished"] for e in experiences]))}
    return experiences, metrics
