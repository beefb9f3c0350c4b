"""Held-out measures smoother than greedy accuracy, for the tests' short runs: the
likelihood of the reference answers and the DPO loss on held-out pairs.

All work on tasks whose reward is an exact match of the answer (the arithmetic tasks): the
response "answer, then end of sequence" is the one that scores 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rft_hpc.algorithms.policy_losses import PolicyLossInputs, dpo_loss
from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import TokenBatch, collate, collate_dpo
from rft_hpc.buffer.offline import task_records
from rft_hpc.tasks.task import Task


@torch.no_grad()
def _sequence_logps(model: torch.nn.Module, tb: TokenBatch, batch_size: int,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs [B] and response token counts [B] of every row of `tb`."""
    sums, counts = [], []
    for i in range(0, tb.input_ids.shape[0], batch_size):
        part = TokenBatch(input_ids=tb.input_ids[i:i + batch_size],
                          attention_mask=tb.attention_mask[i:i + batch_size],
                          targets=tb.targets[i:i + batch_size],
                          loss_mask=tb.loss_mask[i:i + batch_size],
                          old_logprobs=tb.old_logprobs[i:i + batch_size])
        logp = token_logprobs(model, part, temperature).double()
        sums.append(torch.where(part.loss_mask > 0, logp, 0.0).sum(-1))
        counts.append(part.loss_mask.double().sum(-1))
    return torch.cat(sums), torch.cat(counts)


def answer_logprobs(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[Task], *,
                    batch_size: int = 256, temperature: float = 1.0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(answer + EOS | prompt) [N] of each task under `model`, and its token count [N]."""
    was_training = model.training
    model.eval()
    try:
        tb = collate(task_records(tasks, tokenizer, "sft"), pad_id=_pad(tokenizer))
        return _sequence_logps(model, tb, batch_size, temperature)
    finally:
        model.train(was_training)


def heldout_sft_loss(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[Task]) -> float:
    """Token-mean negative log-likelihood of the reference answers (and EOS)."""
    logp, count = answer_logprobs(model, tokenizer, tasks)
    return float(-logp.sum() / count.sum())


def heldout_dpo_loss(model: torch.nn.Module, reference: torch.nn.Module, tokenizer: Any,
                     tasks: Sequence[Task], *, beta: float = 0.1, seed: int = 0) -> float:
    """DPO loss of `model` against `reference` on pairs made from `tasks` (the answer chosen
    over a wrong one, `buffer.offline.task_records`)."""
    pairs = task_records(tasks, tokenizer, "dpo", seed)
    tb = collate_dpo(pairs, pad_id=_pad(tokenizer))  # type: ignore[arg-type]
    modes = [(m, m.training) for m in (model, reference)]
    for m, _ in modes:
        m.eval()
    try:
        logp, _ = _sequence_logps(model, tb, 256, 1.0)
        ref, _ = _sequence_logps(reference, tb, 256, 1.0)
    finally:
        for m, training in modes:
            m.train(training)
    # sequence sums as one-token rows: dpo_loss sums each row's trained tokens
    ones = torch.ones(len(logp), 1, dtype=torch.float64)
    loss, _ = dpo_loss(PolicyLossInputs(logp=logp[:, None], mask=ones, ref_logp=ref[:, None]),
                       beta=beta)
    return float(loss)


def _pad(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(tokenizer.eos_token_id if pad is None else pad)


def heldout_margin(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[Task], *,
                   seed: int = 0) -> float:
    """The mean over pairs made from `tasks` (the answer chosen over a wrong one,
    `buffer.offline.task_records`) of the chosen response's mean log-prob per token minus
    the rejected one's: the margin SimPO and ORPO widen."""
    pairs = task_records(tasks, tokenizer, "dpo", seed)
    tb = collate_dpo(pairs, pad_id=_pad(tokenizer))  # type: ignore[arg-type]
    was_training = model.training
    model.eval()
    try:
        sums, counts = _sequence_logps(model, tb, 256, 1.0)
    finally:
        model.train(was_training)
    mean = sums / counts.clamp(min=1.0)
    return float((mean[0::2] - mean[1::2]).mean())
