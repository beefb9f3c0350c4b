"""HF decoder state dict <-> Megatron-core GPTModel state dict, exactly (no arithmetic).

The families: Llama, Mistral (Llama's layout), Qwen2 / Qwen2.5 (biases on q/k/v) and Qwen3
(RMSNorms over each head's queries and keys), tied embeddings or not. Megatron fuses what
HF keeps apart: q/k/v into `linear_qkv` (per query group: that group's query heads, then
its key head, then its value head; the layout that lets tensor parallelism cut contiguous
groups), their biases the same way, and gate/up into `linear_fc1` (gate rows, then up rows:
SwiGLU). Layer norms are named after the layer spec: `local` (megatron-core's own modules,
buildable on CPUs) keeps them as modules of their own, `te` (Transformer Engine) folds them
into the following linear layer as `layer_norm_weight`; Qwen3's q/k norms are
`q_layernorm` / `k_layernorm` in both. Rotary embeddings need no permutation: both sides
use the rotate-half convention. The vocabulary is padded with zero rows to `padded_vocab`
(Megatron's vocab-parallel layers need a multiple of the TP size); the way back drops the
padding. docs/megatron.md has the full table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LayerSpec = Literal["local", "te"]

StateDict = dict[str, torch.Tensor]


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""HF `model_type`s the conversion maps."""


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs to know of an HF decoder config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2), none on the output projection."""
    qk_norm: bool = False
    """RMSNorms over each head's queries and keys before the rotary embedding (Qwen3)."""

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> ModelShape:
        """Read a transformers config of a family in `FAMILIES` (or anything with its
        attribute names; no `model_type` reads as llama); a `ValueError` naming what this
        conversion does not map: another family, biases other than Qwen2's, sliding-window
        attention."""
        family = getattr(config, "model_type", None) or "llama"
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r}: the Megatron conversion maps "
                             f"{', '.join(FAMILIES)}")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise ValueError(f"HF config sets {flag}: {family} with biases on every "
                                 "projection is not supported")
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) \
                or "sliding_attention" in (getattr(config, "layer_types", None) or ()) \
                or (family == "mistral" and window is not None
                    and window < config.max_position_embeddings):
            raise ValueError(f"{family} with sliding-window attention is not supported")
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   vocab_size=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=family == "qwen2", qk_norm=family == "qwen3")


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by * tensor_parallel`."""
    step = divisible_by * tensor_parallel
    return -(-vocab_size // step) * step


def _norm_names(spec: LayerSpec) -> tuple[str, str]:
    if spec == "te":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


_QK_NORMS = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
             ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"))
"""Qwen3's per-head norms: HF name, Megatron name (the same in both layer specs)."""


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < w.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the model's {w.shape[0]}")
    if rows == w.shape[0]:
        return w.clone()
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape
             ) -> torch.Tensor:
    """HF q/k/v projection weights (or biases) -> Megatron's `linear_qkv` weight (or bias),
    in the grouped layout."""
    groups, d, rest = shape.num_kv_heads, shape.head_dim, q.shape[1:]
    per_group = shape.num_heads // groups
    return torch.cat([q.reshape(groups, per_group * d, *rest),
                      k.reshape(groups, d, *rest),
                      v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: Megatron's `linear_qkv` weight (or bias) -> HF q, k, v."""
    groups, d, rest = shape.num_kv_heads, shape.head_dim, qkv.shape[1:]
    per_group = shape.num_heads // groups
    grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return (q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(),
            v.reshape(-1, *rest).clone())


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape, *,
                   spec: LayerSpec = "local", padded_vocab: int | None = None) -> StateDict:
    """An HF state dict as the state dict of the equivalent GPTModel (TP=PP=1).

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
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            out[m + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                take(h + f"self_attn.q_proj.{kind}"), take(h + f"self_attn.k_proj.{kind}"),
                take(h + f"self_attn.v_proj.{kind}"), shape)
        if shape.qk_norm:
            for hf_norm, mg_norm in _QK_NORMS:
                out[m + mg_norm] = take(h + hf_norm).clone()
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


def megatron_to_hf(mg: Mapping[str, torch.Tensor], shape: ModelShape, *,
                   spec: LayerSpec = "local") -> StateDict:
    """A full (gathered) GPTModel state dict as an HF state dict, padding removed.

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
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = split_qkv(take(m + f"self_attention.linear_qkv.{kind}"), shape)
            out[h + f"self_attn.q_proj.{kind}"] = q
            out[h + f"self_attn.k_proj.{kind}"] = k
            out[h + f"self_attn.v_proj.{kind}"] = v
        if shape.qk_norm:
            for hf_norm, mg_norm in _QK_NORMS:
                out[h + hf_norm] = take(m + mg_norm).clone()
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
