"""The model families a tiny chat model can be built in: each family's transformers config,
special tokens, end-of-turn tokens and chat template.

What is family-specific follows the real models of the family: Qwen2 / Qwen2.5 have q/k/v
biases and, at the small sizes, tied embeddings; Qwen3 has RMSNorms over each head's queries
and keys (q_norm / k_norm) and a head_dim of its own; Llama 3 and Mistral have neither. All
use grouped-query attention, as the real ones do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft_hpc.models import chat_templates

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ChatFamily:
    """A family's tokens, template and transformers config class."""

    name: str
    config_class: str
    """transformers' config class (`Qwen2Config`); its model is the matching ...ForCausalLM."""
    special: tuple[str, ...]
    """Added special tokens, in id order after the 256 bytes."""
    bos: str | None
    eos: str
    """The tokenizer's eos token: the token that ends an assistant turn."""
    pad: str | None
    end_of_turn: tuple[str, ...]
    """generation_config.json's eos_token_id, in this order: generation stops at any."""
    template: str
    tied: bool
    rope_theta: float
    plain: tuple[str, ...] = ()
    """Added tokens that are not special (kept by `decode(skip_special_tokens=True)`)."""
    head_dim: int | None = None
    """None: hidden_size / num_heads."""
    config_bos: str | None = None
    """The token config.json names as bos_token_id when the tokenizer has none (Qwen:
    `<|endoftext|>`)."""

    def config(self, vocab: dict[str, int], rope_theta: float | None = None,
               **shape: int) -> PretrainedConfig:
        """The family's transformers config for a model of `shape` (transformers' keyword
        names) over the tokenizer vocabulary `vocab` (token -> id), with the family's
        `rope_theta` unless one is given."""
        import transformers

        ids = {"bos_token_id": self._bos_id(vocab), "eos_token_id": vocab[self.eos]}
        extra: dict[str, int | None] = {}
        if self.head_dim is not None:
            extra["head_dim"] = self.head_dim
        if self.name == "mistral":
            extra["sliding_window"] = None  # Mistral v0.2 and later: full attention
        cls = getattr(transformers, self.config_class)
        return cls(vocab_size=len(vocab), tie_word_embeddings=self.tied,
                   rope_theta=self.rope_theta if rope_theta is None else rope_theta,
                   rms_norm_eps=1e-6, torch_dtype="float32", **ids, **extra, **shape)

    def generation_ids(self, vocab: dict[str, int]) -> dict[str, int | list[int] | None]:
        """generation_config.json's token ids: eos_token_id lists the end-of-turn tokens (one
        id, as Mistral's, when there is only one)."""
        eos = [vocab[t] for t in self.end_of_turn]
        return {"bos_token_id": self._bos_id(vocab),
                "eos_token_id": eos if len(eos) > 1 else eos[0],
                "pad_token_id": vocab[self.pad] if self.pad else None}

    def _bos_id(self, vocab: dict[str, int]) -> int | None:
        name = self.bos or self.config_bos
        return None if name is None else vocab[name]


FAMILIES: dict[str, ChatFamily] = {
    "qwen2": ChatFamily(
        name="qwen2", config_class="Qwen2Config",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos="<|im_end|>",
        pad="<|endoftext|>", end_of_turn=("<|im_end|>", "<|endoftext|>"),
        template=chat_templates.QWEN2, tied=True, rope_theta=1e6, config_bos="<|endoftext|>"),
    "qwen3": ChatFamily(
        name="qwen3", config_class="Qwen3Config",
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), plain=("<think>", "</think>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        end_of_turn=("<|im_end|>", "<|endoftext|>"), template=chat_templates.QWEN3, tied=True,
        rope_theta=1e6, head_dim=64, config_bos="<|endoftext|>"),
    "llama": ChatFamily(
        name="llama", config_class="LlamaConfig",
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
        end_of_turn=("<|eot_id|>", "<|end_of_text|>"), template=chat_templates.LLAMA3,
        tied=False, rope_theta=5e5),
    "mistral": ChatFamily(
        name="mistral", config_class="MistralConfig",
        special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>", eos="</s>",
        pad=None, end_of_turn=("</s>",), template=chat_templates.MISTRAL, tied=False,
        rope_theta=1e6),
}
