"""Rewards from reward models: a Hugging Face sequence-classification folder with one label
scores prompt and response together, in batches, on the explorer's own device.

`ModelScorer` is a reward `Scorer` (`explorer.protocols`): `submit` queues calls, `pump`
scores what is queued, one batched forward per reward model and up to its `batch_size`
calls at a time (`tasks.batched_scorer`). Each call's task names its model. The text a
model reads is `model_text`: with the model tokenizer's own chat template, the prompt with
the generation prompt, the response and the end-of-turn token (the sequence a reward-model
stage trains on), else the raw prompt followed by the response; batches are padded
on the tokenizer's padding side (a reward model's folder says which side it expects) and
cut at the model's maximum positions. A sequence classifier reads its score at the last
token that is not padding, whichever side is padded.

Scores are normalised as the model's term says: `none`, `batch` (z-score over the calls of
one forward batch) or `running` (z-score by the mean and standard deviation of every score
that model gave so far, this batch's included). A forward that raises scores its calls 0
with the error, as a raising reward function does; so does a model that fails to load, and
a score that is not finite (that call alone).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rft_hpc.config.rewards import RewardModelSpec
from rft_hpc.tasks.batched_scorer import BatchedScorer, Queued
from rft_hpc.tasks.prompts import end_of_turn_id
from rft_hpc.tasks.reward_pool import RewardCall, RewardOutcome
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def engine_device() -> str:
    """Where a role's reward models run: its GPU when it has one (as its engine), else the
    CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def prompt_messages(task: Task) -> list[dict[str, str]]:
    """The messages before the response: the task's chat messages, or its prompt as one
    user message."""
    return ([dict(m) for m in task.messages] if task.messages is not None
            else [{"role": "user", "content": task.prompt}])


def model_text(tokenizer: PreTrainedTokenizerBase, task: Task, response: str,
               end_of_turn: str | None = None) -> str:
    """What the reward model reads for one call. With a chat template: the prompt rendered
    with the template's generation prompt (as the policy reads it), the response, then the
    template's end-of-turn token: the sequence a reward-model stage trains on (its pairs'
    prompt, response and stop token), so the score is read where it was trained. Else the
    prompt text followed by the response. `end_of_turn`: that token's text, when the caller
    knows it (found from the template otherwise, which renders a probe conversation)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(prompt_messages(task), tokenize=False,
                                             add_generation_prompt=True)
        assert isinstance(text, str)
        return text + response + (end_of_turn if end_of_turn is not None
                                  else end_of_turn_text(tokenizer))
    prompt = (task.prompt if task.messages is None
              else "\n".join(m["content"] for m in task.messages))
    return prompt + response


def end_of_turn_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text of the token the chat template ends an assistant turn with ('' if none)."""
    eot = end_of_turn_id(tokenizer)
    return tokenizer.decode([eot]) if eot is not None else ""


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations of every score seen (Chan et al.'s
    parallel update: one batch at a time, no score kept)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, scores: Sequence[float]) -> None:
        """Take `scores` into the moments."""
        n = len(scores)
        if not n:
            return
        mean = sum(scores) / n
        m2 = sum((s - mean) ** 2 for s in scores)
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """The population standard deviation of the scores seen (0 before two differ)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


def zscore(scores: Sequence[float], mean: float, std: float) -> list[float]:
    """`(s - mean) / std` for each score; 0 for every score when `std` is 0 (nothing to
    tell them apart by)."""
    return [(s - mean) / std if std > 0 else 0.0 for s in scores]


def normalized(scores: Sequence[float], how: str, moments: RunningMoments) -> list[float]:
    """`scores` of one batch normalised as `how` says (`none`, `batch`, `running`); `running`
    first takes the batch into `moments`."""
    if how == "none":
        return list(scores)
    if how == "batch":
        mean = sum(scores) / len(scores)
        return zscore(scores, mean, math.sqrt(sum((s - mean) ** 2 for s in scores)
                                              / len(scores)))
    moments.add(scores)
    return zscore(scores, moments.mean, moments.std)


PROMPTS_KEPT = 4096
"""Rendered prompts a reward model keeps (emptied when full: an explorer's steps bring new
prompts, a group's rollouts the same one)."""


class RewardModel:
    """One reward model folder loaded on `device`: its tokenizer and its classifier."""

    def __init__(self, folder: Path, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(
            str(folder), local_files_only=True,
            dtype=dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32),
        ).to(device)
        self.model.eval()
        self.device = device
        config = self.model.config
        # batches need a pad token both sides agree on: the tokenizer pads with it and the
        # classifier skips it to find each row's last token
        if self.tokenizer.pad_token_id is None and config.pad_token_id is not None:
            self.tokenizer.pad_token_id = config.pad_token_id
        elif config.pad_token_id is None and self.tokenizer.pad_token_id is not None:
            config.pad_token_id = self.tokenizer.pad_token_id
        # tokenizers without a limit say model_max_length ~1e30
        limits = [getattr(config, "max_position_embeddings", None),
                  self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1 << 30
                  else None]
        self.max_length = min((n for n in limits if n), default=None)
        """Tokens a text is cut to (None: not cut)."""
        self.end_of_turn = end_of_turn_text(self.tokenizer) if self.tokenizer.chat_template \
            else ""
        """What ends the response in every text it reads (found once, not per call)."""
        self._prompts: dict[str, str] = {}
        """Rendered prompts by prompt text or messages (`_prompt`)."""

    def texts(self, calls: Sequence[RewardCall]) -> list[str]:
        """What the model reads for each call (`model_text`), each prompt rendered once:
        the rollouts of a group share theirs, and a template's rendering costs a fifth of a
        small model's forward."""
        if not self.tokenizer.chat_template:
            return [model_text(self.tokenizer, task, response) for task, response in calls]
        return [self._prompt(task) + response + self.end_of_turn for task, response in calls]

    def _prompt(self, task: Task) -> str:
        """`task`'s prompt rendered with the generation prompt, from a cache of the latest
        `PROMPTS_KEPT` prompts."""
        key = task.prompt if task.messages is None else json.dumps(task.messages)
        text = self._prompts.get(key)
        if text is None:
            text = model_text(self.tokenizer, task, "", "")
            if len(self._prompts) >= PROMPTS_KEPT:
                self._prompts.clear()
            self._prompts[key] = text
        return text

    def scores(self, calls: Sequence[RewardCall]) -> list[float]:
        """The model's raw score of each call, in one batched forward."""
        import torch

        templated = bool(self.tokenizer.chat_template)
        batch = self.tokenizer(self.texts(calls), padding=True, truncation=True,
                               max_length=self.max_length, return_tensors="pt",
                               add_special_tokens=not templated).to(self.device)
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


class ModelScorer(BatchedScorer[RewardModelSpec]):
    """Scores calls with the reward model each call's task names, in batched forwards on
    `device` (the explorer's); models load on first use. Its scores are each model's
    normalised outputs, unweighted (`tasks.reward_mix` weighs and sums the terms)."""

    term_class = RewardModelSpec

    def __init__(self, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self._moments: dict[Path, RunningMoments] = {}

    def batch_key(self, term: RewardModelSpec) -> tuple[Path | None, str, int]:
        """What calls scored in one batch share (their weights may differ)."""
        return term.model, term.normalize, term.batch_size

    def load(self, term: RewardModelSpec) -> RewardModel:
        """The reward model `term` names, on this scorer's device."""
        if term.model is None:  # config.schema resolves stage references for later stages
            raise RuntimeError("a reward model named by its stage is scored by the stages "
                               "after it only")
        try:
            return RewardModel(term.model, self.device, self.dtype)
        except Exception as exc:
            raise RuntimeError(f"reward model {term.model} failed to load: "
                               f"{type(exc).__name__}: {exc}") from exc

    def score_batch(self, model: RewardModel, batch: list[Queued]) -> None:
        """Each call's normalised score, in one forward; a score that is not finite fails
        its call alone."""
        spec: RewardModelSpec = batch[0][2]
        raw = model.scores([scoring.calls[index] for scoring, index, _ in batch])
        finite = [(item, x) for item, x in zip(batch, raw, strict=True) if math.isfinite(x)]
        for (scoring, index, _), x in zip(batch, raw, strict=True):
            if not math.isfinite(x):
                scoring.put(index, RewardOutcome(error=f"reward model {spec.model} returned {x}"))
        if not finite:
            return
        moments = self._moments.setdefault(spec.model, RunningMoments())
        scores = normalized([x for _, x in finite], spec.normalize, moments)
        for ((scoring, index, _), _), score in zip(finite, scores, strict=True):
            scoring.put(index, RewardOutcome(score))
