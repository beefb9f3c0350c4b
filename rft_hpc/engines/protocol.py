"""What the roles ask of an inference engine: the seam between them and HF or vLLM.

The explorer's workflows, its weight follower, evaluation and the tools call an engine only
through `InferenceEngine` (and a streaming explorer through `StreamingEngine`), so an engine
of another kind plugs in by offering these members; `HFEngine` and `VLLMEngine` do (checked
in tests/unit/test_engine_protocol.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rft_hpc.config.prompt import PromptConfig
    from rft_hpc.engines.requests import Completion, FinishedGroup, GroupRequest
    from rft_hpc.tasks.task import Task


@runtime_checkable
class InferenceEngine(Protocol):
    """A policy that samples completions of token-id prompts and takes new weights in place.

    It promises: the same prompts, weights and seed give the same completions; each
    completion's log-probs are those of the sampling distribution (`log_softmax(logits /
    T)`, at T = 1 when greedy) as the trainer recomputes them; `load_weights` replaces every
    weight at once (or raises and says why) and sets `version`.
    """

    tokenizer: PreTrainedTokenizerBase
    """The model folder's tokenizer (its chat template included)."""
    prompt: PromptConfig
    """How `prompt_ids` builds a prompt: raw text, or the chat template's rendering."""

    @property
    def version(self) -> int:
        """The version of the weights loaded (0: the initial model)."""
        ...

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a raw text prompt, with the tokenizer's special tokens."""
        ...

    def plain_tokens(self, text: str) -> list[int]:
        """Token ids of a text without special tokens (an environment's observation)."""
        ...

    def prompt_ids(self, task: Task) -> list[int]:
        """Token ids of a task's prompt in the engine's prompt format (`tasks.prompts`)."""
        ...

    def context_limit(self) -> int | None:
        """The longest sequence (prompt and response) the model takes; None: unknown."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[Completion]]:
        """`n` completions per prompt, in prompt order; temperature 0 decodes greedily."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights with a published state dict (copied: the caller may reuse
        its tensors) and take `version` as the engine's."""
        ...

    def close(self) -> None:
        """Free what the engine holds beyond this process's memory (worker processes,
        scratch files); the engine is not used afterwards."""
        ...


@runtime_checkable
class StreamingEngine(InferenceEngine, Protocol):
    """An engine that keeps group requests in flight and hands them back as they finish
    (`engines.requests`): the streaming explorer takes new weights between its steps."""

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue group requests; `poll` generates them."""
        ...

    @property
    def in_flight(self) -> int:
        """Group requests submitted and not yet returned by `poll`."""
        ...

    def poll(self) -> list[FinishedGroup]:
        """Advance generation by one engine step and return the groups that finished in it
        ([] when nothing is queued)."""
        ...
