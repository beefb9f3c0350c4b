"""A tiny Llama-architecture model and its tokenizer, built locally from a seed.

The demo and the tests train this model; it is a real Hugging Face model folder
(`config.json`, `model.safetensors`, tokenizer files) that transformers and vLLM load like
any other. head_dim is kept at 32 or more, which vLLM's CPU attention needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rft_hpc.models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

ARITHMETIC_ALPHABET = "0123456789+-*=, "


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model (defaults: ~1 M parameters)."""

    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 256
    alphabet: str = ARITHMETIC_ALPHABET
    seed: int = 0


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a randomly initialised tiny Llama model and its character tokenizer to `out_dir`.

    The same spec gives the same weights. Returns the folder, loadable with
    `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if spec.hidden_size // spec.num_heads < 32:
        raise ValueError("head_dim (hidden_size / num_heads) must be >= 32 for vLLM on CPU")
    out = Path(out_dir)
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
