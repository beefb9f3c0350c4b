"""HF Llama state dict <-> Megatron-core GPTModel state dict, exactly (no arithmetic).

Megatron fuses what HF keeps apart: q/k/v into `linear_qkv` (per query group: that group's
query heads, then its key head, then its value head; the layout that lets tensor
parallelism cut contiguous groups) and gate/up into `linear_fc1` (gate rows, then up rows:
SwiGLU). Layer norms are named after the layer spec: `local` (megatron-core's own modules,
buildable on CPUs) keeps them as modules of their own, `te` (Transformer Engine) folds them
into the following linear layer as `layer_norm_weight`. Rotary embeddings need no
permutation: both sides use the rotate-half convention. The vocabulary is padded with zero
rows to `padded_vocab` (Megatron's vocab-parallel layers need a multiple of the TP size);
the way back drops the padding. docs/megatron.md has the full table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

LayerSpec = Literal["local", "te"]

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LlamaShape:
    """What the conversion needs to know of an HF Llama config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool

    @classmethod
    def from_hf(cls, config: Any) -> LlamaShape:
        """Read a transformers `LlamaConfig` (or anything with its attribute names); refuses
        biases, which this conversion does not map."""
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise ValueError(f"HF config sets {flag}: Llama with biases is not supported")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   vocab_size=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by * tensor_parallel`."""
    step = divisible_by * tensor_parallel
    return -(-vocab_size // step) * step


def _norm_names(spec: LayerSpec) -> tuple[str, str]:
    if spec == "te":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < w.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the model's {w.shape[0]}")
    if rows == w.shape[0]:
        return w.clone()
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape
             ) -> torch.Tensor:
    """HF q/k/v projection weights -> Megatron's `linear_qkv` weight (grouped layout)."""
    groups, d, hidden = shape.num_kv_heads, shape.head_dim, q.shape[1]
    per_group = shape.num_heads // groups
    return torch.cat([q.reshape(groups, per_group * d, hidden),
                      k.reshape(groups, d, hidden),
                      v.reshape(groups, d, hidden)], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, shape: LlamaShape
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: Megatron's `linear_qkv` weight -> HF q, k, v weights."""
    groups, d, hidden = shape.num_kv_heads, shape.head_dim, qkv.shape[1]
    per_group = shape.num_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * d, hidden)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return (q.reshape(-1, hidden).clone(), k.reshape(-1, hidden).clone(),
            v.reshape(-1, hidden).clone())


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: LlamaShape, *,
                   spec: LayerSpec = "local", padded_vocab: int | None = None) -> StateDict:
    """An HF Llama state dict as the state dict of the equivalent GPTModel (TP=PP=1).

    Every tensor is a copy; `megatron_to_hf` gives back exactly the input. Missing or
    unused HF keys raise `KeyError`/`ValueError` naming them.
    """
    rows = padded_vocab or shape.vocab_size
    src = dict(hf)
    take = src.pop
    attn_norm, mlp_norm = _norm_names(spec)
    out: StateDict = {"embedding.word_embeddings.weight":
                      _pad_rows(take("model.embed_tokens.weight"), rows)}
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + attn_norm] = take(h + "input_layernorm.weight").clone()
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(h + "self_attn.q_proj.weight"), take(h + "self_attn.k_proj.weight"),
            take(h + "self_attn.v_proj.weight"), shape)
        out[m + "self_attention.linear_proj.weight"] = take(h + "self_attn.o_proj.weight").clone()
        out[m + mlp_norm] = take(h + "post_attention_layernorm.weight").clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")])
        out[m + "mlp.linear_fc2.weight"] = take(h + "mlp.down_proj.weight").clone()
    out["decoder.final_layernorm.weight"] = take("model.norm.weight").clone()
    head = src.pop("lm_head.weight", None)
    if not shape.tied:
        if head is None:
            raise KeyError("lm_head.weight (the model does not tie its embeddings)")
        out["output_layer.weight"] = _pad_rows(head, rows)
    leftover = sorted(k for k in src if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ValueError(f"HF keys the conversion does not map: {leftover[:5]}")
    return out


def megatron_to_hf(mg: Mapping[str, torch.Tensor], shape: LlamaShape, *,
                   spec: LayerSpec = "local") -> StateDict:
    """A full (gathered) GPTModel state dict as an HF Llama state dict, padding removed.

    `_extra_state` entries (Transformer Engine's FP8 bookkeeping) are ignored; any other key
    that does not map raises `ValueError`. With tied embeddings `lm_head.weight` is left out,
    as transformers saves it.
    """
    src = {k: v for k, v in mg.items() if not k.endswith("._extra_state")}
    take = src.pop
    attn_norm, mlp_norm = _norm_names(spec)
    vocab = shape.vocab_size
    out: StateDict = {"model.embed_tokens.weight":
                      take("embedding.word_embeddings.weight")[:vocab].clone()}
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = take(m + attn_norm).clone()
        q, k, v = split_qkv(take(m + "self_attention.linear_qkv.weight"), shape)
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight").clone()
        out[h + "post_attention_layernorm.weight"] = take(m + mlp_norm).clone()
        gate, up = take(m + "mlp.linear_fc1.weight").chunk(2)
        out[h + "mlp.gate_proj.weight"] = gate.clone()
        out[h + "mlp.up_proj.weight"] = up.clone()
        out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight").clone()
    out["model.norm.weight"] = take("decoder.final_layernorm.weight").clone()
    head = src.pop("output_layer.weight", None)
    if not shape.tied:
        if head is None:
            raise KeyError("output_layer.weight (the model does not tie its embeddings)")
        out["lm_head.weight"] = head[:vocab].clone()
    if src:
        raise ValueError(f"Megatron keys the conversion does not map: {sorted(src)[:5]}")
    return out
