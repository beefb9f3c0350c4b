"""What the inference engines return (`Completion`), and their streaming interface: groups
of sampling requests submitted in batches and taken back as they finish (`submit` /
`poll`), so that an explorer keeps the requests of several steps in flight and takes new
weights between engine steps.

A `GroupRequest` asks for `n` completions of one prompt, sample j drawn with `seed + j`, so
a group's samples do not depend on the requests it is batched with. `HFEngine` serves every
queued request in one `generate` call per `poll` (the requests of several steps and the
groups dynamic sampling draws go together); `VLLMEngine` feeds every request to vLLM's
continuous batching and `poll` runs one engine step, returning the groups that finished in
it. Each completion says under which weight versions its tokens were sampled
(`Completion.versions`): a vLLM request in flight when new weights arrive goes on with them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class Completion:
    """One sampled response."""

    tokens: list[int]
    """Response token ids, ending with the stop token (EOS, end of turn) when the model
    finished."""
    logprobs: list[float]
    """Log-prob of each response token under the sampling distribution."""
    text: str
    """The response decoded without special tokens."""
    finished: bool
    """True when the model emitted a stop token within the token budget."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """`(version, first token)` spans: tokens from each span's first token on were sampled
    with that weight version; empty: all with the engine's version when it returned them."""

    @property
    def first_version(self) -> int | None:
        """The weight version of the first token (None: not recorded)."""
        return self.versions[0][0] if self.versions else None

    @property
    def last_version(self) -> int | None:
        """The weight version of the last token (None: not recorded)."""
        return self.versions[-1][0] if self.versions else None


@dataclass(frozen=True)
class GroupRequest:
    """`n` completions of `prompt`; `key` names the group for the caller."""

    key: Hashable
    prompt: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    seed: int
    """Sample j of the group is drawn with seed `seed + j` (both engines)."""


@dataclass
class FinishedGroup:
    """The completions of one `GroupRequest`, in sample order."""

    key: Hashable
    completions: list[Completion]
