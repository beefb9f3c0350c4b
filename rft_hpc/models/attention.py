"""Grouped-query attention without copying the keys and values, on CPUs.

Transformers' `sdpa` attention repeats each key/value head for the query heads that share it
(`repeat_kv`, a full copy of the layer's keys and values, and in generation of its whole KV
cache, at every step) unless it may pass `enable_gqa=True` to torch, which it does only
without an attention mask, as CUDA's fast kernels require. Torch's CPU kernels take masked
GQA as they are. Measured on a tiny two-layer Qwen2 (4 query, 2 key/value heads; 32 prompts
x 8 samples of 16 tokens, one thread, 2026-12-06): generation 2.64 s -> 1.22 s with the same
tokens and log-probs; the copy was 35 % of the time.

`use_native_gqa_on_cpu()` registers, in place of `sdpa`, a function that takes this path for
CPU tensors of a GQA layer and hands everything else to transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch

_INSTALLED = False


def _sdpa_with_native_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any,
                          ) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.device.type != "cpu" or groups <= 1 or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    # transformers' rule: causal by flag only when prefilling without a mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_native_gqa_on_cpu() -> None:
    """From now on, in this process, models with `sdpa` attention run grouped-query layers
    on CPU tensors without repeating keys and values (same results); anything else runs
    transformers' `sdpa` unchanged. Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", _sdpa_with_native_gqa)
    _INSTALLED = True
