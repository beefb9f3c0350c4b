"""Turn buffer records into padded token tensors for next-token prediction.

Position `j` of every shifted tensor (`targets`, `loss_mask`, `old_logprobs`) is about the
prediction of token `j + 1` from tokens `0..j`, which is what `logits[:, j]` scores. The first
token of a sequence is never predicted, so its mask entry is dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rft_hpc.buffer.records import DPOPair, Experience, SFTSample


@dataclass(frozen=True)
class TokenBatch:
    """A right-padded batch of B sequences of at most L tokens."""

    input_ids: torch.Tensor  # [B, L] long, pad_id after each sequence
    attention_mask: torch.Tensor  # [B, L] long, 1 on real tokens
    targets: torch.Tensor  # [B, L-1] long, input_ids[:, 1:]
    loss_mask: torch.Tensor  # [B, L-1] float32, response_mask[:, 1:], 0 on padding
    old_logprobs: torch.Tensor  # [B, L-1] float32, rollout log-probs[:, 1:]; unknown (NaN) -> 0
    rewards: torch.Tensor | None = None  # [B] float32, when every record is an Experience
    group_ids: torch.Tensor | None = None  # [B] long, when every record is an Experience
    # [B] bool, when every record is an Experience: every trained token of the record has a
    # known rollout log-prob (False: imported data, recompute old log-probs before PPO/GRPO)
    has_old_logprobs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> torch.Tensor:
        """Number of trained tokens (sum of `loss_mask`), a 0-dim tensor."""
        return self.loss_mask.sum()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        """The same batch with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TokenBatch(**{name: None if t is None else t.to(device, non_blocking=non_blocking)
                             for name, t in moved.items()})

    def select(self, rows: torch.Tensor) -> TokenBatch:
        """The batch restricted to `rows` (an index tensor); itself when that is every row."""
        if len(rows) == self.input_ids.shape[0]:
            return self
        picked = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TokenBatch(**{name: None if t is None else t[rows] for name, t in picked.items()})


def collate(records: Sequence[Experience | SFTSample], pad_id: int = 0) -> TokenBatch:
    """Pad `records` to the longest one and build the shifted next-token tensors.

    `rewards`, `group_ids` and `has_old_logprobs` are set only when every record is an
    `Experience`. Records without rollout log-probs (SFT samples) get `old_logprobs` 0.
    """
    if not records:
        raise ValueError("cannot collate an empty list of records")
    n_rows, width = len(records), max(len(r.tokens) for r in records)
    ids = np.full((n_rows, width), pad_id, dtype=np.int64)
    attention = np.zeros((n_rows, width), dtype=np.int64)
    mask = np.zeros((n_rows, width), dtype=np.float32)
    logprobs = np.zeros((n_rows, width), dtype=np.float32)
    for i, record in enumerate(records):
        n = len(record.tokens)
        ids[i, :n] = record.tokens
        attention[i, :n] = 1
        mask[i, :n] = record.response_mask
        if isinstance(record, Experience):
            logprobs[i, :n] = record.logprobs
    known = ~np.isnan(logprobs[:, 1:]) | (mask[:, 1:] == 0)
    batch = TokenBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attention),
        targets=torch.from_numpy(ids[:, 1:].copy()),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        old_logprobs=torch.from_numpy(np.where(np.isnan(logprobs[:, 1:]), 0.0, logprobs[:, 1:])
                                      .astype(np.float32)),
    )
    if all(isinstance(r, Experience) for r in records):
        batch = dataclasses.replace(
            batch,
            rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
            group_ids=torch.tensor([r.group_id for r in records], dtype=torch.long),
            has_old_logprobs=torch.from_numpy(known.all(axis=1)))
    return batch


def collate_dpo(pairs: Sequence[DPOPair], pad_id: int = 0) -> TokenBatch:
    """Collate DPO pairs as interleaved rows: row 2i is pair i's prompt + chosen response,
    row 2i+1 its prompt + rejected response; the responses are the trained tokens.

    The layout `rft_hpc.algorithms.dpo_loss` expects. Rows of one pair stay adjacent, so a
    micro-batch of an even number of rows holds whole pairs.
    """
    rows = [SFTSample(tokens=tokens, prompt_length=pair.prompt_length)
            for pair in pairs for tokens in (pair.chosen_tokens, pair.rejected_tokens)]
    return collate(rows, pad_id=pad_id)


KTO_ROWS_PER_PAIR = 3
"""Rows of each pair in a KTO batch (`collate_kto`): chosen, rejected, mismatched."""


def collate_kto(pairs: Sequence[DPOPair], pad_id: int = 0) -> TokenBatch:
    """Collate preference pairs for KTO (`algorithms.kto`): per pair i, row 3i its prompt +
    chosen response (desirable), row 3i+1 its prompt + rejected response (undesirable),
    row 3i+2 its prompt + the chosen response of pair i+1 (the last pair's: the first's; a
    lone pair's: its own), whose log-prob ratio estimates KTO's reference point. The
    responses are the trained tokens; the three rows of a pair stay adjacent."""
    rows = []
    for i, pair in enumerate(pairs):
        other = pairs[(i + 1) % len(pairs)]
        p = pair.prompt_length
        mismatched = np.r_[pair.chosen_tokens[:p], other.chosen_tokens[other.prompt_length:]]
        rows += [SFTSample(tokens=tokens, prompt_length=p)
                 for tokens in (pair.chosen_tokens, pair.rejected_tokens, mismatched)]
    return collate(rows, pad_id=pad_id)
