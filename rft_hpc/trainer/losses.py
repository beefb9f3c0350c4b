"""Per-token log-probs, GRPO advantages and the losses the trainer minimises.

Shapes: B sequences, L tokens, V vocabulary entries. Per-token tensors are the shifted
[B, L-1] tensors of a `TokenBatch` (position j scores token j+1). Every loss is a
"token-mean": the sum over trained tokens (mask 1) of the whole batch divided by their count,
so long and short responses weigh the same per token. When a batch is split into
micro-batches for gradient accumulation, pass the whole batch's count as `num_tokens` to each
call and sum the results: the gradient is then exactly that of the whole batch.

The trainer's GRPO step uses these; the general algorithm library (more advantages, losses,
aggregation modes, KL estimators) is `rft_hpc.algorithms`, on which they are built.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from rft_hpc.algorithms.advantages import grpo_advantages
from rft_hpc.algorithms.aggregation import LossNorm, masked_mean
from rft_hpc.algorithms.kl import kl_per_token
from rft_hpc.algorithms.policy_losses import PolicyLossInputs, ppo_policy_loss
from rft_hpc.trainer.batching import TokenBatch

__all__ = ["KLKind", "grpo_advantages", "kl_penalty", "masked_mean", "policy_loss",
           "sft_loss", "target_logprobs", "token_logprobs"]

KLKind = Literal["k1", "k2", "k3"]


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


def policy_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, *,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_kind: KLKind = "k3", num_tokens: torch.Tensor | float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate loss, token-mean, plus an optional KL penalty.

    Per trained token: `ratio = exp(new_logp - old_logp)`, `A` = the sequence's advantage,
    `l = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`;
    `loss = masked_mean(l) + kl_coef * kl_penalty(new_logp, ref_logp, kind=kl_kind)`.
    Metrics (detached 0-dim tensors over trained tokens): `clip_fraction` (share of tokens
    where the clipped term is the smaller one, so their gradient is 0), `ratio_mean`,
    `approx_kl` (k3 estimate of KL(old || new): `mean(ratio - 1 - log ratio)`), and `kl_ref`
    when a KL penalty is used.
    """
    norm = None
    if num_tokens is not None:
        norm = LossNorm(num_tokens=float(num_tokens), num_seqs=0.0, max_tokens=1.0)
    loss, parts = ppo_policy_loss(
        PolicyLossInputs(logp=new_logp, mask=loss_mask, old_logp=old_logp,
                         advantages=advantages, norm=norm),
        clip_range_low=clip_low, clip_range_high=clip_high, clip_ratio_c=None)
    metrics = {k: parts[k] for k in ("clip_fraction", "ratio_mean", "approx_kl")}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef is set but no ref_logp was given")
        kl = kl_penalty(new_logp, ref_logp, loss_mask, kl_kind, num_tokens=num_tokens)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    return loss, metrics


def kl_penalty(new_logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
               kind: KLKind = "k3", *,
               num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-mean estimate of KL(new || ref) from tokens sampled by the policy.

    With `d = ref_logp - new_logp` per token: k1 = `-d`; k2 = `d**2 / 2`;
    k3 = `exp(d) - 1 - d` (unbiased like k1, never negative like k2, lowest variance).
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")
    per_token = kl_per_token(new_logp, ref_logp, kind, loss_mask)
    return masked_mean(per_token, loss_mask, num_tokens)


def sft_loss(new_logp: torch.Tensor, loss_mask: torch.Tensor, *,
             num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood: `-sum(new_logp * mask) / sum(mask)`."""
    return masked_mean(-new_logp, loss_mask, num_tokens)
