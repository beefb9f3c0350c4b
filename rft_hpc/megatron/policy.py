"""This rank's GPTModel shard, answering like a Hugging Face causal LM.

`MegatronPolicy(input_ids=..., attention_mask=...)` returns an object with `.logits` of
shape [B, L, V] (V the model's real vocabulary), as `LlamaForCausalLM` does, so the
trainer's loss code (log-probs, entropy, KL against a reference) runs unchanged on it:

- positions are 0..L-1 and the attention mask is causal plus the padding of
  `attention_mask` (keys on padding are masked), built here on the input's device: the
  trainer's batches are right-padded, so real tokens see what they see in transformers;
- with tensor parallelism the output layer's logits are vocab-parallel; they are gathered
  over the TP group (megatron-core's `gather_from_tensor_model_parallel_region`: all-gather
  forward, split backward), then the padded vocabulary rows are cut off, so they never
  enter a softmax. Every TP rank therefore computes the same loss on the same rows, and the
  backward hands each rank the gradient of its own vocabulary slice.

`build_policy` turns an HF model's weights into this rank's shard (convert + shard +
load); `MegatronPolicy.hf_state` gathers them back (a collective of every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from rft_hpc.megatron.convert import ModelShape, StateDict, hf_to_megatron, padded_vocab_size
from rft_hpc.megatron.model import build_gpt_model, load_megatron_state, weights_of
from rft_hpc.megatron.publish import gather_hf_state
from rft_hpc.megatron.shards import Layout, shard_state

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class CausalLMOutput:
    """What the trainer reads of a forward pass."""

    logits: torch.Tensor


class MegatronPolicy(torch.nn.Module):
    """A GPTModel shard with an HF-style forward (see the module doc). Its parameters are
    the GPTModel's, named as megatron-core names them (`self.gpt.named_parameters()`)."""

    def __init__(self, gpt: torch.nn.Module, hf_config: PretrainedConfig, layout: Layout,
                 padded_vocab: int, tp_rank: int, stage: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.hf_config = hf_config
        self.shape = ModelShape.from_hf(hf_config)
        self.layout, self.padded_vocab = layout, padded_vocab
        self.tp_rank, self.stage = tp_rank, stage

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False, **_: object) -> CausalLMOutput:
        """Logits [B, L, V] of the real vocabulary for right-padded `input_ids`."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        b, length = input_ids.shape
        device = input_ids.device
        positions = torch.arange(length, device=device).expand(b, length)
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)
        mask = mask[None, None]
        if attention_mask is not None:
            mask = mask | (attention_mask == 0)[:, None, None, :]
        logits = self.gpt(input_ids, positions, mask)
        if self.layout.tensor_parallel > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return CausalLMOutput(logits=logits[..., :self.shape.vocab_size])

    def shard_of(self, hf: StateDict) -> StateDict:
        """This rank's Megatron shard of a full HF state dict (or of tensors shaped like
        the weights, such as optimizer moments): exact copies, vocabulary padded with 0."""
        full = hf_to_megatron(hf, self.shape, padded_vocab=self.padded_vocab)
        return shard_state(full, self.layout)[self.stage, self.tp_rank]

    def load_hf(self, hf: StateDict) -> None:
        """Load this rank's shard of a full HF state dict into the GPTModel."""
        device = next(self.gpt.parameters()).device
        load_megatron_state(self.gpt, {k: v.to(device) for k, v in self.shard_of(hf).items()})

    def hf_state(self) -> StateDict:
        """The full HF state dict on CPU, on global rank 0 (empty elsewhere): a collective
        of every rank (`publish.gather_hf_state`). With tied embeddings `lm_head.weight` is
        the embedding itself, as in transformers' own state dict (an HF engine loads it
        strictly)."""
        full = self.hf_gather(weights_of(self.gpt))
        if full and self.shape.tied:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        return full

    def hf_gather(self, local: StateDict) -> StateDict:
        """Any Megatron-keyed shard dict (weights, moments) gathered to full HF tensors on
        CPU on global rank 0 (empty elsewhere): a collective of every rank. With data
        parallelism only the first replica's ranks gather (the others hold the same)."""
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_rank() > 0:
            return {}
        # gathered on the device (NCCL moves CUDA tensors only), then copied to the CPU
        full = gather_hf_state({k: v.detach() for k, v in local.items()}, self.shape,
                               self.layout)
        return {} if full is None else {k: v.cpu() for k, v in full.items()}


def build_policy(hf_model: torch.nn.Module, *, tensor_parallel: int, pipeline_parallel: int,
                 divisible_by: int, device: torch.device,
                 recompute: bool = False) -> MegatronPolicy:
    """This rank's GPTModel shard with `hf_model`'s weights, in `hf_model`'s dtype, on
    `device` (`recompute`: activation checkpointing of every layer). megatron-core's
    `parallel_state` must be initialised with these sizes."""
    from megatron.core import parallel_state

    # an HF model's config: nn.Module's __getattr__ types every attribute Tensor | Module
    config = cast("PretrainedConfig", hf_model.config)
    shape = ModelShape.from_hf(config)
    layout = Layout.for_model(shape, tensor_parallel, pipeline_parallel)
    vocab = padded_vocab_size(shape.vocab_size, tensor_parallel, divisible_by)
    dtype = next(hf_model.parameters()).dtype
    gpt = build_gpt_model(config, padded_vocab=vocab, tensor_parallel=tensor_parallel,
                          pipeline_parallel=pipeline_parallel, dtype=dtype,
                          cpu_init=device.type == "cpu", recompute=recompute)
    if device.type != "cpu":
        gpt = gpt.to(device)
    policy = MegatronPolicy(gpt, config, layout, vocab,
                            parallel_state.get_tensor_model_parallel_rank(),
                            parallel_state.get_pipeline_model_parallel_rank())
    policy.load_hf({k: v.detach().cpu() for k, v in hf_model.state_dict().items()})
    return policy
