"""Per-token log-probs of a `TokenBatch` under a model: what the trainer, the held-out
evaluation and the engines' checks all compute the same way.

Shapes: B sequences, L tokens, V vocabulary entries; the result is the shifted [B, L-1]
tensor of a `TokenBatch` (position j scores token j+1).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rft_hpc.batch.tokens import TokenBatch


def token_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0, *,
                   chunk_size: int = 4096) -> torch.Tensor:
    """log p(targets[b, j] | input_ids[b, :j+1]) under `model`, sampled at `temperature`.

    Returns [B, L-1] (float32, or float64 for a float64 model):
    `log_softmax(logits[:, :-1] / temperature)` gathered at `targets`. Values on padding
    are meaningless; mask them. See `target_logprobs` for the memory use.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   use_cache=False).logits
    return target_logprobs(logits, batch.targets, temperature, chunk_size=chunk_size)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                    chunk_size: int = 4096) -> torch.Tensor:
    """`log_softmax(logits[:, :-1] / temperature)` gathered at `targets` [B, L-1].

    Computed as `x[target] - logsumexp(x)` over `chunk_size` rows of the vocabulary at a
    time, with `x = logits / temperature` in float32: no [B, L, V] log-softmax, scaled or
    upcast copy of the logits is ever made, in the forward or the backward pass (the backward
    recomputes the softmax chunk by chunk). Autograd keeps only the logits themselves.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    b, length, _ = logits.shape
    if targets.shape != (b, length - 1):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, "
                         f"logits {tuple(logits.shape)} need ({b}, {length - 1})")
    return _TargetLogProbs.apply(logits, targets, float(temperature), chunk_size)


class _TargetLogProbs(torch.autograd.Function):
    """Chunked gather-minus-logsumexp whose backward is softmax-minus-one-hot, chunked."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size):  # type: ignore[override]
        b, length, vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows = logits.reshape(b * length, vocab)
        # pad targets to L columns (last column: dummy token 0), so rows are uniform
        flat_targets = torch.nn.functional.pad(targets, (0, 1)).reshape(-1, 1)
        out = torch.empty(b * length, dtype=dtype, device=logits.device)
        for start in range(0, b * length, chunk_size):
            x = rows[start:start + chunk_size].to(dtype) / temperature
            t = flat_targets[start:start + chunk_size]
            out[start:start + chunk_size] = (x.gather(-1, t).squeeze(-1)
                                             - torch.logsumexp(x, dim=-1))
        ctx.save_for_backward(logits, flat_targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.reshape(b, length)[:, :-1].contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, flat_targets = ctx.saved_tensors
        b, length, vocab = logits.shape
        go = torch.nn.functional.pad(grad_out, (0, 1)).reshape(-1, 1)  # last column: 0
        grad = torch.empty((b * length, vocab), dtype=logits.dtype, device=logits.device)
        rows = logits.reshape(b * length, vocab)
        for start in range(0, b * length, ctx.chunk_size):
            end = start + ctx.chunk_size
            x = rows[start:end].to(go.dtype) / ctx.temperature
            g = torch.softmax(x, dim=-1).mul_(-go[start:end])
            g.scatter_add_(-1, flat_targets[start:end], go[start:end])
            grad[start:end] = g.div_(ctx.temperature)
        return grad.reshape(b, length, vocab), None, None, None
