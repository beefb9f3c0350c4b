"""Scores of one policy on one task set, by each task's own reward: greedy accuracy and
reward, mean@k and pass@k. `score_tasks` is the one scoring function: the trainer's
held-out evaluation (`rft_hpc.eval.heldout`), the evaluator role and `rft-hpc eval`
(`rft_hpc.eval.bench`) all score through it; `heldout_scores` names its results as the
trainer's metrics (`eval_accuracy`, ...).

A sample is correct when its reward is at least 1 (the full reward of the exact-match
rewards; `exact_match_with_format` gives 0.1 to a wrong bare number, which is not correct).
pass@k is the unbiased estimator of Chen et al. (2021, "Codex"), as Trinity-RFT reports it:
from n >= k samples of which c are correct, 1 - C(n-c, k) / C(n, k), averaged over tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any

from rft_hpc.config.rewards import RewardSpec
from rft_hpc.config.schema import EvalConfig
from rft_hpc.engines.judge import judge_loaders
from rft_hpc.engines.protocol import InferenceEngine
from rft_hpc.tasks.model_reward import engine_device
from rft_hpc.tasks.reward_mix import local_scorers, scores_in_process
from rft_hpc.tasks.reward_terms import term_task
from rft_hpc.tasks.rewards import call_reward
from rft_hpc.tasks.task import Task

CORRECT = 1.0
"""Reward from which a sample counts as correct (for pass@k and greedy accuracy)."""


def gold_pairs(k: int) -> dict[str, str]:
    """The held-out metrics a run with `eval.gold` reports the trained and the gold reward
    by, side by side (in the stage results and summary.json), each with its name there:
    the greedy answers' (`eval_reward`, `eval_gold`) and with `k` samples the samples'
    (`eval_mean@k`, `eval_gold_mean@k`)."""
    pairs = {"eval_reward": "reward", "eval_gold": "gold"}
    if k:
        pairs.update({f"eval_mean@{k}": f"reward_mean@{k}",
                      f"eval_gold_mean@{k}": f"gold_mean@{k}"})
    return pairs


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
    """Metrics from the greedy reward of each task and the rewards of its n samples (no
    samples, k 0: the greedy metrics only)."""
    if not greedy:
        raise ValueError("no tasks to score")
    out: dict[str, Any] = {
        "tasks": len(greedy), "k": k, "n": len(samples[0]) if samples else 0,
        "greedy_accuracy": sum(r >= CORRECT for r in greedy) / len(greedy),
        "greedy_reward": sum(greedy) / len(greedy)}
    if not k:
        return out
    n = len(samples[0])
    correct = [sum(r >= CORRECT for r in rewards) for rewards in samples]
    out.update({
        f"mean@{k}": sum(sum(r) / n for r in samples) / len(samples),
        "pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(correct),
        f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct)})
    return out


def score_tasks(engine: InferenceEngine, tasks: Sequence[Task], *, k: int, n: int,
                temperature: float, max_new_tokens: int, batch_size: int, seed: int,
                answers: list[dict[str, Any]] | None = None,
                gold: RewardSpec | None = None) -> dict[str, Any]:
    """Greedy answers and `n` samples at `temperature` of every task (k = n = 0: greedy
    only), prompts in the engine's prompt format, scored by each task's own reward (a
    reward model's raw score; `reward_errors`: calls that raised or that a judge's
    unparseable answer failed, scored 0); `summarize`d.
    With `gold`, each greedy answer and each sample is also scored by that reward function
    (`greedy_gold`, the greedy answers' mean; `gold_mean@k`, the samples'; `gold_errors`).
    Each task's greedy answer is appended to `answers` when given, in task order, as
    `{"task_id", "answer", "reward"}` (and `"gold"`), with samples also `"samples"` (their
    texts), `"sample_rewards"` (and `"sample_golds"`)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, not {n}")
    greedy: list[float] = []
    samples: list[list[float]] = []
    errors = [0]

    # reward models, judges: loaded when used
    models = local_scorers(engine_device(), judge_loaders=judge_loaders())

    def scores(calls: list[tuple[Task, str]]) -> list[float]:
        """The calls' rewards, a chunk's reward models and judges in batches; a reward that
        fails on one answer scores it 0 and is counted."""
        out = scores_in_process(calls, models)
        errors[0] += sum(isinstance(x, Exception) for x in out)
        return [0.0 if isinstance(x, Exception) else x for x in out]

    golds: list[float] = []
    sample_golds: list[list[float]] = []
    gold_errors = [0]

    def gold_score(task: Task, text: str) -> float:
        assert gold is not None
        try:
            return call_reward(term_task(task, gold), text)
        except Exception:  # as the task's reward: a failing call scores 0 and is counted
            gold_errors[0] += 1
            return 0.0

    per_batch = max(1, batch_size // max(n, 1))
    for i in range(0, len(tasks), per_batch):
        chunk = tasks[i:i + per_batch]
        prompts = [engine.prompt_ids(t) for t in chunk]
        best = engine.generate(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                               seed=seed)
        # prompt j of the engine's call samples with seed `seed + j * n + sample`: each task
        # of the whole list gets seeds of its own (an offset of `i` alone made a later
        # chunk's prompts redraw an earlier chunk's samples, equal prompts the same texts)
        drawn = engine.generate(prompts, n=n, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed + i * n) if n else best
        rewards = iter(scores([(task, text) for task, one, group in zip(chunk, best, drawn,
                                                                        strict=True)
                               for text in [one[0].text, *(c.text for c in group if n)]]))
        for task, one, group in zip(chunk, best, drawn, strict=True):
            greedy.append(next(rewards))
            row = {"task_id": task.task_id, "answer": one[0].text, "reward": greedy[-1]}
            if gold is not None:
                golds.append(gold_score(task, one[0].text))
                row["gold"] = golds[-1]
            if n:
                samples.append([next(rewards) for _ in group])
                row.update(samples=[c.text for c in group], sample_rewards=samples[-1])
                if gold is not None:
                    sample_golds.append([gold_score(task, c.text) for c in group])
                    row["sample_golds"] = sample_golds[-1]
            if answers is not None:
                answers.append(row)
    out = {**summarize(greedy, samples, k), "reward_errors": errors[0]}
    if gold is not None:
        out.update(greedy_gold=sum(golds) / len(golds), gold_errors=gold_errors[0])
        if n:
            out[f"gold_mean@{k}"] = sum(sum(g) / n for g in sample_golds) / len(sample_golds)
    return out


def heldout_scores(engine: InferenceEngine, tasks: Sequence[Task], settings: EvalConfig, *,
                   temperature: float, seed: int,
                   answers: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """`score_tasks` with the eval settings, as the trainer's metrics: `eval_accuracy`
    (greedy answers whose task reward is at least 1), `eval_reward` (their mean reward) and,
    with `settings.k` samples per task at `temperature`, `eval_mean@k` and `eval_pass@k`;
    `eval_reward_errors` counts reward calls that raised; with `settings.gold`, `eval_gold`
    (the greedy answers' mean gold reward), `eval_gold_errors` and with `settings.k`
    `eval_gold_mean@k` (the samples'). Every value is NaN for no tasks. Each task's greedy
    answer (and samples) and their rewards go into `answers` when given."""
    keys = ["accuracy", "reward", "reward_errors"]
    keys += [f"mean@{settings.k}", f"pass@{settings.k}"] if settings.k else []
    keys += ["gold", "gold_errors"] if settings.gold is not None else []
    keys += [f"gold_mean@{settings.k}"] if settings.gold is not None and settings.k else []
    if not tasks:
        return {f"eval_{key}": float("nan") for key in keys}
    scores = score_tasks(engine, tasks, k=settings.k, n=settings.k,
                         temperature=temperature or 1.0,
                         max_new_tokens=settings.max_new_tokens,
                         batch_size=settings.batch_size, seed=seed, answers=answers,
                         gold=settings.gold)
    scores.update(accuracy=scores["greedy_accuracy"], reward=scores["greedy_reward"],
                  gold=scores.get("greedy_gold"))
    return {f"eval_{key}": float(scores[key]) for key in keys}
