"""A teacher model's log-prob of each token of the student's rollouts: on-policy
distillation's signal (`algorithm.teacher_model`, docs/algorithms.md).

The explorer scores every completed step's records before it writes them, so the trainer
reads the teacher's log-probs from the buffer (`Experience.teacher_logprobs`) and never
holds the teacher: on a cluster the teacher runs beside generation, on the explorers'
devices, and the trainer's memory and time go to the student alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import Experience
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import load_policy


class TeacherScorer(Protocol):
    """Fills in `teacher_logprobs` of rollouts."""

    def score(self, records: Sequence[Experience]) -> None:
        """Set each record's `teacher_logprobs`: the teacher's log-prob of each token, 0
        where the record's response mask is 0."""

    def close(self) -> None:
        """Free the teacher."""


class HFTeacher:
    """A teacher loaded with transformers from a local folder, scoring `batch_size` records
    per forward at the explorer's sampling `temperature` (the student's log-probs are taken
    at it too, so the two compare like for like)."""

    def __init__(self, folder: str | Path, *, vocab: dict[str, int], device: str = "cpu",
                 dtype: str = "float32", temperature: float = 1.0,
                 batch_size: int = 64) -> None:
        """`vocab`: the student's tokenizer's; the teacher must have the same, since it
        scores the student's token ids."""
        tokenizer, model = load_policy(folder, dtype, device)
        if tokenizer.get_vocab() != vocab:
            raise UserError(f"algorithm.teacher_model {str(folder)!r} has another tokenizer "
                            "than the policy: a teacher scores the student's tokens, so both "
                            "must share one vocabulary")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.temperature, self.batch_size = temperature, batch_size

    @torch.no_grad()
    def score(self, records: Sequence[Experience]) -> None:
        """See `TeacherScorer.score`."""
        for start in range(0, len(records), self.batch_size):
            chunk = records[start:start + self.batch_size]
            # padded with token 0: padding lies outside the attention and every read below
            batch = collate(chunk).to(self.device)
            logp = token_logprobs(self.model, batch, self.temperature).float().cpu().numpy()
            for row, record in zip(logp, chunk, strict=True):
                n = len(record.tokens)
                values = np.zeros(n, dtype=np.float32)
                values[1:] = row[:n - 1]
                record.teacher_logprobs = values * (record.response_mask > 0)

    def close(self) -> None:
        """See `TeacherScorer.close`."""
        del self.model


def reverse_kl(records: Sequence[Experience]) -> float:
    """The mean over the records' trained tokens of `log p_student - log p_teacher` (their
    `logprobs` and `teacher_logprobs`): the per-token reverse KL that distillation lowers."""
    gaps = [(r.logprobs - r.teacher_logprobs)[r.response_mask > 0] for r in records
            if r.teacher_logprobs is not None]
    values = np.concatenate(gaps) if gaps else np.zeros(0)
    return float(values.mean()) if len(values) else 0.0
