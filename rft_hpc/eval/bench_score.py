"""Scores of one policy on one task set: greedy accuracy, mean@k and pass@k.

A sample is correct when its reward is at least 1 (the full reward of the exact-match
rewards; `exact_match_with_format` gives 0.1 to a wrong bare number, which is not correct).
pass@k is the unbiased estimator of Chen et al. (2021, "Codex"), as Trinity-RFT reports it:
from n >= k samples of which c are correct, 1 - C(n-c, k) / C(n, k), averaged over tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any

from rft_hpc.tasks.rewards import resolve_reward
from rft_hpc.tasks.task import Task

CORRECT = 1.0
"""Reward from which a sample counts as correct (for pass@k and greedy accuracy)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n samples,
    c of them correct, is correct (the unbiased pass@k estimator)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(greedy: Sequence[float], samples: Sequence[Sequence[float]], k: int,
              ) -> dict[str, Any]:
    """Metrics from the greedy reward of each task and the rewards of its n samples."""
    if not samples:
        raise ValueError("no tasks to score")
    n = len(samples[0])
    correct = [sum(r >= CORRECT for r in rewards) for rewards in samples]
    mean = sum(sum(r) / n for r in samples) / len(samples)
    return {
        "tasks": len(samples), "k": k, "n": n,
        "greedy_accuracy": sum(r >= CORRECT for r in greedy) / len(greedy),
        "greedy_reward": sum(greedy) / len(greedy),
        f"mean@{k}": mean,
        "pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(correct),
        f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct),
    }


def score_tasks(engine: Any, tasks: Sequence[Task], *, k: int, n: int, temperature: float,
                max_new_tokens: int, batch_size: int, seed: int) -> dict[str, Any]:
    """Greedy answers and `n` samples at `temperature` of every task, scored by each task's
    reward function; `summarize`d."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, not {n}")
    greedy: list[float] = []
    samples: list[list[float]] = []
    per_batch = max(1, batch_size // n)
    for i in range(0, len(tasks), per_batch):
        chunk = tasks[i:i + per_batch]
        prompts = [engine.encode(t.prompt) for t in chunk]
        best = engine.generate(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                               seed=seed)
        drawn = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed + i)
        for task, one, group in zip(chunk, best, drawn, strict=True):
            reward = resolve_reward(task.reward)
            greedy.append(float(reward(task, one[0].text)))
            samples.append([float(reward(task, c.text)) for c in group])
    return summarize(greedy, samples, k)
