"""A single-turn step's scored groups as records (`scored_experiences`), and the count of
failed reward calls (`RewardFailures`); `explorer.step_stream` samples and scores the groups.

A reward that raises or overruns its time limit, or an LLM judge whose answer does not
parse, scores its rollout 0: the record says why (`info["reward_failure"]`), the step's
metrics count it (`reward_errors`, `reward_timeouts`; unparseable judge answers are
`reward_errors` and also `judge_unparseable`), the log names the task, and the explorer
goes on; `RewardFailures` stops it once too large a share of its reward calls failed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rft_hpc.buffer.records import Experience
from rft_hpc.core.errors import UserError
from rft_hpc.engines.requests import Completion
from rft_hpc.tasks.reward_pool import RewardCall, RewardOutcome
from rft_hpc.tasks.task import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """How many responses per task, how long, how random."""

    repeat: int
    max_new_tokens: int
    temperature: float


def completion_to_experience(task: Task, prompt: Sequence[int], completion: Completion, *,
                             reward: float, group_id: int, version: int,
                             step: int) -> Experience:
    """One rollout as a buffer record: mask and log-probs cover the response tokens only.

    Its `policy_version` is that of its first response token when the engine recorded it
    (`Completion.versions`), else `version`; a rollout whose tokens span several versions
    says so in `info`: `last_version`, and `version_spans`, `[version, first token]` pairs
    counted from the first response token."""
    n_prompt, n_resp = len(prompt), len(completion.tokens)
    spans = completion.versions
    info: dict = {"response": completion.text, "finished": completion.finished}
    if len(spans) > 1:
        info.update(last_version=spans[-1][0], version_spans=[list(x) for x in spans])
    logprobs = np.zeros(n_prompt + n_resp, np.float32)
    logprobs[n_prompt:] = completion.logprobs
    return Experience(
        tokens=np.asarray([*prompt, *completion.tokens], dtype=np.int32),
        prompt_length=n_prompt,  # the default mask: 0 over the prompt, 1 after it
        logprobs=logprobs,
        reward=reward, task_id=task.task_id, group_id=group_id, taskset=task.taskset,
        policy_version=version if completion.first_version is None else
        completion.first_version, step=step, info=info)


def reward_calls(tasks: Sequence[Task], groups: Sequence[Sequence[Completion]],
                 ) -> list[RewardCall]:
    """One reward call per completion, task by task."""
    return [(task, c.text) for task, completions in zip(tasks, groups, strict=True)
            for c in completions]


def scored_experiences(tasks: Sequence[Task], prompts: Sequence[Sequence[int]],
                       groups: Sequence[Sequence[Completion]], outcomes: Sequence[RewardOutcome],
                       *, group_ids: Sequence[int], step: int, version: int,
                       ) -> tuple[list[Experience], dict[str, float]]:
    """The records of a step's scored groups (`outcomes` in `reward_calls` order; a failed
    call scores 0, is logged with its task and marked in the record; group j's records get
    `group_ids[j]`) and the step's metrics: `reward_mean`, `reward_std`, `groups_all_equal`,
    `response_length`, `finished`, `reward_errors` and `reward_timeouts` (failed reward
    calls), `judge_unparseable` (of the errors, judge answers without a score),
    `generated_tokens` (response tokens, the rollout throughput's)."""
    outcomes = iter(outcomes)
    experiences: list[Experience] = []
    errors = timeouts = unparseable = 0
    for task, prompt, completions, group_id in zip(tasks, prompts, groups, group_ids,
                                                   strict=True):
        for k, completion in enumerate(completions):
            outcome = next(outcomes)
            experience = completion_to_experience(
                task, prompt, completion, reward=outcome.score, group_id=group_id,
                version=version, step=step)
            if outcome.request is not None:  # scored by a reward job (docs/reward-job.md)
                experience.info["reward_request"] = outcome.request
            if outcome.failed:
                why = (outcome.error if outcome.timed_out or outcome.unparseable
                       else f"raised {outcome.error}")
                log.warning("reward %s on task %s (rollout %d): %s; scored 0", task.reward,
                            task.task_id, k, why)
                experience.info["reward_failure"] = why
                errors += not outcome.timed_out
                timeouts += outcome.timed_out
                unparseable += outcome.unparseable
            experiences.append(experience)
    rewards = np.array([e.reward for e in experiences], dtype=np.float64)
    group_std = rewards.reshape(len(tasks), -1).std(axis=1)
    lengths = [len(e.tokens) - e.prompt_length for e in experiences]
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
               "groups_all_equal": float(np.mean(group_std == 0)),
               "response_length": float(np.mean(lengths)),
               "finished": float(np.mean([e.info["finished"] for e in experiences])),
               "reward_errors": float(errors), "reward_timeouts": float(timeouts),
               "judge_unparseable": float(unparseable),
               "generated_tokens": float(sum(lengths))}
    return experiences, metrics


@dataclass
class RewardFailures:
    """The reward calls of one explorer process that failed (raised, died or timed out),
    against `limit`: the share of its calls that may fail (`explorer.reward_failure_limit`)."""

    limit: float
    calls: int = 0
    failed: int = 0

    def add(self, calls: int, metrics: dict[str, float]) -> None:
        """Count a step's `calls` reward calls and its failures (from its metrics); raise
        `UserError` once more than `limit` of all calls so far failed."""
        self.calls += calls
        self.failed += int(metrics.get("reward_errors", 0) + metrics.get("reward_timeouts", 0))
        if self.failed > self.limit * self.calls:
            raise UserError(
                f"{self.failed} of {self.calls} reward calls failed (raised or timed out), "
                f"more than explorer.reward_failure_limit {self.limit:g} of them: the reward "
                "is broken, or explorer.reward_timeout is too short for it; the warnings "
                "above name the tasks and the errors")

