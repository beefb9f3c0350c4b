"""Tiny models and their tokenizers, built locally from a seed, in each supported family.

The default is the tiny Llama that the demo and most tests train: ~1 M parameters, a
character vocabulary of the arithmetic alphabet, no chat template. `arch` qwen2, qwen3 or
mistral (or llama with `chat`) builds a tiny chat model of that family instead
(`rft_hpc.models.families`): a byte-level tokenizer with the family's special tokens and
chat template, grouped-query attention, the family's own weights (Qwen2's q/k/v biases and
tied embeddings, Qwen3's q/k norms). Each is a real Hugging Face model folder
(`config.json`, `generation_config.json`, `model.safetensors`, tokenizer files) that
transformers and vLLM load like any other. head_dim is kept at 32 or more, which vLLM's
CPU attention needs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rft_hpc.models.families import FAMILIES, ChatFamily
from rft_hpc.models.tokenizer import (
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    build_char_tokenizer,
    learn_merges,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ARITHMETIC_ALPHABET = "0123456789+-*=, "

Arch = Literal["llama", "qwen2", "qwen3", "mistral"]
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")

CHAT_MAX_POSITIONS = 1024
"""Context of the tiny chat models: a templated prompt and its answer, one token per byte."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model (defaults: ~1 M parameters)."""

    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 256
    """Of the character-level Llama; the chat models have `CHAT_MAX_POSITIONS`."""
    alphabet: str = ARITHMETIC_ALPHABET
    """The character-level Llama's vocabulary (the chat models' tokenizers are byte-level)."""
    seed: int = 0
    arch: Arch = "llama"
    chat: bool = False
    """Llama only: its chat model (Llama 3 template) in place of the character-level one.
    The other families are always built as chat models."""
    num_kv_heads: int = 2
    """Key/value heads of the chat models (the character-level Llama has one per head)."""
    merges: int = 0
    """Chat models: BPE merges learned from the corpus `init_tiny_model` is given (the run's
    own prompts), as a real tokenizer writes common words in one token; 0: one per byte."""
    rope_theta: float | None = None
    """Chat models: the rotary base; None: the family's, as its real models have (1e6 for
    Qwen and Mistral, tuned for long contexts)."""


INIT_KINDS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "tiny-llama-chat": TinyModelSpec(chat=True),
    "tiny-qwen2": TinyModelSpec(arch="qwen2"),
    "tiny-qwen3": TinyModelSpec(arch="qwen3"),
    # the CPU recipe's model (configs/recipes/gsm8k-cpu.yaml): two layers learn the word
    # problems' copy-then-add in half the SFT steps of four (test_real_workload)
    "tiny-qwen2-2layer": TinyModelSpec(arch="qwen2", num_layers=2),
    "tiny-mistral": TinyModelSpec(arch="mistral"),
    # the tool recipe's model (configs/recipes/tools-cpu.yaml): Mistral's template prompts
    # the tools in less than half the tokens of Qwen's, and a vocabulary learned from the
    # recipe's prompts (rft_hpc.run.model_init) a third of those: the copy of an account
    # number across a 90-token prompt forms within a few hundred SFT steps, across the
    # 330 tokens of one per byte not within 500. Rotary base 1e4, not Mistral's 1e6 (tuned
    # for long contexts: fewer of a head's frequencies tell nearby positions apart): with
    # 1e6 whether the copy formed in 500 steps depended on the seed and the CPU's float
    # order (200, 124 and 4 of 200 held-out accounts copied into the call; the suite's tool
    # recipe failed on AVX-512 CPUs), with 1e4 it formed at every seed measured
    # (docs/agents.md)
    "tiny-mistral-2layer": TinyModelSpec(arch="mistral", num_layers=2, merges=300,
                                         rope_theta=1e4),
}
"""The models `model.init` may name, with the spec each is built from."""


def is_chat(spec: TinyModelSpec) -> bool:
    """Whether `spec` builds a chat model (everything but the character-level Llama)."""
    return spec.arch != "llama" or spec.chat


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(),
                    corpus: Iterable[str] = ()) -> Path:
    """Write a randomly initialised tiny model of `spec` and its tokenizer to `out_dir`.

    A spec with `merges` learns them from `corpus` (texts as the model will read them,
    the chat template's special tokens included). The same spec and corpus give the same
    tokenizer and weights. Returns the folder, loadable with
    `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained`.
    """
    if spec.arch not in ARCHS:
        raise ValueError(f"unknown arch {spec.arch!r}: choose one of {', '.join(ARCHS)}")
    if spec.hidden_size // spec.num_heads < 32:
        raise ValueError("head_dim (hidden_size / num_heads) must be >= 32 for vLLM on CPU")
    if is_chat(spec):
        return _init_chat_model(Path(out_dir), spec, FAMILIES[spec.arch], corpus)
    return _init_char_llama(Path(out_dir), spec)


def _init_char_llama(out: Path, spec: TinyModelSpec) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_char_tokenizer(out, spec.alphabet)
    vocab = len(SPECIAL_TOKENS) + len(dict.fromkeys(spec.alphabet))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


def init_chat_tokenizer(out: Path, spec: TinyModelSpec, corpus: Iterable[str] = ()) -> Path:
    """Write the tokenizer of the chat model `spec` builds (its family's special tokens
    and chat template; with `merges`, learned from `corpus`) to `out`, and no model."""
    family = FAMILIES[spec.arch]
    merges = learn_merges(_without(corpus, family.special + family.plain), spec.merges) \
        if spec.merges else []
    return build_byte_tokenizer(out, special=family.special, plain=family.plain,
                                bos=family.bos, eos=family.eos, pad=family.pad,
                                chat_template=family.template, merges=merges)


def _init_chat_model(out: Path, spec: TinyModelSpec, family: ChatFamily,
                     corpus: Iterable[str]) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"{spec.num_heads} heads do not split into {spec.num_kv_heads} groups")
    init_chat_tokenizer(out, spec, corpus)
    vocab = AutoTokenizer.from_pretrained(str(out), local_files_only=True).get_vocab()
    config = family.config(
        vocab, rope_theta=spec.rope_theta, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=CHAT_MAX_POSITIONS)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    _distinct_extras(model, spec.seed)
    model.generation_config = GenerationConfig(**family.generation_ids(vocab))
    model.save_pretrained(out, safe_serialization=True)
    return out


def _without(texts: Iterable[str], tokens: Iterable[str]) -> Iterator[str]:
    """The pieces of `texts` between the added `tokens`, which the tokenizer matches whole
    before its merges see the text."""
    split = re.compile("|".join(re.escape(t) for t in tokens))
    for text in texts:
        yield from (piece for piece in split.split(text) if piece)


def _distinct_extras(model: PreTrainedModel, seed: int) -> None:
    """Give the family's own weights values a consumer cannot get right by accident:
    transformers starts biases at 0 and norms at 1, so a loader that dropped Qwen2's q/k/v
    biases or swapped Qwen3's q/k norms would go unnoticed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("_proj.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
