"""Rewards from LLM judges: a chat model reads a rubric filled in with the task and the
response, answers greedily, and a parser turns its answer into the score.

`JudgeScorer` is a reward `Scorer` (`explorer.protocols`): `submit` queues calls, `pump`
judges what is queued, one batched greedy generation per judge folder and up to the term's
`batch_size` calls at a time, on the explorer's own device: with transformers (`Judge`), or
with `engine: vllm` a vLLM engine of its own (`engines.judge.VLLMJudge`, a loader the role
passes in). Each call's task names its
judge (`tasks.batched_scorer`). What the judge reads is `judge_text`: the term's
`template` with `{prompt}`, `{response}` and `{answer}` filled in (`rubric`), as a user
message in the judge tokenizer's chat template with its generation prompt, or the rubric
as it is when the tokenizer has none. Batches are padded on the left (generation appends
on the right) and a text longer than the judge's positions leave for the answer is cut
from the left, keeping the response and the generation prompt.

The parser (`JudgeSpec.parser`: a built-in of `tasks.judge_parsers`, or the user's
`package.module:function`) is called as `parser(answer, **parser_args)`. An answer it finds
no finite number in (None, a `ValueError`, something not a number, NaN) fails its call:
scored 0 with `unparseable answer '<its start>'` and `RewardOutcome.unparseable`, counted
with the reward errors and apart (`judge_unparseable`); a parser that raises anything else
fails its call with the error. A generation that raises fails its batch's calls, and a
judge that fails to load every call of it, as a raising reward model does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rft_hpc.config.rewards import BUILTIN_PARSERS, JudgeSpec
from rft_hpc.core.plugins import import_callable
from rft_hpc.tasks.batched_scorer import BatchedScorer, Queued
from rft_hpc.tasks.reward_pool import MESSAGE_CHARS, RewardOutcome
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ANSWER_CHARS = 60
"""How much of an unparseable answer its error quotes."""

Parser = Callable[..., Any]
"""`parser(answer, **parser_args) -> number | None`."""

_PARSERS: dict[str, Parser] = {}


def resolve_parser(name: str) -> Parser:
    """The judge parser called `name` (built-in, or `module:function`); a `UserError` when
    it cannot be imported or is not callable."""
    if name not in _PARSERS:
        _PARSERS[name] = import_callable(BUILTIN_PARSERS.get(name, name), "judge parser")
    return _PARSERS[name]


def rubric(template: str, task: Task, response: str) -> str:
    """`template` filled in: `{prompt}` the task's prompt (its chat messages' contents
    joined by newlines), `{response}`, `{answer}` the task's reference answer."""
    prompt = (task.prompt if task.messages is None
              else "\n".join(m["content"] for m in task.messages))
    return template.format(prompt=prompt, response=response, answer=task.answer)


def judge_text(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """What the judge reads for one rubric: it as a user message in the tokenizer's chat
    template with the generation prompt, or the rubric itself without a template."""
    if not tokenizer.chat_template:
        return text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    return rendered


def parse_answer(spec: JudgeSpec, answer: str) -> RewardOutcome:
    """The score `spec`'s parser reads in the judge's `answer`, or the failure: an answer
    without a finite number is `unparseable`, a parser that raises says what it raised."""
    try:
        value = resolve_parser(spec.parser)(answer, **spec.parser_args)
    except ValueError:
        value = None
    except Exception as exc:  # a user's parser that breaks: this call fails, not the run
        return RewardOutcome(error=f"judge parser {spec.parser} raised {type(exc).__name__}: "
                                   f"{exc}"[:MESSAGE_CHARS])
    try:
        score = float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        score = math.nan
    if math.isfinite(score):
        return RewardOutcome(score)
    return RewardOutcome(error=f"unparseable answer {answer[:ANSWER_CHARS]!r}",
                         unparseable=True)


class Judge:
    """One judge folder loaded on `device`: its tokenizer and its causal LM."""

    def __init__(self, folder: Path, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True,
            dtype=dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32),
        ).to(device)
        self.model.eval()
        self.device = device
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_positions: int | None = limit if isinstance(limit, int) else None

    def answers(self, rubrics: Sequence[str], max_new_tokens: int) -> list[str]:
        """The judge's greedy answer to each rubric (special tokens left out), in one
        batched generation of up to `max_new_tokens` tokens each."""
        import torch

        texts = [judge_text(self.tokenizer, r) for r in rubrics]
        room = (self.max_positions - max_new_tokens if self.max_positions else None)
        batch = self.tokenizer(texts, padding=True, truncation=room is not None,
                               max_length=room, return_tensors="pt",
                               add_special_tokens=not self.tokenizer.chat_template,
                               ).to(self.device)
        with torch.inference_mode():
            out = self.model.generate(**batch, max_new_tokens=max_new_tokens,
                                      do_sample=False, temperature=None, top_p=None,
                                      top_k=None, pad_token_id=self.tokenizer.pad_token_id)
        start = batch["input_ids"].shape[1]
        return [self.tokenizer.decode(row[start:], skip_special_tokens=True) for row in out]


class JudgeModel(Protocol):
    """A loaded judge: its greedy answers to rubrics (`Judge`: transformers; the vLLM one:
    `engines.judge.VLLMJudge`)."""

    def answers(self, rubrics: Sequence[str], max_new_tokens: int) -> list[str]:
        """The judge's greedy answer to each rubric, in one batched generation."""
        ...


JudgeLoader = Callable[[JudgeSpec, str], JudgeModel]
"""Loads the judge of a term on a device (`JudgeSpec.engine` picks the loader)."""


class JudgeScorer(BatchedScorer[JudgeSpec]):
    """Scores calls with the LLM judge each call's task names, in batched greedy
    generations on `device` (the explorer's); judges load on first use. Its scores are the
    parsed answers, unweighted (`tasks.reward_mix` weighs and sums the terms)."""

    term_class = JudgeSpec

    def __init__(self, device: str = "cpu", dtype: torch.dtype | None = None,
                 loaders: Mapping[str, JudgeLoader] | None = None) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self.loaders: dict[str, JudgeLoader] = {
            "hf": lambda spec, device: Judge(spec.judge, device, dtype), **(loaders or {})}
        """The loader of each `JudgeSpec.engine` (vLLM's comes from the role: it lives
        above this layer, `engines.judge`)."""

    def batch_key(self, term: JudgeSpec) -> tuple[tuple[Path, str], int, int]:
        """What calls judged in one generation share (their rubrics and parsers may
        differ): the judge (folder, engine), the answer length, the batch size."""
        return (term.judge, term.engine), term.max_new_tokens, term.batch_size

    def load(self, term: JudgeSpec) -> JudgeModel:
        """The judge `term` names, with the loader of its engine."""
        try:
            if term.engine not in self.loaders:
                raise RuntimeError(f"engine {term.engine} judges are not run here")
            return self.loaders[term.engine](term, self.device)
        except Exception as exc:
            raise RuntimeError(f"judge {term.judge} failed to load: "
                               f"{type(exc).__name__}: {exc}") from exc

    def score_batch(self, model: JudgeModel, batch: list[Queued]) -> None:
        """Each call's parsed answer, from one batched generation."""
        first: JudgeSpec = batch[0][2]
        answers = model.answers([rubric(spec.template, *scoring.calls[index])
                                 for scoring, index, spec in batch], first.max_new_tokens)
        for (scoring, index, spec), answer in zip(batch, answers, strict=True):
            scoring.put(index, parse_answer(spec, answer))
