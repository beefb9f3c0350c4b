"""Rows that begin with the same prompt, run through the model as one packed sequence.

A GRPO group is `repeat` rollouts of one prompt, a DPO pair two responses to one. As padded
rows, the prompt's tokens go through the model once per row; packed, once per group: the
group's sequence is the prompt, then each row's own tokens after it, and a 4D attention mask
lets each of those tokens see the prompt and its own row's earlier tokens only, at the
positions (position ids) it has in its own row. Every row's logits are then those of its
padded row (up to float summation order), gathered back into the batch's [B, L, V] layout,
so the loss never knows: the prompt's logits are shared by the group's rows, and their
gradients add up over the rows as they would over the copies.

What a row may share is what comes before its first trained token (the prompt of a
rollout, a DPO pair's prompt): rows share it when those tokens are identical. Whether the
packed batch is cheaper is estimated from the token and attention work of each layout
(`pack_shared_prompts`); rows that share nothing keep their padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rft_hpc.batch.tokens import TokenBatch

ATTENTION_KINDS = ("sdpa", "eager")
"""Attention implementations that take a custom 4D mask as it is (flash attention does not)."""


@dataclass(frozen=True)
class PackedPrompts:
    """A batch of B rows of L tokens, packed as N sequences of T tokens, one per prompt."""

    input_ids: torch.Tensor  # [N, T] long
    position_ids: torch.Tensor  # [N, T] long: each token's position in its own row
    allowed: torch.Tensor  # [N, 1, T, T] bool: query token t may attend to key token s
    index: torch.Tensor  # [B * L] long: where row b's token j is in the flattened [N * T]
    rows: int
    width: int

    def model_inputs(self, attention: str, dtype: torch.dtype = torch.float32,
                     ) -> dict[str, torch.Tensor]:
        """Keyword arguments of an HF forward over the packed sequences: the mask as a bool
        tensor for `sdpa`, as an additive one of `dtype` for `eager` attention."""
        mask = self.allowed
        if attention == "eager":
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "attention_mask": mask}

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-token outputs [N, T, ...] of the packed sequences as the batch's [B, L, ...]
        (a gather: gradients flow back to the shared positions, summed over the rows)."""
        flat = packed.reshape(-1, *packed.shape[2:])
        return flat.index_select(0, self.index).reshape(self.rows, self.width,
                                                        *packed.shape[2:])

    def to(self, device: torch.device) -> PackedPrompts:
        """The same packing with its tensors on `device`."""
        return PackedPrompts(self.input_ids.to(device), self.position_ids.to(device),
                             self.allowed.to(device), self.index.to(device), self.rows,
                             self.width)


def layout_cost(lengths: list[int], hidden_size: int) -> float:
    """Work of a forward over sequences of `lengths` tokens, in token-layer units: the
    projections and MLP (~12 h^2 per token) and the attention scores (~2 T h per token of a
    sequence of T), divided by 12 h^2."""
    return sum(n * (1.0 + n / (6.0 * hidden_size)) for n in lengths)


def pack_shared_prompts(batch: TokenBatch, hidden_size: int, pad_id: int = 0,
                        ) -> PackedPrompts | None:
    """The batch packed by shared prompt, or None when no two rows share one or the packed
    sequences would not be cheaper (`layout_cost`) than the padded rows."""
    ids = batch.input_ids.cpu().numpy()
    lengths = batch.attention_mask.sum(dim=1).cpu().numpy()
    trained = batch.loss_mask.cpu().numpy() > 0
    rows, width = ids.shape
    groups: dict[tuple[int, bytes], list[int]] = {}
    for b in range(rows):
        n = int(lengths[b])
        first = np.flatnonzero(trained[b])
        # position j's logits score token j + 1: all of them up to the first trained token's
        # position depend on the prompt alone
        prefix = int(first[0]) + 1 if len(first) else n
        groups.setdefault((prefix, ids[b, :prefix].tobytes()), []).append(b)
    if len(groups) == rows:
        return None
    packed_lengths = [prefix + sum(int(lengths[b]) - prefix for b in members)
                      for (prefix, _), members in groups.items()]
    if layout_cost(packed_lengths, hidden_size) >= 0.8 * layout_cost([width] * rows,
                                                                      hidden_size):
        return None
    return _pack(ids, lengths, groups, max(packed_lengths), pad_id)


def _pack(ids: np.ndarray, lengths: np.ndarray, groups: dict[tuple[int, bytes], list[int]],
          span: int, pad_id: int) -> PackedPrompts:
    rows, width = ids.shape
    n_seq = len(groups)
    packed = np.full((n_seq, span), pad_id, dtype=np.int64)
    positions = np.zeros((n_seq, span), dtype=np.int64)
    segment = np.full((n_seq, span), -1, dtype=np.int64)  # -1 padding, 0 prompt, r + 1 row r
    index = np.zeros((rows, width), dtype=np.int64)
    for g, ((prefix, _), members) in enumerate(groups.items()):
        base = g * span
        packed[g, :prefix] = ids[members[0], :prefix]
        positions[g, :prefix] = np.arange(prefix)
        segment[g, :prefix] = 0
        index[members, :] = base  # padding of the rows: any position, it is masked
        index[members, :prefix] = base + np.arange(prefix)
        at = prefix
        for r, b in enumerate(members):
            n = int(lengths[b]) - prefix
            packed[g, at:at + n] = ids[b, prefix:prefix + n]
            positions[g, at:at + n] = np.arange(prefix, prefix + n)
            segment[g, at:at + n] = r + 1
            index[b, prefix:prefix + n] = base + np.arange(at, at + n)
            at += n
    seg = torch.from_numpy(segment)
    causal = torch.ones(span, span, dtype=torch.bool).tril()
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
    # a padding token sees itself only: no row of the mask is empty (NaN in softmax)
    allowed = (causal & same & (seg[:, None, :] >= 0)) | torch.eye(span, dtype=torch.bool)
    return PackedPrompts(torch.from_numpy(packed), torch.from_numpy(positions),
                         allowed.unsqueeze(1), torch.from_numpy(index.reshape(-1)), rows, width)


def attention_kind(model: torch.nn.Module) -> str | None:
    """The attention implementation of an HF model when packing can use it (sdpa, eager),
    else None: flash attention, or a sliding window the custom mask would not apply."""
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None)
    if kind not in ATTENTION_KINDS:
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    return kind
