"""LLM judges on vLLM (`engine: vllm` of a judge term): the judge's greedy answers from a vLLM
engine of its own, for a judge of real size on a GPU.

`judge_loaders` gives the judge scorer (`tasks.judge_reward.JudgeScorer`) the loaders of the
engines beyond its own transformers one; the roles that score (the explorer, the
evaluation) pass them in: the scorer's layer sits below the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft_hpc.config.rewards import JudgeSpec
from rft_hpc.tasks.judge_reward import JudgeLoader, judge_text

if TYPE_CHECKING:
    from rft_hpc.engines.vllm import VLLMEngine


class VLLMJudge:
    """One judge folder served by a vLLM engine (`spec.vllm`'s settings); its answers are
    the engine's greedy completions of each rubric in the judge's chat template, cut at the
    template's end of turn, special tokens left out (as `Judge`'s)."""

    def __init__(self, spec: JudgeSpec, device: str) -> None:
        # imported here: the launcher's commands import the evaluation, which names this
        # loader, and must not pay for torch
        from rft_hpc.engines.vllm import VLLMEngine

        dtype = "auto" if device.startswith("cuda") else "float32"
        self.engine: VLLMEngine = VLLMEngine(spec.judge, dtype=dtype, settings=spec.vllm)
        self.tokenizer = self.engine.tokenizer
        self._special = not self.tokenizer.chat_template  # raw rubrics get BOS, as `Judge`

    def answers(self, rubrics: Sequence[str], max_new_tokens: int) -> list[str]:
        """The judge's greedy answer to each rubric, in one batched generation."""
        prompts = [self.tokenizer(judge_text(self.tokenizer, r),
                                  add_special_tokens=self._special)["input_ids"]
                   for r in rubrics]
        groups = self.engine.generate(prompts, n=1, max_new_tokens=max_new_tokens,
                                      temperature=0.0, seed=0)
        return [group[0].text for group in groups]

    def close(self) -> None:
        """Stop the engine."""
        self.engine.close()


def judge_loaders() -> dict[str, JudgeLoader]:
    """The judge loaders of the engines beyond the scorer's own transformers one: `vllm`
    (`VLLMJudge`)."""
    return {"vllm": VLLMJudge}
